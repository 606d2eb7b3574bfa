"""Command line: ``clipless train`` (flags and/or a YAML config), ``clipless pretrain``, ``clipless kl-study``."""

from __future__ import annotations

import argparse
import gc
import io
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .contrastive.evaluation import LAYERS
from .contrastive.logit_dp import CROSS_TERMS
from .nn.models import LR_SCHEDULES, check_activation
from .privacy.calibration import BudgetExhaustedError
from .train.allocator import tune_cpu_allocator

DEFAULTS: Dict[str, Any] = {
    "method": "clipless",
    "max_grad_norm": 1.0,
    "dataset": "digits",
    "data_dir": None,
    "num_classes": None,
    "model": "mlp",
    "hidden": [],
    "channels": [16, 32],
    "patch_size": 4,
    "features": "auto",
    "colour_space": "rgb",
    "activation": "maxmin",
    "conv": "lipschitz",
    "input_clip": None,
    "loss": "tau_ce",
    "tau": 16.0,
    "loss_grad_clip": 0.25,
    "adaptive_clip_quantile": None,
    "count_noise_multiplier": None,
    "epsilon": 3.0,
    "delta": 1e-5,
    "noise_multiplier": None,
    "batch_size": 1024,
    "max_physical_batch_size": None,
    "epochs": 80,
    "strategy": "global",
    "layer_noise": "equal",
    "accountant": "pld",
    "optimizer": "adam",
    "lr": 0.01,
    "lr_schedule": "constant",
    "seed": 0,
    "noise_seed": None,
    "secure_noise": False,
    "augmult": 1,
    "average_decay": None,
    "augment_shift": 2,
    "augment_flip": False,
    "log_train_stats": False,
    "output_dir": "runs/latest",
    "resume": False,
    "progress": True,
}



def _number(kind: type, low: Optional[float] = None, high: Optional[float] = None, *, low_open: bool = True,
            high_open: bool = True, optional: bool = False):
    """A checker for a real (float) or integer setting in (low, high) ('open' ends exclude the bound)."""
    def check(value: Any) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, str) and kind is float:
            try:  # PyYAML 1.1 reads 1e-5 (no dot) as a string
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, float) and kind is int and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and isinstance(value, float)):
            raise ValueError(f"must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        value = kind(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"must be finite, got {value!r}")
        if low is not None and (value < low or (low_open and value == low)):
            raise ValueError(f"must be {'>' if low_open else '>='} {low:g}, got {value!r}")
        if high is not None and (value > high or (high_open and value == high)):
            raise ValueError(f"must be {'<' if high_open else '<='} {high:g}, got {value!r}")
        return value
    return check


def _choice(*options: str, optional: bool = False):
    def check(value: Any) -> Any:
        if value is None and optional:
            return None
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {value!r}")
        return value
    return check


def _text(optional: bool = False):
    def check(value: Any) -> Any:
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            raise ValueError(f"must be a non-empty string, got {value!r}")
        return value
    return check


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")
    return value


# Tensor sizes past this fail inside torch with a C++ trace ("Overflow when unpacking long long"); below it, a size
# too large for the machine's memory is refused by main as one line.
_MAX_SIZE = 2 ** 31


def _widths(value: Any) -> List[int]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"must be a list of positive integers such as [64], got {value!r}")
    try:
        return [_number(int, 0, _MAX_SIZE)(v) for v in value]
    except ValueError as err:
        raise ValueError(f"each width {err}") from None


# The type and range of every setting, for YAML files and flags alike, checked before anything runs.
SCHEMA: Dict[str, Any] = {
    "method": _choice("clipless", "dpsgd", "nonprivate"),
    "max_grad_norm": _number(float, 0),
    "dataset": _text(),
    "data_dir": _text(optional=True),
    "num_classes": _number(int, 2, low_open=False, optional=True),
    "model": _choice("mlp", "cnn", "vgg", "resnet", "mixer"),
    "hidden": _widths,
    "channels": _widths,
    "patch_size": _number(int, 0),
    "features": _choice("auto", "none", "scattering"),
    "colour_space": _choice("rgb", "hsv", "yuv", "grayscale"),
    "activation": check_activation,
    "conv": _choice("lipschitz", "orthogonal", "orthogonal_fixed"),
    "input_clip": _number(float, 0, optional=True),
    "loss": _choice("tau_ce", "ce", "hinge", "kr", "hkr", "kcosine"),
    "tau": _number(float, 0),
    "loss_grad_clip": _number(float, 0, optional=True),
    "adaptive_clip_quantile": _number(float, 0, 1, optional=True),
    "count_noise_multiplier": _number(float, 0, optional=True),
    "average_decay": _number(float, 0, 1, optional=True),
    "epsilon": _number(float, 0, optional=True),
    "delta": _number(float, 0, 1),
    "noise_multiplier": _number(float, 0, optional=True),
    "batch_size": _number(float, 0),
    "max_physical_batch_size": _number(int, 1, low_open=False, optional=True),
    "epochs": _number(int, 1, low_open=False),
    "strategy": _choice("global", "per_layer"),
    "layer_noise": _choice("equal", "energy"),
    "accountant": _choice("pld", "rdp"),
    "optimizer": _choice("adam", "sgd"),
    "lr": _number(float, 0),
    "lr_schedule": _choice(*LR_SCHEDULES),
    "seed": _number(int, -2 ** 53, 2 ** 53),  # torch's seeds are 64-bit: "Overflow when unpacking long long"
    "noise_seed": _number(int, 0, low_open=False, optional=True),  # -1 is no "random" here: omit it for OS entropy
    "secure_noise": _flag,
    "augmult": _number(int, 1, low_open=False),
    "augment_shift": _number(int, 0, low_open=False),
    "augment_flip": _flag,
    "log_train_stats": _flag,
    "output_dir": _text(),
    "resume": _flag,
    "progress": _flag,
}
assert set(SCHEMA) == set(DEFAULTS)


def validate(config: Dict[str, Any], source: str = "") -> Dict[str, Any]:
    """``config`` with every value checked against :data:`SCHEMA` (numbers normalised); SystemExit names the
    first bad setting."""
    checked = {}
    for key, value in config.items():
        try:
            checked[key] = SCHEMA[key](value)
        except ValueError as err:
            flag = "--" + key.replace("_", "-")
            raise SystemExit(f"{flag}{source}: {err}") from None
    return checked


SEED_HELP = ("public seed of the initialization and the train/test split (-1: random); never used for the "
             "noise or the batches")
NOISE_SEED_HELP = ("fix the noise and Poisson-sampling generators (experiments only: the run is then NOT private "
                   "against anyone who knows the seed); default: OS entropy")
TRAIN_STATS_HELP = ("also log the loss/accuracy of the training batches and the run's times, computed WITHOUT "
                    "noise (outside the guarantee: the times grow with the secret batch sizes; labelled nonprivate_* "
                    "wherever they appear)")
