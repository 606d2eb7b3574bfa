"""Distributed private training on torch.distributed (gloo, 2 processes): one Poisson sample, one noise draw,
the single-process sum, identical weights, refused mismatches, and ``torchrun -m clipless train``."""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import clipless as cl
from clipless.privacy.certified import BoundError
from clipless.privacy.distributed import DistributedPoissonBatchSampler, world
from clipless.privacy.randomness import make_generator

SHAPE = (64,)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return cl.lipschitz_mlp(SHAPE, 10, hidden=(32,))


def _data(n: int = 64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, *SHAPE, generator=g)
    return x / x.norm(dim=1, keepdim=True) * 4.0, torch.randint(0, 10, (n,), generator=g)


class _Recorder(torch.optim.Optimizer):
    """Keeps the released gradient and moves nothing (as the step audit does)."""

    def __init__(self, params) -> None:
        super().__init__(list(params), {})
        self.released = []

    @torch.no_grad()
    def step(self, closure=None):
        self.released = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]


class _Read(torch.utils.data.Dataset):
    """Records made on each read (no tensors handed over): make_private reads the rank's shard to check them."""

    def __init__(self, x, y) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i].clone(), int(self.y[i])


def _private(model, optimizer, x, y, data=None, **kwargs):
    return cl.PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data=cl.ArrayDataset(x, y) if data is None else data,
        loss=cl.TauCrossEntropy(4.0),
        noise_multiplier=kwargs.pop("noise_multiplier", 1.0), input_shape=SHAPE, batch_size=16.0, input_bound=4.0,
        noise_generator=make_generator(7, stream=2), external_batches=True, **kwargs)


def _worker(rank: int, size: int, init: str, out: str, scenario: str) -> None:
    # a rank left waiting in a collective fails within a minute instead of the default half hour
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=size,
                                         timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    result = {}
    try:
        result = _scenario(rank, size, scenario, out)
        # DistributedDataParallel's reducer must be gone before the group: one that outlives it aborts the process
        # at interpreter exit now and then (SIGABRT, "terminate called without an active exception")
        gc.collect()
        torch.distributed.barrier()  # no rank tears the group down under a peer still receiving (gloo aborts it)
    finally:
        Path(out, f"{scenario}-{rank}.json").write_text(json.dumps(result))
        torch.distributed.destroy_process_group()


