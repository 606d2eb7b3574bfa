"""Empirical privacy audits: claimed vs audited epsilon; table + JSON + figures.

    python benchmarks/audit.py --data-dir ../shared/data/mnist --out results/audit.json

1. White-box step audit (``clipless.diagnostics.audit_step``) of one private step of the main job's model
   (the 64-128-10 Lipschitz MLP of ``clipless train``, tau-CE, input bound 8), at the noise multipliers
   ``--sigmas``: unsubsampled (q = 1) and, with ``--sample-rates``, Poisson-subsampled; plus one row with a
   deliberate calibration bug (``--bug-noise-scale`` times the planned noise).  Each row runs ``--trials``
   steps on D and as many on D' (the real DPOptimizer step each time).
2. One-run black-box audit (``clipless.diagnostics.one_run_audit``, Steinke et al. 2023) of the MNIST recipe
   (scattering features, 1-Lipschitz linear head, ``benchmarks/mnist.py`` settings) at ``--one-run-epsilons``,
   with ``--canaries`` mislabelled training records, each included with probability 1/2.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import clipless as cl
from clipless.cli import ONE_RUN_NOTE
from clipless.diagnostics import audit_step, loss_scores, mislabelled_canaries, one_run_audit
from clipless.diagnostics.plots import plot_audit_scores, plot_audit_tightness
from report import print_table, write_json


def step_rows(args) -> list:
    rows = []
    settings = [(s, 1.0, 1.0) for s in args.sigmas] + [(s, q, 1.0) for q in args.sample_rates for s in args.sigmas]
    settings.append((1.0, 1.0, args.bug_noise_scale))
    for sigma, q, scale in settings:
        torch.manual_seed(args.seed)
        model = cl.lipschitz_mlp((1, 8, 8), 10, hidden=(128,))
        start = time.perf_counter()
        result = audit_step(model, cl.TauCrossEntropy(8.0), input_shape=(1, 8, 8), input_bound=8.0,
                            noise_multiplier=sigma, sample_rate=q, trials=args.trials, confidence=args.confidence,
                            noise_scale=scale, progress=args.progress)
        seconds = time.perf_counter() - start
        d = result.details
        rows.append({"noise_multiplier": sigma, "sample_rate": q, "noise_scale": scale,
                     "epsilon_claimed": result.epsilon_claimed, "epsilon_lower": result.epsilon_lower,
                     "epsilon_lower_threshold_test": d["epsilon_lower_threshold_test"],
                     **({"epsilon_lower_gdp": d["epsilon_lower_gdp"], "mu_estimate": d["mu_estimate"]}
                        if "epsilon_lower_gdp" in d else {}),
                     "mu_planned": d["mu_planned"], "canary_bound_ratio": d["canary_bound_ratio"],
                     "ratio": result.epsilon_lower / result.epsilon_claimed, "verdict": result.verdict,
                     "trials": args.trials, "seconds": seconds})
        if q == 1.0 and scale == 1.0 and sigma == 1.0:
            plot_audit_scores(result, Path(args.figures) / "audit_step_scores.png")
        print(f"  sigma {sigma:g} q {q:g} scale {scale:g}: {result.summary_line()} ({seconds:.0f} s)", flush=True)
    return rows


def one_run_rows(args) -> list:
    from clipless.data.features import scattering_split

    torch.manual_seed(args.seed)
    start = time.perf_counter()
    data = scattering_split(cl.load_mnist(args.data_dir), radius=1.0, progress=args.progress)
    print(f"  scattering features: {time.perf_counter() - start:.0f} s", flush=True)
    rest, cx, cy = mislabelled_canaries(data.train, args.canaries, data.num_classes,
                                         torch.Generator().manual_seed(args.seed))
    rows = []
    for eps in args.one_run_epsilons:
        info: dict = {}

        def train(train_set):
            torch.manual_seed(args.seed)
            model = cl.lipschitz_mlp(data.input_shape, 10, hidden=(), input_clip=1.0, projection="spectral")
            model.append(cl.LossGradientClip(0.25))
            trainer = cl.PrivateTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), cl.TauCrossEntropy(64.0),
                                        train_set, input_shape=data.input_shape, batch_size=4096, delta=1e-5,
                                        epochs=args.epochs, target_epsilon=eps, test_data=data.test,
                                        progress=args.progress, log=None)
            fitted = trainer.fit()
            info.update(test_accuracy=fitted.test_accuracy, steps=fitted.steps)
            return trainer.eval_model(), fitted.epsilon

        start = time.perf_counter()
        result = one_run_audit(train, rest, (cx, cy), lambda m, x, y: loss_scores(m, cl.TauCrossEntropy(64.0), x, y),
                               delta=1e-5, confidence=args.confidence)
        seconds = time.perf_counter() - start
        if eps == max(args.one_run_epsilons):
            plot_audit_scores(result, Path(args.figures) / "audit_one_run_scores.png")
        rows.append({"target_epsilon": eps, "epsilon_claimed": result.epsilon_claimed,
                     "epsilon_lower": result.epsilon_lower, "verdict": result.verdict, "canaries": args.canaries,
                     "guesses": result.details["guesses"], "correct": result.details["correct"],
                     "auroc": result.details["auroc"], "seconds": seconds, **info})
        print(f"  {result.summary_line()}, test accuracy {info['test_accuracy']:.4f} ({seconds:.0f} s)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="../shared/data/mnist")
    p.add_argument("--sigmas", type=float, nargs="*", default=[0.5, 1.0, 2.0, 4.0])
    p.add_argument("--sample-rates", type=float, nargs="*", default=[0.1], help="subsampled step audits (q < 1)")
    p.add_argument("--bug-noise-scale", type=float, default=0.5)
    p.add_argument("--trials", type=int, default=5000, help="steps on each of D and D' per step audit")
    p.add_argument("--one-run-epsilons", type=float, nargs="*", default=[2.0, 4.0, 8.0])
    p.add_argument("--canaries", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--figures", default="docs/figures")
    p.add_argument("--out", default="results/audit.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print("white-box step audits", flush=True)
    steps = step_rows(args)
    print_table(
        f"{'sigma':>6} {'q':>5} {'noise x':>7} {'claimed':>8} {'lower':>7} {'lower/claimed':>13} {'GDP lower':>9} "
        f"{'CP lower':>8} {'mu planned':>10} {'mu est.':>7} {'verdict':>10} {'s':>5}",
        [f"{r['noise_multiplier']:6.2f} {r['sample_rate']:5.2f} {r['noise_scale']:7.2f} {r['epsilon_claimed']:8.3f} "
         f"{r['epsilon_lower']:7.3f} {r['ratio']:13.3f} {r.get('epsilon_lower_gdp', float('nan')):9.3f} "
         f"{r['epsilon_lower_threshold_test']:8.3f} {r['mu_planned']:10.3f} {r.get('mu_estimate', float('nan')):7.3f} "
         f"{r['verdict']:>10} {r['seconds']:5.0f}" for r in steps],
    )
    tight = [r for r in steps if r["sample_rate"] == 1.0 and r["noise_scale"] == 1.0]
    plot_audit_tightness(tight, Path(args.figures) / "audit_tightness.png")
    one_run = []
    if args.one_run_epsilons:
        print("one-run audits (MNIST)", flush=True)
        one_run = one_run_rows(args)
        print_table(
            f"{'target eps':>10} {'claimed':>8} {'lower':>7} {'guesses':>7} {'correct':>7} {'AUROC':>6} "
            f"{'test acc':>8} {'s':>5}",
            [f"{r['target_epsilon']:10.1f} {r['epsilon_claimed']:8.3f} {r['epsilon_lower']:7.3f} {r['guesses']:7d} "
             f"{r['correct']:7d} {r['auroc']:6.3f} {r['test_accuracy']:8.4f} {r['seconds']:5.0f}" for r in one_run],
        )
    write_json(args.out, {"config": vars(args), "torch": torch.__version__, "step_audits": steps, "one_run": one_run,
                          "one_run_note": ONE_RUN_NOTE})


if __name__ == "__main__":
    main()