SECURE_NOISE_HELP = ("draw each noise value as a sum of 4 Gaussian draws, against floating-point attacks on the "
                     "sampler (as Opacus' secure_mode; 4 times the draws)")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """The options of a training run, shared by ``train`` and ``audit`` (one schema, :data:`SCHEMA`)."""
    p.add_argument("--config", help="YAML file with any of the options below (flags override it)")
    p.add_argument("--method", choices=["clipless", "dpsgd", "nonprivate"],
                   help="clipless DP-SGD (default), clipped DP-SGD through Opacus, or non-private training")
    p.add_argument("--max-grad-norm", type=float, help="per-example clipping norm C of dpsgd")
    p.add_argument("--dataset", help="digits (embedded), mnist (its IDX files), idx (any grayscale IDX images), "
                   "cifar10 (its python-version directory), imagefolder (a tree of class folders), or a .npz/.csv "
                   "tabular file")
    p.add_argument("--data-dir", help="directory holding the dataset files (IDX, CIFAR-10 batches, image folders, "
                   "tabular files)")
    p.add_argument("--num-classes", type=int,
                   help="idx: the number of classes, labels 0..K-1 (default: read from the test labels, never from "
                        "the training ones); the other datasets declare their own")
    p.add_argument("--model", choices=["mlp", "cnn", "vgg", "resnet", "mixer"],
                   help="Lipschitz architecture (mlp, cnn, vgg, resnet, mixer)")
    p.add_argument("--hidden", type=int, nargs="*", help="hidden widths of the dense layers")
    p.add_argument("--channels", type=int, nargs="*",
                   help="conv channels per stage (cnn, vgg, resnet); mixer: the first value is the token width")
    p.add_argument("--patch-size", type=int, help="mixer: side of the square patches (must tile the image)")
    p.add_argument("--features", choices=["auto", "none", "scattering"],
                   help="scattering: train on fixed wavelet scattering features of the images (data-independent, "
                   "norm 1; the model must be mlp); auto (default): scattering for images into an mlp, else none")
    p.add_argument("--colour-space", choices=["rgb", "hsv", "yuv", "grayscale"],
                   help="colour images: the fixed per-pixel map applied before anything else (data-independent; "
                   "default rgb)")
    p.add_argument("--activation", help="maxmin or groupsortK")
    p.add_argument("--conv", choices=["lipschitz", "orthogonal", "orthogonal_fixed"],
                   help="convolutions of cnn, vgg and resnet: lipschitz (operator norm <= 1, the default), "
                   "orthogonal (BCOP, gradient-norm preserving) or orthogonal_fixed (BCOP with fixed spatial "
                   "projectors: only the channel mixing is trained)")
    p.add_argument("--input-clip", type=float, help="clip every input to this L2 norm (data-independent)")
    p.add_argument("--loss", choices=["tau_ce", "ce", "hinge", "kr", "hkr", "kcosine"])
    p.add_argument("--tau", type=float, help="temperature of tau_ce")
    clip = p.add_mutually_exclusive_group()
    clip.add_argument("--loss-grad-clip", type=float,
                      help="clip each example's logit gradient to C (L -> min(L, C)); default 0.25 "
                      "(--no-loss-grad-clip, or null in a YAML file, turns it off)")
    clip.add_argument("--no-loss-grad-clip", action="store_true",
                      help="no loss-gradient clip (the model's bound alone)")
    p.add_argument("--adaptive-clip-quantile", type=float,
                   help="make the loss-gradient clip adaptive: C tracks this private quantile of the logit "
                   "gradient norms (Andrew et al.), starting at --loss-grad-clip; its cost enters epsilon")
    p.add_argument("--count-noise-multiplier", type=float,
                   help="noise multiplier of the adaptive clip's count (default: batch size / 20)")
    p.add_argument("--average-decay", type=float,
                   help="evaluate and ship an exponential moving average of the released iterates with this decay "
                   "(post-processing: no privacy cost); default off")
    p.add_argument("--epsilon", type=float, help="target epsilon (sigma is calibrated to reach it)")
    p.add_argument("--delta", type=float)
    p.add_argument("--noise-multiplier", type=float,
                   help="fix sigma instead of calibrating it (the steps stop at --epsilon, default 3)")
    p.add_argument("--batch-size", type=float, help="expected Poisson batch size")
    p.add_argument("--max-physical-batch-size", type=int, metavar="N",
                   help="forward and backward each Poisson batch in parts of at most N examples, then step once: "
                   "the same steps in the memory of a part (as Opacus' BatchMemoryManager); default: whole batches")
    p.add_argument("--epochs", type=int)
    p.add_argument("--strategy", choices=["global", "per_layer"])
    p.add_argument("--layer-noise", choices=["equal", "energy"],
                   help="with --strategy per_layer: the same sigma for every layer (equal) or sigma_d proportional "
                   "to (p_d g_d^2)^(-1/4), which minimises the total noise energy (energy; from the bounds and "
                   "sizes only, never the data); epsilon is the same")
    p.add_argument("--accountant", choices=["pld", "rdp"])
    p.add_argument("--optimizer", choices=["adam", "sgd"])
    p.add_argument("--lr", type=float)
    p.add_argument("--lr-schedule", choices=list(LR_SCHEDULES),
                   help="the learning rate over the epochs: constant, or cosine decay to 0 (CosineAnnealingLR, stepped "
                   "per epoch; a function of the epoch count, no privacy cost); the same for every --method")
    p.add_argument("--seed", type=int, help=SEED_HELP)
    p.add_argument("--noise-seed", type=int, help=NOISE_SEED_HELP)
    p.add_argument("--augmult", type=int, help="augmentation multiplicity K: each example's gradient is the mean over "
                   "K random shifts (and flips) of it; the per-example bound, noise and epsilon are unchanged")
    p.add_argument("--augment-shift", type=int, help="largest random translation in pixels, zero-filled (with --augmult)")
    p.add_argument("--augment-flip", action="store_true", default=None,
                   help="also random horizontal flips (natural images, not digits; with --augmult)")
    p.add_argument("--log-train-stats", action="store_true", default=None, help=TRAIN_STATS_HELP)
    p.add_argument("--secure-noise", action="store_true", default=None, help=SECURE_NOISE_HELP)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clipless", description="Differentially private training without clipping.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="private training; prints accuracy and epsilon, writes result.json")
    _add_run_options(train)
    train.add_argument("--output-dir", help="where result.json and checkpoint.pt go")
    train.add_argument("--resume", action="store_true", default=None, help="resume from output-dir/checkpoint.pt")
    train.add_argument("--no-progress", dest="progress", action="store_false", default=None)

    export = sub.add_parser("export", help="a finished (or checkpointed) run's model as a torch.export program of "
                            "standard torch layers, loadable without clipless; checks it against the model on the "
                            "test split")
    export.add_argument("--output-dir", default=DEFAULTS["output_dir"], help="the run's directory (its checkpoint.pt)")
    export.add_argument("--out", help="file to write (default: output-dir/model.pt2; torch.export.load reads it)")
    export.add_argument("--inputs-within-bound", action="store_true",
                        help="drop the model's input clip (deployment inputs have norm <= its bound)")

    audit = sub.add_parser("audit", help="empirical privacy audit of a clipless run: an epsilon lower bound at a stated "
                           "confidence next to the claimed epsilon; writes audit.json and audit.png")
    _add_run_options(audit)
    audit.add_argument("--mode", choices=["step", "one-run"], default="step",
                       help="step: white-box audit of one private step of the configured model at its planned sigma "
                       "(many steps on D and D' = D + a crafted canary); one-run: black-box audit of one full "
                       "training run with --trials mislabelled canaries, each included with probability 1/2")
    audit.add_argument("--trials", type=int, help="step: steps on each of D and D' (default 2000); one-run: "
                       "canaries (default min(1000, N/4))")
    audit.add_argument("--confidence", type=float, default=0.95, help="confidence of the lower bound")
    audit.add_argument("--sampling", choices=["full", "poisson"], default="full",
                       help="step mode: audit the unsubsampled step (full) or the Poisson-subsampled step of the run")
    audit.add_argument("--noise-scale", type=float, default=1.0,
                       help="DIAGNOSTIC: draw S times the planned noise while claiming the plan (a deliberate "
                       "calibration bug the audit should report as a VIOLATION)")
    audit.add_argument("--output-dir", help="where audit.json and audit.png go")
    audit.add_argument("--no-progress", dest="progress", action="store_false", default=None)

    pre = sub.add_parser("pretrain", help="private contrastive/spreadout pre-training (Logit-DP, Naive-DP, "
                         "non-private); prints kNN accuracy and epsilon, writes result.json")
    pre.add_argument("--method", choices=["logit_dp", "naive_dp", "nonprivate"], default="logit_dp")
    pre.add_argument("--loss", choices=["contrastive", "spreadout", "spectral"], default="contrastive",
                     help="contrastive (InfoNCE; Logit-DP sensitivity 2 (B/tau)(1 + e^(2/tau))), spectral (HaoChen "
                     "et al.: -2 Z_ii + the mean of Z_ij^2 over the other pairs; sensitivity (2B/tau)(1 + 3/tau), "
                     "so small temperatures stay affordable) or spreadout (tau = 1 only)")
    pre.add_argument("--dataset", choices=["digits", "mnist"], default="digits")
    pre.add_argument("--data-dir", help="directory with the MNIST IDX .gz files")
    pre.add_argument("--encoder", choices=["mlp", "cnn"], default="mlp")
    pre.add_argument("--hidden", type=int, nargs="*", default=[256], help="hidden widths of the encoder")
    pre.add_argument("--channels", type=int, nargs="*", default=[16, 32], help="conv channels (cnn encoder)")
    pre.add_argument("--input-pool", type=int, default=1, metavar="K",
                     help="average K x K pixel windows of each view before the encoder: K^2 fewer positions per "
                     "convolution, hence cheaper Logit-DP steps for the cnn encoder")
    pre.add_argument("--embedding-dim", type=int, default=32)
    pre.add_argument("--cross-term", choices=CROSS_TERMS, default="exact",
                     help="logit_dp: exact pair gradient norms, or cauchy_schwarz: clip by an upper bound whose "
                     "convolution part skips the pairs' exact cross term (faster cnn steps, more clipping, same "
                     "epsilon)")
    pre.add_argument("--tau", type=float, default=1.0, help="temperature of the similarity logits")
    pre.add_argument("--clip-norm", type=float, default=1.0,
                     help="B (per pair gradient, logit_dp) or C (whole batch gradient, naive_dp)")
    pre.add_argument("--epsilon", type=float, default=5.0,
                     help="target epsilon: sigma is calibrated to reach it, or with --noise-multiplier the run "
                     "stops before passing it")
    pre.add_argument("--delta", type=float, default=1e-5)
    pre.add_argument("--noise-multiplier", type=float,
                     help="fix sigma instead of calibrating it (the steps stop at --epsilon, default 5)")
    pre.add_argument("--batch-size", type=float, default=256, help="expected Poisson batch size (pairs)")
    pre.add_argument("--epochs", type=int, default=10)
    pre.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    pre.add_argument("--lr", type=float, default=1e-3)
    pre.add_argument("--crop-padding", type=int, help="random-crop shift in pixels (default 2 for mnist, 1 for digits)")
    pre.add_argument("--no-flip", dest="flip", action="store_false", help="no random horizontal flips")
    pre.add_argument("--blur", type=float, default=0.0, help="Gaussian blur of each view with probability 1/2, "
                     "width uniform in [0.1, BLUR] pixels (0: off)")
    pre.add_argument("--pixel-noise", type=float, default=0.0, help="std of Gaussian noise added to each view")
    pre.add_argument("--probe-labels", type=int, nargs="*", default=[], metavar="K",
                     help="also report linear probes trained on K labels per class of the test split's labelled "
                     "half, e.g. --probe-labels 10 100 (benchmarks/logit_dp_probe.py)")
    pre.add_argument("--evaluate-layer", choices=LAYERS, default="embedding",
                     help="what kNN and the probes read: the normalized embedding the loss sees, or the "
                     "representation before the encoder's last Linear (SimCLR's h under its projection)")
    pre.add_argument("--accountant", choices=["pld", "rdp"], default="pld")
    pre.add_argument("--seed", type=int, default=0, help=SEED_HELP)
    pre.add_argument("--noise-seed", type=int, help=NOISE_SEED_HELP + " (augmentations of the pairs too)")
    pre.add_argument("--log-train-stats", action="store_true", help=TRAIN_STATS_HELP.replace(
        "loss/accuracy of the training batches", "fraction of clipped pair gradients"))
    pre.add_argument("--secure-noise", action="store_true", help=SECURE_NOISE_HELP)
    pre.add_argument("--output-dir", default="runs/pretrain")
    pre.add_argument("--resume", action="store_true", help="resume from output-dir/checkpoint.pt")
    pre.add_argument("--no-progress", dest="progress", action="store_false", default=None)

    eps = sub.add_parser("epsilon", help="the privacy of a planned run without training: epsilon at a noise "
                         "multiplier, or the noise multiplier of a target epsilon, by the noise plan every run uses")
    eps.add_argument("--records", type=int, required=True, help="training records N (Poisson sampling over them)")
    eps.add_argument("--batch-size", type=float, required=True, help="expected batch size b (sample rate b / N)")
    eps.add_argument("--epochs", type=int, required=True, help="epochs, of round(N / b) steps each")
    eps.add_argument("--noise-multiplier", type=float, help="the step's noise multiplier sigma; with --epsilon, the "
                     "steps stop where the budget does, as a training run's do")
    eps.add_argument("--epsilon", type=float, help="target epsilon: the smallest sigma within it for these steps")
    eps.add_argument("--delta", type=float, default=DEFAULTS["delta"])
    eps.add_argument("--accountant", default=DEFAULTS["accountant"], help="pld or rdp (dp-accounting)")
    eps.add_argument("--json", action="store_true", help="print the plan as JSON")

    kl = sub.add_parser("kl-study", help="KL privacy of noisy GD without clipping (two-class MNIST); JSON + PNG plots")
    kl.add_argument("--data-dir", required=True, help="directory with the MNIST IDX .gz files")
    kl.add_argument("--digits", type=int, nargs=2, default=[0, 1])
    kl.add_argument("--n-train", type=int, default=1000)
    kl.add_argument("--n-heldout", type=int, default=1000, help="held-out records that may be added (neighbours)")
    kl.add_argument("--inits", nargs="*", default=["lecun", "xavier", "he", "ntk"])
    kl.add_argument("--width", type=int, default=128, help="hidden width of the steps and depth experiments")
    kl.add_argument("--depth", type=int, default=2, help="layers of the steps and width experiments")
    kl.add_argument("--widths", type=int, nargs="*", default=[32, 64, 128, 256])
    kl.add_argument("--depths", type=int, nargs="*", default=[2, 3, 4, 5])
    kl.add_argument("--eta", type=float, default=0.5, help="learning rate of noisy GD")
    kl.add_argument("--sigma", type=float, default=0.003, help="Langevin temperature: noise variance 2 eta sigma^2")
    kl.add_argument("--steps", type=int, default=100, help="full-batch steps (epochs) of the long training")
    kl.add_argument("--short-steps", type=int, default=5, help="steps of the short training")
    kl.add_argument("--mia-sigma", type=float, default=0.03, help="sigma of the membership-attack runs")
    kl.add_argument("--runs", type=int, default=2, help="independent runs (init and noise seeds) per configuration")
    kl.add_argument("--seed", type=int, default=0)
    kl.add_argument("--output-dir", default="runs/kl-study")
    kl.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    for command in (train, audit, pre, kl):
        command.add_argument("--system-allocator", action="store_true",
                             help="leave the C allocator's defaults: by default (Linux, glibc) freed memory up to "
                             "32 MiB a block is kept for the next step, which saves re-faulting activation pages "
                             "(clipless.train.allocator; resident memory then stays near its peak)")
    return parser