def _scenario(rank: int, size: int, scenario: str, out: str) -> dict:
    result = {}
    x, y = _data()
    if scenario in ("sum", "sum_in_parts"):
        model = _model()
        recorder = _Recorder(model.parameters())
        ddp, opt, _ = _private(model, recorder, x, y)
        xs, ys = x[:16][rank::size], y[:16][rank::size]  # this rank's part of one fixed global batch
        opt.zero_grad()
        # in parts: rank 0 backpropagates three parts, the others one (no collective may wait on a backward)
        for xp, yp in cl.physical_batches(xs, ys, 3 if rank == 0 and scenario == "sum_in_parts" else None):
            cl.TauCrossEntropy(4.0).per_example(ddp(xp), yp).sum().backward()
        opt.step()
        result["released"] = [t.tolist() for t in recorder.released]
    elif scenario == "steps":
        model = _model(seed=rank)  # different initial weights: DDP must broadcast rank 0's
        ddp, opt, loader = _private(model, torch.optim.Adam(model.parameters(), lr=0.05), x, y)
        loss = cl.TauCrossEntropy(4.0)
        sizes = []
        for xb, yb in loader:  # one epoch: round(1/q) = 4 steps
            opt.zero_grad()
            loss.per_example(ddp(xb), yb).sum().backward()
            opt.step()
            sizes.append(len(xb))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(size)]
        torch.distributed.all_gather(gathered, flat)
        result["identical"] = all(torch.equal(gathered[0], g) for g in gathered)
        result["epsilon"] = opt.accountant.get_epsilon(1e-5)
        result["steps"] = opt.accountant.steps
    elif scenario == "noise":
        model = _model()
        recorder = _Recorder(model.parameters())
        ddp, opt, _ = _private(model, recorder, x, y, noise_multiplier=2.0)
        loss = cl.TauCrossEntropy(4.0)
        ratios = []
        for _ in range(20):  # empty local batches everywhere: the release is the noise alone, / b
            opt.zero_grad()
            loss.per_example(ddp(x[:0]), y[:0]).sum().backward()
            opt.step()
            std = 2.0 * opt.last_report.global_sensitivity / 16.0
            released = torch.cat([t.reshape(-1) for t in recorder.released]).double()
            ratios.append(float((released ** 2).mean()) / std ** 2)
        result["variance_ratio"] = sum(ratios) / len(ratios)
    elif scenario == "adaptive":
        torch.manual_seed(0)
        model = cl.lipschitz_mlp(SHAPE, 10, hidden=(32,))
        model.append(cl.AdaptiveLossGradientClip(0.5, count_noise_multiplier=2.0, target_quantile=0.5))
        ddp, opt, loader = _private(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
        loss = cl.TauCrossEntropy(4.0)
        for xb, yb in loader:
            opt.zero_grad()
            loss.per_example(ddp(xb), yb).sum().backward()
            opt.step()
        clip = [m for m in model.modules() if isinstance(m, cl.AdaptiveLossGradientClip)][0]
        value = torch.tensor([float(clip.clip_norm)], dtype=torch.float64)
        gathered = [torch.zeros_like(value) for _ in range(size)]
        torch.distributed.all_gather(gathered, value)
        result["clip_norms"] = [float(g) for g in gathered]
        result["moved"] = float(clip.clip_norm) != 0.5
    elif scenario == "one-process-only":
        from clipless.contrastive.pretrain import ContrastivePretrainer

        model = _model()
        try:
            ContrastivePretrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.ArrayDataset(x, y),
                                  batch_size=8.0, epochs=1)
            result["refused"] = ""
        except ValueError as err:
            result["refused"] = str(err)
    elif scenario in ("one-rank-slip", "one-rank-momentum"):
        model = _model()
        ddp, opt, loader = _private(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), x, y)
        loss = cl.TauCrossEntropy(4.0)
        batches = iter(loader)

        def momentum():
            return [opt.state[p]["momentum_buffer"].clone() for p in model.parameters() if p in opt.state]

        if scenario == "one-rank-momentum":  # a released step, then rank 1 writes into its own momentum
            xb, yb = next(batches)
            opt.zero_grad()
            loss.per_example(ddp(xb), yb).sum().backward()
            opt.step()
        released = momentum()
        if scenario == "one-rank-momentum" and rank == 1:
            with torch.no_grad():
                opt.state[next(model.parameters())]["momentum_buffer"].add_(1.0)
        xb, yb = next(batches)
        if scenario == "one-rank-slip" and rank == 1:  # a record added to this rank's part of the batch: its rows
            xb, yb = torch.cat([xb, x[:1]]), torch.cat([yb, y[:1]])  # outnumber the batch drawn
        before = [p.detach().clone() for p in model.parameters()]
        try:
            opt.zero_grad()
            loss.per_example(ddp(xb), yb).sum().backward()
            opt.step()
            result["refused"] = ""
        except BoundError as err:
            result["refused"] = str(err)
        result["unchanged"] = (all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
                               and all(torch.equal(a, b) for a, b in zip(released, momentum())))
        result["steps"] = opt.accountant.steps - (scenario == "one-rank-momentum")
        xb, yb = next(batches)  # every rank goes on with the next batch
        opt.zero_grad()
        loss.per_example(ddp(xb), yb).sum().backward()
        opt.step()
        result["steps_after"] = opt.accountant.steps - (scenario == "one-rank-momentum")
    elif scenario == "other-shard-record":
        model = _model()
        ddp, opt, loader = cl.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=cl.ArrayDataset(x, y),
            loss=cl.TauCrossEntropy(4.0), noise_multiplier=1.0, input_shape=SHAPE, batch_size=32.0,
            input_bound=4.0, noise_generator=make_generator(7, stream=2),
            sampling_generator=make_generator(7, stream=1 + 1000 * rank))
        loss = cl.TauCrossEntropy(4.0)
        result["refused"], result["steps"] = [], []
        for take_other in (False, True):
            xb, yb = next(iter(loader))
            if take_other and rank == 1:  # record 0 lies in rank 0's shard (even indices): rank 1 never draws it
                xb, yb = torch.cat([x[:1], xb[1:]]), torch.cat([y[:1], yb[1:]])
            try:
                opt.zero_grad()
                loss.per_example(ddp(xb), yb).sum().backward()
                opt.step()
                result["refused"].append("")
            except BoundError as err:
                result["refused"].append(str(err))
            result["steps"].append(opt.accountant.steps)
    elif scenario == "shared-sampling-generator":
        result["outcomes"] = []
        for stream in (1, 1 + 1000 * rank):  # the same state on every rank, then one stream per rank
            model = _model()
            try:
                _private(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y,
                         sampling_generator=make_generator(7, stream=stream))
                result["outcomes"].append("")
            except BoundError as err:
                result["outcomes"].append(str(err))
    elif scenario == "resume-streams":
        path = Path(out, "checkpoint.pt")

        def trainer():
            model = _model()
            return cl.PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cl.TauCrossEntropy(4.0),
                                     cl.ArrayDataset(x, y), input_shape=SHAPE, batch_size=16.0, delta=1e-3, epochs=2,
                                     noise_multiplier=1.0, input_bound=4.0, noise_seed=3, progress=False, log=None,
                                     checkpoint_path=path)

        first = trainer()
        first.max_steps = len(first.loader)  # stop (and checkpoint) after the first of the two epochs
        first.fit()
        drawn = first.sampling_generator.get_state()
        torch.distributed.barrier()  # rank 0 has written the checkpoint
        resumed = trainer()
        resumed.load_checkpoint(path)
        result["continues"] = torch.equal(resumed.sampling_generator.get_state(), drawn)
        result["restarted"] = torch.equal(trainer().sampling_generator.get_state(), drawn)
    elif scenario == "far-record":  # record 5, in rank 1's shard, is above the input bound
        far = x.clone()
        far[5] *= 2
        result["refused"] = []
        for data in (_Read(far, y), _Read(x, y)):
            try:
                model = _model()
                _private(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, data=data)
                result["refused"].append("")
            except BoundError as err:
                result["refused"].append(str(err))
    elif scenario == "mismatch":
        model = _model()
        try:
            _private(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y,
                     noise_multiplier=1.0 if rank == 0 else 1.5)
            result["refused"] = ""
        except BoundError as err:
            result["refused"] = str(err)
    return result


def _run(scenario: str, size: int = 2) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(size, f"file://{tmp}/rendezvous", tmp, scenario), nprocs=size, join=True)
        return [json.loads(Path(tmp, f"{scenario}-{r}.json").read_text()) for r in range(size)]


@pytest.mark.parametrize("scenario", ["sum", "sum_in_parts"])
def test_distributed_sum_equals_the_single_process_sum(scenario: str) -> None:
    """Rank 0's noise (same seed) on the all-reduced sum of the two halves = the one-process release; also when the
    ranks backpropagate their halves in different numbers of physical parts."""
    results = _run(scenario)
    x, y = _data()
    model = _model()
    recorder = _Recorder(model.parameters())
    single, opt, _ = _private(model, recorder, x, y)
    opt.zero_grad()
    cl.TauCrossEntropy(4.0).per_example(single(x[:16]), y[:16]).sum().backward()
    opt.step()
    for r in results:
        for got, want in zip(r["released"], recorder.released):
            assert torch.allclose(torch.tensor(got), want, atol=1e-6, rtol=1e-5)


def test_weights_stay_identical_on_every_rank_and_the_accountant_matches() -> None:
    results = _run("steps")
    assert all(r["identical"] for r in results)
    assert results[0]["epsilon"] == results[1]["epsilon"] > 0 and results[0]["steps"] == 4