# What a resumed run may change: nothing here touches the privacy analysis, the model or the data.
RESUME_APPLICABLE = ("lr", "progress", "log_train_stats", "secure_noise", "data_dir", "output_dir", "resume",
                     "max_physical_batch_size")


def _on_a_terminal() -> bool:
    """Progress bars by default only where someone watches: redrawn bars fill logs and pipes with ``\r`` lines."""
    return sys.stderr.isatty()


def resolve_config(args: argparse.Namespace) -> Dict[str, Any]:
    """Defaults <- YAML config <- command-line flags; on ``--resume``, the checkpoint's run configuration
    with only the settings of :data:`RESUME_APPLICABLE` taken from the command."""
    config = dict(DEFAULTS)
    explicit = set()
    if args.config:
        loaded = _read_yaml(args.config)
        config.update(validate(loaded, f" (in {args.config})"))
        explicit |= set(loaded)
    flags = {key: value for key, value in vars(args).items() if key in DEFAULTS and value is not None}
    if getattr(args, "no_loss_grad_clip", False):
        flags["loss_grad_clip"] = None
    config.update(validate(flags))
    explicit |= set(flags)
    if "progress" not in explicit:
        config["progress"] = _on_a_terminal()
    if config["epsilon"] is None and config["noise_multiplier"] is None:
        raise SystemExit("--epsilon: give a target epsilon or a --noise-multiplier")
    if config["resume"]:
        config = _resumed_config(config, explicit)
    return config


class _DuplicateKey(Exception):
    """A YAML mapping with a key twice: ``(key, first line, second line)``."""