def test_the_global_sum_gets_the_planned_noise_once() -> None:
    (rank0, rank1) = _run("noise")
    # 20 steps x 2410 coordinates of N(0, std^2): the mean square is within a few percent of std^2
    # (twice the noise, one draw per rank, would give 2)
    assert rank0["variance_ratio"] == pytest.approx(1.0, abs=0.05)
    assert rank1["variance_ratio"] == pytest.approx(1.0, abs=0.05)


def test_adaptive_clip_count_is_summed_and_noised_once() -> None:
    """The noisy count is all-reduced and broadcast: every rank moves its clip norm to the same value."""
    results = _run("adaptive")
    norms = results[0]["clip_norms"]
    assert norms[0] == norms[1] and results[0]["moved"]


@pytest.mark.parametrize("scenario, why", [("one-rank-slip", "rows of the private model's output"),
                                           ("one-rank-momentum", "changed outside the private step")])
def test_a_step_refused_on_one_rank_is_refused_on_every_rank(scenario, why) -> None:
    """Before, the other rank added its noise and waited in the all-reduce of the sum until the group timed out.
    Every rank keeps its released weights and momentum (rank 1's written momentum put back) and goes on."""
    results = _run(scenario)
    assert why in results[1]["refused"]
    assert "rank(s) [1] refused this step" in results[0]["refused"]
    assert all(r["unchanged"] and r["steps"] == 0 and r["steps_after"] == 1 for r in results)


def test_a_record_of_another_ranks_shard_is_refused() -> None:
    """Each rank knew the digests of its own shard only: a row equal to a record of another rank's shard (a loader of
    one's own over the whole dataset, an index into it) passed where the rank's own undrawn records were refused.
    The ranks now digest alike (rank 0's weights) and every rank holds every shard's digests."""
    results = _run("other-shard-record")
    assert [r["refused"][0] for r in results] == ["", ""] and results[0]["steps"] == [1, 1]
    assert "a training record that the batch drawn from the private loader does not hold" in results[1]["refused"][1]
    assert "rank(s) [1] refused this step" in results[0]["refused"][1]


def test_ranks_sharing_a_sampling_generator_state_are_refused() -> None:
    """The same generator on every rank draws the same mask on every shard: correlated inclusions, not the one
    Poisson sample the accountant composes (before, accepted)."""
    results = _run("shared-sampling-generator")
    assert all("ranks [0, 1] start from the same sampling generator state" in r["outcomes"][0] for r in results)
    assert all(r["outcomes"][1] == "" for r in results)


def test_a_seeded_resume_continues_every_rank_sampling_stream() -> None:
    """Before, only rank 0's stream was saved: rank 1 restarted its seeded stream and drew again the batches of the
    first steps (inclusions correlated across steps, which the accountant assumes independent)."""
    results = _run("resume-streams")
    assert all(r["continues"] and not r["restarted"] for r in results)


def test_a_bad_record_in_one_ranks_shard_is_refused_by_every_rank_before_any_step() -> None:
    """Each rank reads its own shard of a dataset not in memory; rank 1's refusal is every rank's (before, the record
    was met at whichever step's Poisson batch first held it, on rank 1 only)."""
    (rank0, rank1) = _run("far-record")
    assert "a record has a norm above the declared input_bound" in rank1["refused"][0]
    assert "rank(s) [1] refused a record of their shard of the training data" in rank0["refused"][0]
    assert rank0["refused"][1] == rank1["refused"][1] == ""


def test_mismatched_ranks_are_refused_on_every_rank() -> None:
    results = _run("mismatch")
    assert all("disagree" in r["refused"] and "noise_multiplier" in r["refused"] for r in results)


def test_logit_dp_refuses_a_process_group() -> None:
    assert all("one process" in r["refused"] for r in _run("one-process-only"))