def _unique_key_loader(yaml: Any) -> Any:
    """PyYAML's safe loader, except that a mapping with a key twice is refused: ``safe_load`` keeps the last
    value without a word, so ``epsilon: 1`` followed by ``epsilon: 8`` would run at 8."""

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: Dict[Any, int] = {}
                for key_node, _ in node.value:
                    key = self.construct_object(key_node, deep=deep)
                    try:
                        if key in seen:
                            raise _DuplicateKey(key, seen[key], key_node.start_mark.line + 1)
                        seen[key] = key_node.start_mark.line + 1
                    except TypeError:  # an unhashable key: the base class names it
                        continue
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _read_yaml(path: str) -> Dict[str, Any]:
    """The YAML config as a dict with underscore keys; keys may be spelt as flags (``batch-size``) or not."""
    from .extras import require

    yaml = require("yaml", "yaml")

    try:
        with open(path) as fh:
            loaded = yaml.load(fh, Loader=_unique_key_loader(yaml))
    except OSError as err:
        raise SystemExit(f"--config: cannot read {path}: {err.strerror or err}") from None
    except _DuplicateKey as err:
        raise SystemExit(f"--config: {path} sets {err.args[0]} twice (lines {err.args[1]} and {err.args[2]}): "
                         "YAML would keep the last one silently; keep one") from None
    except yaml.YAMLError as err:
        raise SystemExit(f"--config: {path} is not valid YAML ({str(err).splitlines()[0]})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise SystemExit(f"--config: {path} must be a mapping of settings (key: value), got {type(loaded).__name__}")
    config: Dict[str, Any] = {}
    for key, value in loaded.items():
        name = str(key).replace("-", "_")
        if name not in DEFAULTS:
            raise SystemExit(f"--config: unknown key {key!r} in {path}; the keys are the option names of "
                             "'clipless train --help' (batch-size or batch_size)")
        if name in config:
            raise SystemExit(f"--config: {path} sets {name.replace('_', '-')} twice")
        config[name] = value
    return config


def _resumed_config(config: Dict[str, Any], explicit: set) -> Dict[str, Any]:
    """The run configuration stored in the checkpoint; refuses any other change than :data:`RESUME_APPLICABLE`."""
    from .train.trainer import PrivateTrainer

    if config["method"] != "clipless":
        raise SystemExit(f"--resume: --method {config['method']} keeps no checkpoint; only clipless runs resume")
    ckpt = Path(config["output_dir"]) / "checkpoint.pt"
    if not ckpt.exists():
        raise SystemExit(f"--resume: no checkpoint at {ckpt}")
    saved = PrivateTrainer.read_run_config(ckpt)
    if saved is None:
        raise SystemExit(f"--resume: {ckpt} does not record its run configuration (written by an older version or "
                         "the Python API); resume it with PrivateTrainer.load_checkpoint and the same settings")
    changed = sorted(k for k in explicit - set(RESUME_APPLICABLE) if k in saved and saved[k] != config[k])
    if changed:
        detail = ", ".join(f"{k}={saved[k]!r} -> {config[k]!r}" for k in changed)
        raise SystemExit(f"--resume: the run in {ckpt} was made with other settings ({detail}); a resumed run keeps "
                         "its privacy, model and data settings: drop these options, or start a new run in another "
                         "--output-dir")
    resumed = {**DEFAULTS, **saved}
    applied = []
    for key in RESUME_APPLICABLE:
        if key in explicit or key in ("resume", "output_dir"):
            if resumed.get(key) != config[key] and key not in ("resume", "output_dir"):
                applied.append(f"{key}={config[key]!r} (was {resumed.get(key)!r})")
            resumed[key] = config[key]
    print(f"resume: settings of {ckpt}" + (f"; applied {', '.join(applied)}" if applied else ""), file=sys.stderr)
    return resumed


def _prepare_data(config: Dict[str, Any]) -> Tuple[Any, Tuple[int, ...], Optional[int]]:
    """The dataset of ``config`` (scattering features applied), its input shape, and the public seed."""
    from .data.datasets import convert_split_colour_space, load_dataset

    seed: Optional[int] = None if config["seed"] is None or config["seed"] < 0 else int(config["seed"])
    if seed is not None:
        torch.manual_seed(seed)
    data = load_dataset(config["dataset"], config["data_dir"], seed=seed or 0, num_classes=config["num_classes"])
    shape = data.input_shape
    if config["colour_space"] != "rgb":
        if len(shape) != 3 or shape[0] != 3:
            raise SystemExit(f"--colour-space {config['colour_space']} needs RGB images; {data.name} has shape {shape}")
        data = convert_split_colour_space(data, config["colour_space"])
        shape = data.input_shape
    if config["features"] == "auto":  # the fixed scattering front-end wherever it applies: images into an MLP
        config["features"] = "scattering" if config["model"] == "mlp" and len(shape) == 3 else "none"
    if config["features"] == "scattering":
        from .data.features import scattering_split

        if config["model"] != "mlp" or len(shape) != 3:
            raise SystemExit("--features scattering needs image data and --model mlp (the features are a vector)")
        data = scattering_split(data, radius=1.0, progress=bool(config["progress"]))
        shape = data.input_shape
    return data, shape, seed


def _build_clipless(config: Dict[str, Any], data: Any, shape: Tuple[int, ...]) -> Tuple[Any, Any, Any, Optional[float]]:
    """``(model, loss, optimizer, input_bound)`` of a clipless run: the same for training and audits."""
    from .nn.clipping import AdaptiveLossGradientClip, LossGradientClip
    from .nn.models import build_loss, build_model, build_optimizer

    classes = data.num_classes
    model_kwargs: Dict[str, Any] = {"input_clip": config["input_clip"], "activation": config["activation"]}
    if config["model"] != "mlp":
        if len(shape) != 3:
            raise SystemExit(f"the {config['model']} needs image inputs (C, H, W); {data.name} has shape {shape}")
        model_kwargs["channels"] = config["channels"]
    if config["model"] in ("cnn", "vgg", "resnet"):
        model_kwargs["conv"] = config["conv"]
    elif config["conv"] != "lipschitz":
        raise SystemExit(f"--conv {config['conv']} applies to the cnn, vgg and resnet models, not {config['model']}")
    if config["model"] == "mixer":
        model_kwargs.update(channels=config["channels"][0], patch_size=config["patch_size"])
    model_kwargs["hidden"] = config["hidden"]
    model = build_model(config["model"], shape, classes, **model_kwargs)
    if config["adaptive_clip_quantile"] is not None:
        if config["loss_grad_clip"] is None:
            raise SystemExit("--adaptive-clip-quantile needs --loss-grad-clip as the initial clip norm")
        count_sigma = config["count_noise_multiplier"] or float(config["batch_size"]) / 20
        model.append(AdaptiveLossGradientClip(float(config["loss_grad_clip"]), count_noise_multiplier=count_sigma,
                                              target_quantile=float(config["adaptive_clip_quantile"])))
    elif config["loss_grad_clip"] is not None:
        model.append(LossGradientClip(float(config["loss_grad_clip"])))
    loss_kwargs = {"tau": config["tau"]} if config["loss"] == "tau_ce" else {}
    loss = build_loss(config["loss"], classes, **loss_kwargs)
    optimizer = build_optimizer(model.parameters(), config["optimizer"], config["lr"])
    # Without an InputNormClip layer, the data must respect a fixed bound: pixel data in [0, 1]
    # has norm <= sqrt(dim); tabular data has no natural bound, so an input clip is required.
    input_bound = None
    if config["input_clip"] is None:
        if config["features"] == "scattering":
            input_bound = 1.0  # every feature vector has norm exactly 1 (or 0)
        elif data.coordinate_bound is not None:  # set by the image loaders, never by a file's name
            input_bound = data.coordinate_bound * float(torch.tensor(shape).prod().sqrt())
        else:
            raise SystemExit("tabular data has no fixed norm bound: pass --input-clip C")
    return model, loss, optimizer, input_bound


def _trainer(config: Dict[str, Any], model: Any, loss: Any, optimizer: Any, train_data: Any, test_data: Any,
             shape: Tuple[int, ...], input_bound: Optional[float], checkpoint: Optional[Path]) -> Any:
    from .nn.models import build_lr_schedule
    from .train.trainer import PrivateTrainer

    return PrivateTrainer(
        model,
        optimizer,
        loss,
        train_data,
        input_shape=shape,
        batch_size=config["batch_size"],
        delta=config["delta"],
        epochs=config["epochs"],
        target_epsilon=config["epsilon"],
        noise_multiplier=config["noise_multiplier"],
        input_bound=input_bound,
        strategy=config["strategy"],
        layer_noise_multipliers=_layer_noise(config),
        accountant=config["accountant"],
        noise_seed=config["noise_seed"],
        test_data=test_data,
        progress=bool(config["progress"]),
        checkpoint_path=checkpoint,
        log_train_stats=bool(config["log_train_stats"]),
        secure_noise=bool(config["secure_noise"]),
        lr_scheduler=build_lr_schedule(config["lr_schedule"], int(config["epochs"])),
        augmentation_multiplicity=config["augmult"],
        augment=_augmentation(config, shape),
        average_decay=config["average_decay"],
        max_physical_batch_size=config["max_physical_batch_size"],
    )


def _layer_noise(config: Dict[str, Any]) -> Optional[str]:
    """The relative per-layer noise multipliers of the run (``'energy'``), or ``None`` for equal ones."""
    if config["layer_noise"] == "equal":
        return None
    if config["strategy"] != "per_layer":
        raise SystemExit(f"--layer-noise {config['layer_noise']} allocates noise between layers: it needs "
                         "--strategy per_layer")
    return config["layer_noise"]


def _augmentation(config: Dict[str, Any], shape: Tuple[int, ...]) -> Any:
    if config["augmult"] == 1:
        return None
    if len(shape) != 3:
        raise SystemExit(f"--augmult shifts images, but the model's inputs have shape {tuple(shape)} "
                         f"(--features {config['features']}): use --features none")
    from .data.augment import ImageAugmentation

    return ImageAugmentation(config["augment_shift"], config["augment_flip"])


def _refuse_unread(unread: Dict[str, Tuple[bool, str]]) -> None:
    """Refuse the first setting given that nothing of the run reads: ``{flag: (given, why it would not be used)}``."""
    for flag, (given, why) in unread.items():
        if given:
            raise SystemExit(f"{flag} would not be used: {why}")


def run_train(config: Dict[str, Any]) -> Dict[str, Any]:
    if config["method"] != "clipless" and torch.distributed.is_initialized():
        raise SystemExit(f"--method {config['method']}: the baselines run in one process; only clipless training is "
                         "distributed")
    # A setting the chosen method would not read is refused, not dropped: a baseline run "with" an adaptive clip,
    # another loss or a per-layer strategy would be reported as if it had them.
    clipless_only = {"--augmult": config["augmult"] > 1, "--conv": config["conv"] != "lipschitz",
                     "--average-decay": config["average_decay"] is not None,
                     "--layer-noise": config["layer_noise"] != "equal",
                     "--strategy": config["strategy"] != DEFAULTS["strategy"],
                     "--adaptive-clip-quantile": config["adaptive_clip_quantile"] is not None,
                     "--count-noise-multiplier": config["count_noise_multiplier"] is not None,
                     "--loss": config["loss"] != DEFAULTS["loss"], "--tau": config["tau"] != DEFAULTS["tau"],
                     "--loss-grad-clip": config["loss_grad_clip"] != DEFAULTS["loss_grad_clip"],
                     "--input-clip": config["input_clip"] is not None,
                     "--activation": config["activation"] != DEFAULTS["activation"],
                     "--augment-flip": bool(config["augment_flip"])}
    for flag, used in clipless_only.items():
        if used and config["method"] != "clipless":
            raise SystemExit(f"{flag} is an option of clipless training, not of --method {config['method']}")
    # Likewise a setting the chosen model, loss or option would not read ("--channels 64" for the mlp would be
    # reported in result.json's config as if the run had used it).
    unread = {"--channels": (config["model"] == "mlp" and list(config["channels"]) != list(DEFAULTS["channels"]),
                             "the mlp has no convolutions (its widths are --hidden)"),
              "--patch-size": (config["model"] != "mixer" and config["patch_size"] != DEFAULTS["patch_size"],
                               f"it is the mixer's patch side, and the model is {config['model']}"),
              "--tau": (config["loss"] != "tau_ce" and config["tau"] != DEFAULTS["tau"],
                        f"it is the temperature of --loss tau_ce, not of --loss {config['loss']}"),
              "--count-noise-multiplier": (config["adaptive_clip_quantile"] is None
                                           and config["count_noise_multiplier"] is not None,
                                           "it is the adaptive clip's count noise: give --adaptive-clip-quantile"),
              "--augment-shift": (config["augmult"] == 1 and config["augment_shift"] != DEFAULTS["augment_shift"],
                                  "augmented copies are made with --augmult K > 1 only"),
              "--augment-flip": (config["augmult"] == 1 and bool(config["augment_flip"]),
                                 "augmented copies are made with --augmult K > 1 only")}
    if config["method"] == "nonprivate":  # (--epsilon, --delta and --accountant pass: scripts give every method them)
        for flag, key in (("--noise-multiplier", "noise_multiplier"), ("--noise-seed", "noise_seed")):
            unread[flag] = (config[key] != DEFAULTS[key], "--method nonprivate adds no noise")
    _refuse_unread(unread)
    if config["model"] == "mlp" and not config["hidden"] and config["activation"] != DEFAULTS["activation"]:
        raise SystemExit(f"--activation {config['activation']}: the mlp has no hidden layer (--hidden is empty), "
                         "so no activation would be used; give --hidden widths or drop --activation")
    if config["method"] != "dpsgd" and config["max_grad_norm"] != DEFAULTS["max_grad_norm"]:
        raise SystemExit(f"--max-grad-norm is the clipping norm of --method dpsgd, not of --method {config['method']}")
    if config["method"] == "nonprivate" and config["secure_noise"]:
        raise SystemExit("--secure-noise draws the noise of a private run; --method nonprivate adds none")
    _layer_noise(config)  # refuses an allocation without --strategy per_layer before any data is read
    if config["model"] != "mlp" and not config["channels"]:
        raise SystemExit(f"--channels: the {config['model']} needs at least one width, got none")
    data, shape, seed = _prepare_data(config)
    if config["method"] != "clipless":
        return run_baseline(config, data, seed)
    model, loss, optimizer, input_bound = _build_clipless(config, data, shape)
    out_dir = Path(config["output_dir"])
    trainer = _trainer(config, model, loss, optimizer, data.train, data.test, shape, input_bound,
                       out_dir / "checkpoint.pt")
    trainer.run_config = {k: v for k, v in config.items() if k != "resume"}
    if config["resume"]:
        trainer.load_checkpoint(out_dir / "checkpoint.pt")
        for group in trainer.optimizer.param_groups:  # the checkpoint's optimizer state restored the old one
            group["lr"] = config["lr"]
    if trainer.rank == 0:
        prepare_output_dir(out_dir, () if config["resume"] else TRAIN_FILES)
    result = trainer.fit().to_dict()
    result.update({"dataset": data.name, "config": config, "sampling": "poisson (add/remove neighbours)",
                   "processes": trainer.world_size})
    if trainer.rank != 0:
        return result
    _write_result(out_dir, result)
    return _write_training_plot(out_dir, result, f"{data.name}: clipless, epsilon {result['epsilon']:.3g}")


def run_export(out_dir: Path, path: Optional[Path], inputs_within_bound: bool) -> Dict[str, Any]:
    """Rebuild the run's model from its checkpoint (the projected average when the run averaged iterates),
    export it to standard layers, compare both on the test split, and write its ``torch.export`` program
    (batch size free) atomically."""
    import io

    from .nn.export import export
    from .privacy.accounting import PrivacyAccountant
    from .privacy.modules import project_all_
    from .privacy.randomness import randomness_label
    from .train.checkpoint import load_checkpoint, write_atomically

    target = path or out_dir / "model.pt2"
    if target.is_dir():
        raise SystemExit(f"clipless export: --out {target} is a directory; give a file name "
                         f"(e.g. {target / 'model.pt2'})")
    if target.exists() and not _is_export_archive(target):  # an earlier export is replaced, nothing else
        raise SystemExit(f"clipless export: --out {target} exists and is not an earlier export (a torch.export "
                         "archive); it is left as it is: give another file name")
    state = load_checkpoint(out_dir / "checkpoint.pt", kind="training")
    saved = state.get("run_config")
    if not saved:
        raise SystemExit(f"clipless export: {out_dir / 'checkpoint.pt'} records no run configuration; export the model "
                         "in Python with clipless.export(model, input_shape)")
    config = validate({**DEFAULTS, **saved})
    data, shape, _ = _prepare_data(config)
    model, *_ = _build_clipless(config, data, shape)
    averaged = state.get("averaged_model")
    model.load_state_dict(averaged if averaged is not None else state["model"])
    if averaged is not None:  # what the run evaluated and shipped: the projected average (PrivateTrainer.eval_model)
        project_all_(model)
    exported = export(model, shape, inputs_within_bound=inputs_within_bound)
    model.eval()
    x = torch.stack([data.test[i][0] for i in range(min(len(data.test), 1000))])
    with torch.no_grad():
        ours, theirs = model(x), exported(x)
    buffer = io.BytesIO()
    batch = torch.export.Dim("batch", min=1)
    torch.export.save(torch.export.export(exported, (x[:2],), dynamic_shapes=({0: batch},)), buffer)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(target, buffer.getvalue())
    # the exported model is a release: it carries the guarantee of the steps that made it, or says it has none
    accountant = PrivacyAccountant(state["accountant"]["mechanism"])
    accountant.load_state_dict(state["accountant"])
    return {"path": str(target), "layers": len(exported), "checked_examples": int(x.shape[0]),
            "max_abs_difference": float((ours - theirs).abs().max()),
            "prediction_agreement": float((ours.argmax(1) == theirs.argmax(1)).float().mean()),
            "epsilon": accountant.get_epsilon(config["delta"]), "delta": config["delta"],
            "accountant": accountant.mechanism, "steps": int(state["steps"]), **randomness_label(config["noise_seed"])}


def _is_export_archive(path: Path) -> bool:
    """Whether ``path`` is a ``torch.export.save`` archive (a zip holding ``archive_format``)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("archive_format") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _write_result(out_dir: Path, result: Dict[str, Any], name: str = "result.json") -> Dict[str, Any]:
    from .train.checkpoint import write_atomically

    write_atomically(out_dir / name, json.dumps(result, indent=2, default=str).encode())
    return result


def _write_training_plot(out_dir: Path, result: Dict[str, Any], title: str) -> Dict[str, Any]:
    """``training.png`` (held-out score and epsilon per epoch) beside result.json, when matplotlib is installed;
    written after result.json, so a run stopped while writing that keeps its previous result and figure."""
    try:
        from .diagnostics.plots import plot_training

        plot_training(result.get("history") or [], out_dir / "training.png", title)
    except ImportError as err:  # matplotlib is an optional extra
        print(f"no plot: {err}", file=sys.stderr)
    return result


# The files each command writes into its output directory: those of an earlier run there are kept (moved aside).
# A training run's directory also holds its export (`clipless export`'s default): it goes with its run, so that
# the directory never pairs a new run with the model of an earlier one.
TRAIN_FILES = ("result.json", "training.png", "checkpoint.pt", "checkpoint.pt.key", "model.pt2")
PRETRAIN_FILES = TRAIN_FILES[:4] + ("encoder.pt",)
AUDIT_FILES = ("audit.json", "audit.png")


def prepare_output_dir(out_dir: Path, earlier: Sequence[str] = ()) -> None:
    """Create ``out_dir`` and prove it writable, before any training (nothing is left behind by the check); the files
    of ``earlier`` that it holds already (an earlier run's) are moved into ``out_dir/earlier-<time>/``, so that this
    run replaces none of them (a resume passes none: it continues them)."""
    import tempfile

    from .train.checkpoint import CheckpointError, claim_directory, keep_earlier_files

    if out_dir.exists() and not out_dir.is_dir():
        raise SystemExit(f"--output-dir: {out_dir} is a file, not a directory; choose another --output-dir")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as err:
        raise SystemExit(f"--output-dir: {out_dir} is not writable ({err.strerror or err}); choose another "
                         "--output-dir") from None
    try:
        claim_directory(out_dir)  # before anything moves: a run writing here now would lose its files
        kept = keep_earlier_files(out_dir, earlier)
    except CheckpointError as err:
        raise SystemExit(f"--output-dir: {err}") from None
    if kept is not None:
        print(f"{out_dir} held an earlier run's files: moved to {kept}, so that this run replaces none of them",
              file=sys.stderr)


def run_baseline(config: Dict[str, Any], data: Any, seed: Optional[int]) -> Dict[str, Any]:
    """``--method dpsgd|nonprivate``: the unconstrained counterpart of the chosen model, same data and widths."""
    from .train.baselines import (
        standard_cnn,
        standard_mlp,
        train_dpsgd,
        train_nonprivate,
    )

    shape, classes = data.input_shape, data.num_classes
    if config["model"] not in ("mlp", "cnn"):
        raise SystemExit(f"--method {config['method']} has unconstrained counterparts of mlp and cnn only, "
                         f"not {config['model']}")
    out_dir = Path(config["output_dir"])
    prepare_output_dir(out_dir, TRAIN_FILES)  # before training, as for clipless runs: a missing directory is created
    if config["model"] == "cnn":
        model = standard_cnn(shape, classes, channels=config["channels"], hidden=config["hidden"])
    else:
        model = standard_mlp(shape, classes, hidden=config["hidden"])
    common = dict(batch_size=int(config["batch_size"]), epochs=int(config["epochs"]), lr=config["lr"],
                  optimizer=config["optimizer"], seed=seed, test_data=data.test, progress=bool(config["progress"]),
                  lr_schedule=config["lr_schedule"], max_physical_batch_size=config["max_physical_batch_size"])
    if config["method"] == "dpsgd":
        outcome = train_dpsgd(model, data.train, delta=config["delta"], max_grad_norm=config["max_grad_norm"],
                              target_epsilon=config["epsilon"],  # with a fixed sigma: where the steps stop
                              noise_multiplier=config["noise_multiplier"], accountant=config["accountant"],
                              noise_seed=config["noise_seed"], log_train_stats=bool(config["log_train_stats"]),
                              secure_noise=bool(config["secure_noise"]), **common)
    else:
        outcome = train_nonprivate(model, data.train, **common)
    result = outcome.to_dict()
    result.update({"dataset": data.name, "config": config, "effective_noise_multiplier": outcome.noise_multiplier})
    return _write_result(out_dir, result)


def run_pretrain(args: argparse.Namespace) -> Dict[str, Any]:
    """``clipless pretrain``: pairs from random crops and flips of the training images."""
    from .contrastive.evaluation import evaluate_encoder, representation
    from .contrastive.pairs import AugmentedPairs
    from .contrastive.pretrain import ContrastivePretrainer, build_encoder
    from .data.datasets import load_dataset
    from .nn.models import build_optimizer

    seed: Optional[int] = None if args.seed is None or args.seed < 0 else int(args.seed)
    if any(k < 1 for k in args.probe_labels):
        raise SystemExit(f"--probe-labels: each count must be >= 1, got {args.probe_labels}")
    # the train command's rules (SCHEMA) for the settings the two commands share
    shared = (("--noise-seed", SCHEMA["noise_seed"], args.noise_seed), ("--seed", SCHEMA["seed"], args.seed),
              ("--hidden", _widths, args.hidden),
              ("--channels", _widths, args.channels),
              ("--embedding-dim", _number(int, 0, _MAX_SIZE), args.embedding_dim),
              ("--lr", SCHEMA["lr"], args.lr), ("--tau", SCHEMA["tau"], args.tau),
              ("--clip-norm", _number(float, 0), args.clip_norm), ("--epsilon", SCHEMA["epsilon"], args.epsilon),
              ("--delta", SCHEMA["delta"], args.delta), ("--noise-multiplier", SCHEMA["noise_multiplier"],
                                                        args.noise_multiplier),
              ("--batch-size", SCHEMA["batch_size"], args.batch_size), ("--epochs", SCHEMA["epochs"], args.epochs),
              ("--input-pool", _number(int, 1, low_open=False), args.input_pool))
    for flag, check, value in shared:
        try:
            check(value)
        except ValueError as err:
            raise SystemExit(f"{flag}: {err}") from None
    if args.cross_term != "exact" and args.method != "logit_dp":  # read by Logit-DP's pair norms alone
        raise SystemExit(f"--cross-term is an option of --method logit_dp, not of --method {args.method}")
    # a setting nothing of this run reads is refused, not dropped (result.json would report it as used)
    defaults = vars(_parser().parse_args(["pretrain"]))
    unread = {"--channels": (args.encoder == "mlp" and args.channels != defaults["channels"],
                             "the mlp encoder has no convolutions (its widths are --hidden)")}
    if args.method == "nonprivate":
        for flag, key in (("--clip-norm", "clip_norm"), ("--noise-multiplier", "noise_multiplier"),
                          ("--secure-noise", "secure_noise")):
            unread[flag] = (getattr(args, key) != defaults[key], "--method nonprivate clips nothing and adds no noise")
    _refuse_unread(unread)
    try:
        AugmentedPairs.check_settings(args.blur, args.pixel_noise)
    except ValueError as err:
        raise SystemExit(f"--blur / --pixel-noise: {err}") from None
    if seed is not None:
        torch.manual_seed(seed)
    if args.dataset == "mnist" and not args.data_dir:
        raise SystemExit("--dataset mnist needs --data-dir (a directory with the MNIST IDX .gz files)")
    data = load_dataset(args.dataset, args.data_dir, seed=seed or 0)
    shape = data.input_shape
    fewest = int(torch.unique(data.test.labels[::2], return_counts=True)[1].min())  # the probe's labelled half
    if any(k > fewest for k in args.probe_labels):
        raise SystemExit(f"--probe-labels: at most {fewest} per class (the smallest class of the test split's "
                         f"labelled half), got {args.probe_labels}")
    try:
        encoder = build_encoder(args.encoder, shape, args.embedding_dim, hidden=args.hidden, channels=args.channels,
                                input_pool=args.input_pool)
    except ValueError as err:
        raise SystemExit(f"--encoder {args.encoder}: {err}") from None
    if args.evaluate_layer == "representation":
        try:
            representation(encoder)
        except ValueError as err:
            raise SystemExit(f"--evaluate-layer representation: {err}") from None
    padding = args.crop_padding if args.crop_padding is not None else (2 if args.dataset == "mnist" else 1)
    # Augmentations of the private pairs: secret (OS entropy) unless --noise-seed; the test pairs are public.
    views = {"padding": padding, "flip": args.flip, "blur": args.blur, "pixel_noise": args.pixel_noise}
    pairs = AugmentedPairs(data.train.features, seed=args.noise_seed, **views)
    eval_pairs = AugmentedPairs(data.test.features, seed=12345, **views)
    out_dir = Path(args.output_dir)
    trainer = ContrastivePretrainer(
        encoder, build_optimizer(encoder.parameters(), args.optimizer, args.lr), pairs, method=args.method, loss=args.loss,
        tau=args.tau, clip_norm=args.clip_norm, batch_size=args.batch_size, epochs=args.epochs,
        delta=args.delta, target_epsilon=args.epsilon,  # with a fixed sigma: where the steps stop
        noise_multiplier=args.noise_multiplier, accountant=args.accountant, noise_seed=args.noise_seed,
        eval_pairs=eval_pairs, progress=_on_a_terminal() if args.progress is None else args.progress,
        checkpoint_path=out_dir / "checkpoint.pt", log_train_stats=args.log_train_stats,
        cross_term=args.cross_term, secure_noise=args.secure_noise,
    )
    if args.resume:
        ckpt = out_dir / "checkpoint.pt"
        if not ckpt.exists():
            raise SystemExit(f"--resume: no checkpoint at {ckpt}")
        trainer.load_checkpoint(ckpt)
    prepare_output_dir(out_dir, () if args.resume else PRETRAIN_FILES)
    result = trainer.fit().to_dict()
    result.update({"dataset": data.name, "config": {k: v for k, v in vars(args).items() if k != "command"},
                   **evaluate_encoder(encoder, data.test, per_class=tuple(args.probe_labels),
                                      layer=args.evaluate_layer)})
    from .train.checkpoint import write_atomically

    buffer = io.BytesIO()
    torch.save(encoder.state_dict(), buffer)
    write_atomically(out_dir / "encoder.pt", buffer.getvalue())
    _write_result(out_dir, result)
    eps = "no privacy" if result["epsilon"] is None else f"epsilon {result['epsilon']:.3g}"
    return _write_training_plot(out_dir, result, f"{data.name}: {args.method} pre-training, {eps}")


def run_audit(config: Dict[str, Any], args: argparse.Namespace) -> Dict[str, Any]:
    """``clipless audit``: the step or one-run audit of the run ``config`` describes; writes audit.json/.png."""
    import copy

    from .diagnostics.one_run import loss_scores, mislabelled_canaries, one_run_audit
    from .diagnostics.step_audit import audit_step, miscalibrated
    from .privacy.privacy_engine import PrivacyEngine
    from .privacy.randomness import randomness_label

    if config["method"] != "clipless":
        raise ValueError(f"the audit checks clipless runs; --method {config['method']} is not one")
    if not (0 < args.confidence < 1):
        raise ValueError(f"--confidence must be in (0, 1), got {args.confidence}")
    if not (args.noise_scale > 0):
        raise ValueError(f"--noise-scale must be positive, got {args.noise_scale}")
    out_dir = Path(config["output_dir"])
    prepare_output_dir(out_dir, AUDIT_FILES)
    data, shape, seed = _prepare_data(config)
    n = len(data.train)
    extra: Dict[str, Any] = {}
    if args.mode == "step":
        trials = 2000 if args.trials is None else args.trials
        if trials < 8:
            raise ValueError(f"--trials must be >= 8 in step mode, got {trials}")
        model, loss, optimizer, input_bound = _build_clipless(config, data, shape)
        # The sigma of the run, planned by the very code a training uses (on a copy of the model).
        probe = copy.deepcopy(model)
        _, planned, _ = PrivacyEngine(config["accountant"]).make_private(
            module=probe, optimizer=torch.optim.SGD(probe.parameters(), lr=0.0), data=data.train, loss=loss,
            noise_multiplier=config["noise_multiplier"], input_shape=shape, batch_size=config["batch_size"],
            input_bound=input_bound, strategy=config["strategy"], layer_noise_multipliers=_layer_noise(config),
            target_epsilon=config["epsilon"], target_delta=config["delta"], epochs=config["epochs"])
        sample_rate = 1.0 if args.sampling == "full" else float(config["batch_size"]) / n
        result = audit_step(model, loss, input_shape=shape, input_bound=input_bound,
                            noise_multiplier=planned.plan.gradient_sigma, sample_rate=sample_rate,
                            strategy=config["strategy"], layer_noise_multipliers=_layer_noise(config),
                            accountant=config["accountant"], delta=config["delta"],
                            trials=trials, confidence=args.confidence, noise_scale=args.noise_scale,
                            noise_seed=config["noise_seed"], progress=bool(config["progress"]))
        extra["audited_weights"] = "the model at initialization (public seed); no training data is used"
    else:
        trials = min(1000, n // 4) if args.trials is None else args.trials
        rest, cx, cy = mislabelled_canaries(data.train, trials, data.num_classes,
                                             torch.Generator().manual_seed(seed or 0))
        trained_loss: List[Any] = []

        def train(train_set: Any) -> Tuple[Any, float]:
            model, loss, optimizer, input_bound = _build_clipless(config, data, shape)
            trainer = _trainer(config, model, loss, optimizer, train_set, data.test, shape, input_bound, None)
            if args.noise_scale != 1.0:
                trainer.optimizer.audit_replace_plan_(miscalibrated(trainer.optimizer.plan, args.noise_scale))
            fitted = trainer.fit()
            extra.update(test_accuracy=fitted.test_accuracy, steps=fitted.steps)
            trained_loss.append(loss)
            return trainer.eval_model(), fitted.epsilon

        def score(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return loss_scores(model, trained_loss[-1], x, y)

        result = one_run_audit(train, rest, (cx, cy), score, delta=config["delta"], confidence=args.confidence,
                               seed=config["noise_seed"])
    record = {**result.to_dict(), **extra, "dataset": data.name, "config": config,
              **randomness_label(config["noise_seed"])}
    if args.mode == "one-run":  # the training ran privately, but what is scored are training records
        record["private"] = False
        record["privacy_note"] = ONE_RUN_NOTE + ("" if record["randomness"] == "os-entropy"
                                                 else "; and " + record["privacy_note"])
    if args.noise_scale != 1.0:
        record["diagnostic"] = (f"the audited mechanism drew {args.noise_scale:g} x the planned noise while claiming "
                                "the plan (--noise-scale): a deliberate bug, not a clipless run")
    _write_result(out_dir, record, "audit.json")
    try:
        from .diagnostics.plots import plot_audit_scores

        record["plot"] = str(plot_audit_scores(result, out_dir / "audit.png"))
    except ImportError as err:  # matplotlib is an optional extra
        print(f"no plot: {err}", file=sys.stderr)
    record["summary"] = result.summary_line()
    return record


# The one-run audit scores each canary (a training record with a wrong label) by its loss under the trained model:
# the scores, the guesses, the summary and audit.png are statistics of those records without noise.
ONE_RUN_NOTE = ("the canaries are training records: their scores and the guesses, this audit's summary and "
                "audit.png are statistics of those records without noise, NOT a private release (keep them with "
                "the data); the training itself ran privately")


def _privacy_status(result: Dict[str, Any]) -> str:
    if result.get("private"):
        return "private (noise and batches from OS entropy)"
    return f"NOT PRIVATE: {result.get('privacy_note', 'no guarantee')}"


def _init_distributed(command: str) -> bool:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1): join the process group (gloo on CPU, NCCL with CUDA)."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if command != "train":
        raise SystemExit(f"clipless {command}: distributed runs are supported by 'clipless train' only (Logit-DP "
                         "pre-training, the KL study and audits run in one process)")
    dist = torch.distributed
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return True


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "system_allocator", True) is False:  # the long-running commands
        tune_cpu_allocator()
    started = _init_distributed(args.command)
    try:
        code = _run(args)
        if started and torch.distributed.is_initialized():
            # the last collective may still be delivering to a peer: gloo aborts a peer whose group is torn down
            torch.distributed.barrier()
        return code
    except (ValueError, OSError, BudgetExhaustedError) as err:
        # the library's refusals (bad data, settings, files): one line naming the problem and the fix
        raise SystemExit(f"clipless {args.command}: {' '.join(str(err).split())}") from None
    except KeyboardInterrupt:
        # Ctrl-C: every file is written atomically, so what is on disk is a whole earlier state, never a part
        print(f"clipless {args.command}: {_interrupted(args)}", file=sys.stderr)
        return 130  # the shell's code for a process stopped by SIGINT
    except RuntimeError as err:  # torch's CPU allocator: a model or batch too large for this machine's memory
        if "can't allocate memory" not in str(err):
            raise
        wanted = re.search(r"allocate (\d+) bytes", str(err))
        size = f" ({int(wanted.group(1)) / 2 ** 30:.1f} GiB in one tensor)" if wanted else ""
        raise SystemExit(f"clipless {args.command}: not enough memory{size}: use smaller widths, batches (a "
                         "physical batch size) or data") from None
    finally:
        from .train.checkpoint import release_directories

        release_directories()
        if started and torch.distributed.is_initialized():
            # a DistributedDataParallel kept alive by a reference cycle would outlive its group and now and then
            # abort the process at exit (SIGABRT): collect it first
            gc.collect()
            torch.distributed.destroy_process_group()


def _interrupted(args: argparse.Namespace) -> str:
    """What an interrupted command left: files are replaced whole (written beside, then renamed), so the last
    checkpoint written, if any, is intact and a resume continues from it, its steps already composed."""
    settings = getattr(args, "resolved", None) or vars(args)  # train's settings once its config is read
    ckpt = Path(settings.get("output_dir") or DEFAULTS["output_dir"]) / "checkpoint.pt"
    resumes = args.command == "pretrain" or (args.command == "train" and settings.get("method") == "clipless")
    if resumes and ckpt.is_file():  # every pre-training method checkpoints; of train's, clipless runs only
        return (f"interrupted; the files already written are whole, and the last checkpoint ({ckpt}) continues the "
                "run with the same command and --resume")
    return "interrupted; the files already written are whole (each is replaced at once, never in part)"


def run_epsilon(args: argparse.Namespace) -> Dict[str, Any]:
    """``clipless epsilon``: what a run of ``epochs`` Poisson-subsampled Gaussian steps over ``records`` records would
    spend, planned by :func:`~clipless.privacy.calibration.plan_noise` as ``clipless train`` plans it (same sample
    rate, steps and calibration; one mechanism per step, the composed ``sigma_step`` of a per-layer run)."""
    from .privacy.accounting import check_delta, compute_epsilon
    from .privacy.calibration import plan_noise, planned_steps
    from .privacy.sampling import expected_batch_size, poisson_steps_per_epoch

    given = {key: getattr(args, key) for key in ("epsilon", "delta", "noise_multiplier", "batch_size", "epochs",
                                                 "accountant")}
    settings = validate({key: value for key, value in given.items() if value is not None})
    try:
        records = _number(int, 1, low_open=False)(args.records)
    except ValueError as err:
        raise SystemExit(f"--records: {err}") from None
    if settings.get("epsilon") is None and settings.get("noise_multiplier") is None:
        raise SystemExit("clipless epsilon: give --noise-multiplier (its epsilon is computed) or --epsilon (the "
                         "noise multiplier is calibrated), or both (the steps stop at the budget)")
    batch_size = expected_batch_size(settings["batch_size"], records)
    sample_rate = batch_size / records
    steps = planned_steps(settings["epochs"], poisson_steps_per_epoch(sample_rate))
    delta, accountant = settings["delta"], settings["accountant"]
    check_delta(delta, records)
    plan = plan_noise(None, sample_rate=sample_rate, accountant=accountant,
                      noise_multiplier=settings.get("noise_multiplier"), target_epsilon=settings.get("epsilon"),
                      delta=delta, steps=steps)
    taken: int = plan.max_steps  # type: ignore[assignment]  # the planned steps, or fewer: where the budget stops
    return {"records": records, "expected_batch_size": batch_size, "sample_rate": sample_rate,
            "planned_steps": steps, "steps": taken, "epochs": settings["epochs"],
            "steps_per_epoch": poisson_steps_per_epoch(sample_rate), "noise_multiplier": plan.step_sigma,
            "epsilon": compute_epsilon(plan.step_sigma, sample_rate, taken, delta, accountant),
            "target_epsilon": plan.target_epsilon, "delta": delta, "accountant": accountant,
            "stopped_by_budget": plan.budget_limited}


def _timing(result: Dict[str, Any]) -> str:
    """The run's wall-clock time where it is in the result (``--log-train-stats``, or a non-private run)."""
    wall = result.get("nonprivate_wall_time_s")
    if wall is None:
        return ""
    return f", {wall:.1f}s" + (" (non-private timing)" if result.get("epsilon") is not None else "")


def _run(args: argparse.Namespace) -> int:
    if args.command == "train":
        config = args.resolved = resolve_config(args)  # kept: an interruption names the run's checkpoint
        result = run_train(config)
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return 0  # rank 0 reports for the run
        acc = result["test_accuracy"]
        privacy = (
            "no privacy (non-private baseline)" if result["epsilon"] is None else
            f"epsilon {result['epsilon']:.3f} (delta {result['delta']:g}, {result['accountant']}), "
            f"sigma {result['effective_noise_multiplier']:.3f}"
        )
        print(
            f"{result['dataset']} [{config['method']}]: test accuracy {acc:.4f}, {privacy}, "
            f"{result['steps']} steps{_timing(result)}; {_privacy_status(result)}; "
            f"result in {Path(config['output_dir']) / 'result.json'}"
        )
    elif args.command == "export":
        record = run_export(Path(args.output_dir), Path(args.out) if args.out else None, args.inputs_within_bound)
        print(f"exported {record['layers']} standard layers to {record['path']}: max |output difference| "
              f"{record['max_abs_difference']:.2g} on {record['checked_examples']} test examples, predictions "
              f"agree on {100 * record['prediction_agreement']:.2f}%; load with torch.export.load(path).module() "
              f"(no clipless needed); trained in {record['steps']} private step(s): epsilon "
              f"{record['epsilon']:.3f} (delta {record['delta']:g}, {record['accountant']}), {_privacy_status(record)}")
    elif args.command == "audit":
        config = resolve_config(args)
        record = run_audit(config, args)
        print(f"{record['summary']}; {_privacy_status(record)}; audit in {Path(config['output_dir']) / 'audit.json'}")
    elif args.command == "pretrain":
        result = run_pretrain(args)
        privacy = ("no privacy (non-private baseline)" if result["epsilon"] is None else
                   f"epsilon {result['epsilon']:.3f} (delta {result['delta']:g}, {result['accountant']}), "
                   f"sigma {result['noise_multiplier']:.3f}, sensitivity {result['sensitivity']:.3g}")
        losses = [h["eval_loss"] for h in result["history"]]
        print(f"{result['dataset']} [{result['method']} {result['loss']}]: {result['layer']} kNN(3) accuracy "
              f"{result['knn3_accuracy']:.4f}, linear probe {result['linear_probe_accuracy']:.4f}"
              + "".join(f", probe with {k} labels/class {result[f'probe_{k}_per_class']:.4f}"
                        for k in args.probe_labels) + ", held-out loss "
              f"{losses[0]:.4f} -> {losses[-1]:.4f}, {privacy}, {result['steps']} steps"
              f"{_timing(result)}; {_privacy_status(result)}; "
              f"result in {Path(args.output_dir) / 'result.json'}")
    elif args.command == "epsilon":
        plan = run_epsilon(args)
        if args.json:
            print(json.dumps(plan, indent=2))
        else:
            budget = (f"; the budget (epsilon {plan['target_epsilon']:g}) stops the run after {plan['steps']} of its "
                      f"{plan['planned_steps']} steps" if plan["stopped_by_budget"] else "")
            print(f"{plan['records']} records, expected batch {plan['expected_batch_size']:g} (sample rate "
                  f"{plan['sample_rate']:.4g}), {plan['epochs']} epochs of {plan['steps_per_epoch']} steps: noise "
                  f"multiplier {plan['noise_multiplier']:.4f}, epsilon {plan['epsilon']:.4f} (delta {plan['delta']:g}, "
                  f"{plan['accountant']}) after {plan['steps']} steps{budget}")
    elif args.command == "kl-study":
        from .kl.study import KLStudyConfig, format_summary, main_kl_study

        options = {k: v for k, v in vars(args).items() if k not in ("command", "system_allocator")}
        options["digits"] = tuple(options["digits"])
        options["progress"] = _on_a_terminal() if options["progress"] is None else options["progress"]
        for key in ("inits", "widths", "depths"):
            options[key] = tuple(options[key])
        study = main_kl_study(KLStudyConfig(**options))
        print(format_summary(study))
        print(f"wrote {Path(args.output_dir) / 'kl_study.json'} and {', '.join(study['plots'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