def test_a_ranks_records_cannot_be_rewritten() -> None:
    """``sampler.shard = torch.arange(n)`` on a rank drew from all records (51 of 100 at q = 0.5, a world of 4): a
    record could enter up to W parts of one step's batch, W times its sensitivity.  The shard is computed from
    the rank and world size, which are declared constants checked at every draw."""
    sampler = DistributedPoissonBatchSampler(100, 0.5, 0, 4, 2)
    with pytest.raises(AttributeError, match="no setter"):
        sampler.shard = torch.arange(100)
    for name, value in (("rank", 1), ("world_size", 1)):
        with pytest.raises(AttributeError, match="declared constant"):
            setattr(sampler, name, value)
        sampler = DistributedPoissonBatchSampler(100, 0.5, 0, 4, 2)
        sampler.__dict__[name] = value
        with pytest.raises(cl.BoundError, match=f"the Poisson sampler's {name} changed"):
            next(iter(sampler))
    sampler = DistributedPoissonBatchSampler(100, 0.5, 0, 4, 2)
    sampler.__dict__["shard"] = torch.arange(100)  # the property wins over the instance's dict
    assert all(i % 4 == 0 for _ in range(20) for i in next(iter(sampler)))


def test_distributed_sampler_is_one_poisson_sample() -> None:
    n, q, steps = 1001, 0.1, 600
    samplers = [DistributedPoissonBatchSampler(n, q, r, 2, steps) for r in range(2)]
    shards = [set(s.shard.tolist()) for s in samplers]
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(n))
    counts = torch.zeros(n)
    pair = 0  # records 0 (rank 0) and 1 (rank 1) drawn together
    for b0, b1 in zip(*samplers):
        batch = set(b0) | set(b1)
        assert set(b0) <= shards[0] and set(b1) <= shards[1]
        counts[list(batch)] += 1
        pair += (0 in batch) and (1 in batch)
    rate = float(counts.sum()) / (n * steps)
    assert abs(rate - q) < 4 * math.sqrt(q * (1 - q) / (n * steps))
    per_record = counts / steps  # every record, on either rank, at rate q
    assert abs(float(per_record[0::2].mean()) - q) < 0.01 and abs(float(per_record[1::2].mean()) - q) < 0.01
    assert abs(pair / steps - q * q) < 4 * math.sqrt(q * q / steps) + 0.005  # independent across ranks


def test_world_without_a_group() -> None:
    assert world() == (0, 1)
    with pytest.raises(ValueError, match="process group"):
        x, y = _data()
        model = _model()
        cl.PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        data=cl.ArrayDataset(x, y), loss=cl.TauCrossEntropy(4.0), noise_multiplier=1.0,
                                        input_shape=SHAPE, batch_size=16.0, input_bound=4.0, distributed=True)


@pytest.mark.slow
def test_torchrun_train_matches_the_single_process_run(tmp_path) -> None:
    common = ["train", "--dataset", "digits", "--epochs", "8", "--no-progress", "--seed", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          "29533", "-m", "clipless", *common, "--output-dir", str(tmp_path / "two")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run([sys.executable, "-m", "clipless", *common, "--output-dir", str(tmp_path / "one")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    r2 = json.loads((tmp_path / "two" / "result.json").read_text())
    r1 = json.loads((tmp_path / "one" / "result.json").read_text())
    assert r2["processes"] == 2 and r1["processes"] == 1
    assert r2["epsilon"] == pytest.approx(r1["epsilon"], rel=1e-12) and r2["steps"] == r1["steps"]
    assert abs(r2["test_accuracy"] - r1["test_accuracy"]) < 0.15
    assert two.stdout.count("test accuracy") == 1  # rank 0 reports for the run
    again = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                            "29534", "-m", "clipless", "train", "--output-dir", str(tmp_path / "two"), "--resume",
                            "--no-progress"], capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]  # the same number of processes resumes
    assert json.loads((tmp_path / "two" / "result.json").read_text())["epsilon"] == pytest.approx(r1["epsilon"])
    before = (tmp_path / "two" / "checkpoint.pt").read_bytes()
    resumed = subprocess.run([sys.executable, "-m", "clipless", "train", "--output-dir", str(tmp_path / "two"),
                              "--resume", "--no-progress"], capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode != 0 and "2 process(es)" in resumed.stderr  # another number of processes: refused
    assert (tmp_path / "two" / "checkpoint.pt").read_bytes() == before
