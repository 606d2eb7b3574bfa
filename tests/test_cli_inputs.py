"""Every bad input gets a one-line error naming the setting or file and the fix; nothing written is lost.

Each case goes through the CLI's ``main`` as a user would type it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from clipless.kl import noisy_gd as klp
from clipless.cli import main
from helpers import write_fake_mnist

FAST = ["--epochs", "1", "--batch-size", "256", "--hidden", "16", "--no-progress", "--accountant", "rdp"]


def _refused(argv, match):
    """``main(argv)`` exits with one line matching ``match``."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    message = str(info.value.code)
    assert "\n" not in message and len(message) < 400, message
    assert re.search(match, message), message
    return message


def _train(out, *extra):
    assert main(["train", *FAST, "--output-dir", str(out), *extra]) == 0
    return json.loads((out / "result.json").read_text())


# -- settings --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, match", [
    (["--epsilon", "inf"], "--epsilon: must be finite"),
    (["--epsilon", "nan"], "--epsilon: must be finite"),
    (["--epsilon", "-1"], "--epsilon: must be > 0"),
    (["--batch-size", "0"], "--batch-size: must be > 0"),
    (["--epochs", "0"], "--epochs: must be >= 1"),
    (["--epochs", "-3"], "--epochs: must be >= 1"),
    (["--lr", "inf"], "--lr: must be finite"),
    (["--hidden", "0"], "--hidden: each width must be > 0"),
    (["--delta", "1"], "--delta: must be < 1"),
    (["--adaptive-clip-quantile", "1.5"], "--adaptive-clip-quantile: must be < 1"),
    (["--augmult", "0"], "--augmult: must be >= 1"),
    (["--max-physical-batch-size", "0"], "--max-physical-batch-size: must be >= 1"),
    (["--noise-seed", "-1"], "--noise-seed: must be >= 0"),
    (["--augmult", "2", "--augment-shift", "-1"], "--augment-shift: must be >= 0"),
    (["--augmult", "2", "--method", "dpsgd"], "--augmult is an option of clipless training"),
    (["--average-decay", "1"], "--average-decay: must be < 1"),
    (["--average-decay", "0"], "--average-decay: must be > 0"),
    (["--average-decay", "0.9", "--method", "dpsgd"], "--average-decay is an option of clipless training"),
    (["--conv", "orthogonal", "--model", "cnn", "--method", "dpsgd"], "--conv is an option of clipless training"),
    (["--layer-noise", "energy"], "--layer-noise energy allocates noise between layers: it needs --strategy per_layer"),
    (["--layer-noise", "energy", "--strategy", "per_layer", "--method", "dpsgd"],
     "--layer-noise is an option of clipless training"),
    (["--noise-multiplier", "0.01"], "noise multiplier 0.01 is below 0.2 .* use the rdp accountant"),
    (["--conv", "orthogonal"], "--conv orthogonal applies to the cnn, vgg and resnet models, not mlp"),
    (["--model", "cnn", "--channels"], "--channels: the cnn needs at least one width"),  # trained a head alone
    (["--model", "mixer", "--channels"], "--channels: the mixer needs at least one width"),  # an IndexError
    (["--model", "cnn", "--channels", "--method", "dpsgd"], "--channels: the cnn needs at least one width"),
    # settings a baseline would not read were dropped, and the run reported as if it had them
    (["--strategy", "per_layer", "--method", "dpsgd"], "--strategy is an option of clipless training"),
    (["--adaptive-clip-quantile", "0.5", "--method", "dpsgd"], "--adaptive-clip-quantile is an option of clipless"),
    (["--adaptive-clip-quantile", "0.5", "--count-noise-multiplier", "3", "--method", "nonprivate"],
     "--adaptive-clip-quantile is an option of clipless training, not of --method nonprivate"),
    (["--loss", "hinge", "--method", "dpsgd"], "--loss is an option of clipless training"),
    (["--tau", "8", "--method", "nonprivate"], "--tau is an option of clipless training"),
    (["--loss-grad-clip", "0.5", "--method", "dpsgd"], "--loss-grad-clip is an option of clipless training"),
    (["--no-loss-grad-clip", "--method", "dpsgd"], "--loss-grad-clip is an option of clipless training"),
    (["--input-clip", "1", "--method", "dpsgd"], "--input-clip is an option of clipless training"),
    (["--activation", "groupsort4", "--method", "dpsgd"], "--activation is an option of clipless training"),
    (["--augment-flip", "--method", "dpsgd"], "--augment-flip is an option of clipless training"),
    (["--max-grad-norm", "0.5"], "--max-grad-norm is the clipping norm of --method dpsgd, not of --method clipless"),
    (["--secure-noise", "--method", "nonprivate"], "--secure-noise draws the noise of a private run"),
    # an activation name was only read where a layer took one: a linear head ran with any name
    (["--activation", "foo"], "--activation: unknown activation 'foo': maxmin, or groupsortK with K >= 2"),
    (["--activation", "groupsort1"], "--activation: unknown activation 'groupsort1'"),
    (["--activation", "groupsort3.0", "--hidden", "12"], "--activation: unknown activation 'groupsort3.0'"),
    (["--activation", "groupsort4"], "--activation groupsort4: the mlp has no hidden layer"),
    # tracebacks before: an OverflowError in the accountant, in the step count, and torch's C++ trace
    (["--epochs", "99999999999999999999"], "steps, more than the accountants compose .1e\\+09.: plan fewer epochs"),
    (["--batch-size", "1e-320"], "sample rate 4.94066e-324 is below 2\\^-53"),
    (["--hidden", "99999999999999999999"], "--hidden: each width must be < 2.14748e\\+09"),
    (["--model", "cnn", "--channels", "99999999999999999999"], "--channels: each width must be < 2.14748e\\+09"),
    (["--seed", "99999999999999999999"], "--seed: must be < 9.0072e\\+15"),  # "Overflow when unpacking long long"
])
def test_bad_flag_values_refused_before_anything_runs(tmp_path, flags, match):
    out = tmp_path / "run"
    _refused(["train", "--no-progress", "--output-dir", str(out), *flags], match)
    assert not out.exists()


@pytest.mark.parametrize("content, match", [
    ("epsilon: three\n", r"--epsilon \(in .*\): must be a number, got 'three'"),
    ("hidden: 64\n", r"--hidden \(in .*\): must be a list of positive integers such as \[64\]"),
    ("progress: 'false'\n", r"--progress \(in .*\): must be true or false, got 'false'"),
    ("seed: 1.5\n", r"--seed \(in .*\): must be an integer, got 1.5"),
    ("epochs: 2.7\n", r"--epochs \(in .*\): must be an integer"),
    ("lr-schedule: linear\n", r"--lr-schedule \(in .*\): must be one of"),
    ("bach-size: 128\n", r"unknown key 'bach-size' .* keys are the option names"),
    ("batch-size: 128\nbatch_size: 64\n", "sets batch-size twice"),
    # PyYAML's safe_load keeps the last of two equal keys without a word: this ran at epsilon 8
    ("epsilon: 1\nhidden: [16]\nepsilon: 8\n", r"sets epsilon twice \(lines 1 and 3\)"),
    ("epsilon: 1\n'epsilon': 8\n", r"sets epsilon twice \(lines 1 and 2\)"),
    ("epsilon: [3\n", "is not valid YAML"),
    ("- 3\n", "must be a mapping"),
])
def test_bad_yaml_refused_with_the_key_named(tmp_path, content, match):
    config = tmp_path / "run.yaml"
    config.write_text(content)
    out = tmp_path / "run"
    _refused(["train", "--config", str(config), "--no-progress", "--output-dir", str(out)], match)
    assert not out.exists()


def test_yaml_flag_spelling_and_pyyaml_float_strings_accepted(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("batch-size: 256\ndelta: 1e-5\nhidden: [16]\nepochs: 1\naccountant: rdp\nlog-train-stats: true\n"
                      "lr-schedule: cosine\n")
    assert yaml.safe_load(config.read_text())["delta"] == "1e-5"  # what PyYAML gives
    assert main(["train", "--config", str(config), "--no-progress", "--output-dir", str(tmp_path / "run")]) == 0
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["config"]["delta"] == 1e-5 and result["config"]["batch_size"] == 256
    assert result["config"]["log_train_stats"] is True and result["config"]["lr_schedule"] == "cosine"


# -- data ------------------------------------------------------------------------------------------------------
def test_mnist_labels_outside_0_to_9_refused(tmp_path):
    data = write_fake_mnist(tmp_path / "mnist", labels_max=200)
    _refused(["train", "--dataset", "mnist", "--data-dir", str(data), *FAST, "--output-dir", str(tmp_path / "o")],
             r"train-labels-idx1-ubyte.gz holds labels outside 0-9 \(e.g. 200\)")


def test_idx_classes_are_declared_or_read_from_the_held_out_labels(tmp_path):
    """The model's output width is released with it: a label that only a training record holds is refused, not
    counted; ``--num-classes`` declares the classes, and both neighbouring datasets then train the same width."""
    from clipless.data.datasets import write_idx
    from clipless.train.checkpoint import load_checkpoint

    d = tmp_path / "idx"
    d.mkdir()
    rng = np.random.default_rng(0)
    for prefix, labels in (("train", [*range(3)] * 20 + [3]), ("t10k", [*range(3)] * 4)):
        write_idx(d / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (len(labels), 8, 8)).astype(np.uint8))
        write_idx(d / f"{prefix}-labels-idx1-ubyte", np.asarray(labels, dtype=np.uint8))
    data = ["--dataset", "idx", "--data-dir", str(d), "--features", "none", "--batch-size", "16"]
    _refused(["train", *FAST, *data, "--output-dir", str(tmp_path / "a")],
             r"training labels lie outside 0-2 .*--num-classes")
    out = tmp_path / "b"
    assert main(["train", *FAST, *data, "--num-classes", "5", "--output-dir", str(out)]) == 0
    state = load_checkpoint(out / "checkpoint.pt")["model"]
    assert [tuple(v.shape) for k, v in state.items() if k.endswith("weight")][-1] == (5, 16)
    assert json.loads((out / "result.json").read_text())["config"]["num_classes"] == 5
    _refused(["train", *FAST, "--num-classes", "12", "--output-dir", str(tmp_path / "c")],
             r"digits has 10 classes .*not the 12 declared")
    _refused(["train", *FAST, "--num-classes", "1", "--output-dir", str(tmp_path / "c")], "--num-classes: must be >= 2")


def test_truncated_mnist_file_named(tmp_path):
    data = write_fake_mnist(tmp_path / "mnist")
    target = data / "train-images-idx3-ubyte.gz"
    target.write_bytes(target.read_bytes()[:200])
    _refused(["train", "--dataset", "mnist", "--data-dir", str(data), *FAST, "--output-dir", str(tmp_path / "o")],
             r"train-images-idx3-ubyte.gz is damaged .*download it again")


def test_mnist_data_dir_that_is_a_file_named(tmp_path):
    not_dir = tmp_path / "mnist.gz"
    not_dir.write_bytes(b"x")
    _refused(["train", "--dataset", "mnist", "--data-dir", str(not_dir), *FAST, "--output-dir", str(tmp_path / "o")],
             "mnist.gz is a file; give the directory")


def _npz(tmp_path, x, y):
    path = tmp_path / "table.npz"
    np.savez(path, X=x, y=y)
    return path


def test_single_class_dataset_refused(tmp_path):
    rng = np.random.default_rng(0)
    path = _npz(tmp_path, rng.normal(size=(50, 4)), np.zeros(50))
    out = tmp_path / "run"
    _refused(["train", "--dataset", str(path), "--input-clip", "1", *FAST, "--output-dir", str(out)],
             r"table.npz has a single class \(\[0\]\)")
    assert not out.exists()


@pytest.mark.parametrize("stem", ["digits", "mnist", "cifar10", "imagefolder", "table"])
def test_tabular_file_needs_an_input_clip_whatever_its_name(tmp_path, stem):
    """The pixel bound sqrt(dim) comes from the image loaders, not the file's name: a tabular file called digits.npz
    (norms up to 300 here) once got it and trained against a bound its data broke."""
    rng = np.random.default_rng(0)
    path = tmp_path / f"{stem}.npz"
    np.savez(path, X=rng.normal(size=(300, 5)) * 50, y=np.arange(300) % 2)
    out = tmp_path / "run"
    _refused(["train", "--dataset", str(path), *FAST, "--output-dir", str(out)],
             r"tabular data has no fixed norm bound: pass --input-clip C")
    assert not out.exists()


def test_one_dimensional_tabular_features_refused(tmp_path):
    path = _npz(tmp_path, np.arange(50.0), np.arange(50) % 2)
    _refused(["train", "--dataset", str(path), "--input-clip", "1", *FAST, "--output-dir", str(tmp_path / "o")],
             r"X of table.npz must be 2-D \(records x features\), got shape \(50,\)")


def test_pretrain_cnn_without_channels_refused(tmp_path):
    _refused(["pretrain", "--encoder", "cnn", "--channels", "--no-progress", "--output-dir", str(tmp_path / "p")],
             "channels: the cnn needs at least one")


@pytest.mark.parametrize("flag, value, match", [
    ("--clip-norm", "inf", "--clip-norm: must be finite"),  # was: "embeddings ... NaN or infinite (an overflow)"
    ("--lr", "inf", "--lr: must be finite"),  # was: the same misleading overflow message after the first step
    ("--tau", "inf", "--tau: must be finite"),
    ("--epsilon", "nan", "--epsilon: must be finite"),
    ("--epochs", "0", "--epochs: must be >= 1"),
    ("--batch-size", "0", "--batch-size: must be > 0"),
    ("--batch-size", "1e-320", "below 2\\^-53"),  # tracebacks before (an OverflowError, torch's C++ trace)
    ("--epochs", "99999999999999999999", "more than the accountants compose"),
    ("--embedding-dim", "99999999999999999999", "--embedding-dim: must be < 2.14748e\\+09"),
    ("--seed", "99999999999999999999", "--seed: must be < 9.0072e\\+15"),
])
def test_pretrain_settings_get_the_train_commands_checks(tmp_path, flag, value, match):
    out = tmp_path / "p"
    _refused(["pretrain", flag, value, "--no-progress", "--output-dir", str(out)], match)
    assert not out.exists()


@pytest.mark.parametrize("argv, flag", [
    (["train", "--channels", "64"], "--channels"),  # the mlp: these ran as if not given, result.json listing them
    (["train", "--patch-size", "2"], "--patch-size"),
    (["train", "--loss", "hinge", "--tau", "3"], "--tau"),
    (["train", "--count-noise-multiplier", "3"], "--count-noise-multiplier"),
    (["train", "--augment-shift", "3"], "--augment-shift"),
    (["train", "--augment-flip"], "--augment-flip"),
    (["train", "--method", "nonprivate", "--noise-multiplier", "2"], "--noise-multiplier"),
    (["train", "--method", "nonprivate", "--noise-seed", "3"], "--noise-seed"),
    (["train", "--method", "dpsgd", "--model", "cnn", "--patch-size", "2"], "--patch-size"),
    (["train", "--data-dir", "."], "--data-dir"),  # digits, embedded: it trained on them without a word
    (["pretrain", "--data-dir", "."], "--data-dir"),
    (["pretrain", "--channels", "8"], "--channels"),
    (["pretrain", "--method", "nonprivate", "--clip-norm", "2"], "--clip-norm"),
    (["pretrain", "--method", "nonprivate", "--noise-multiplier", "2"], "--noise-multiplier"),
    (["pretrain", "--method", "nonprivate", "--secure-noise"], "--secure-noise"),
])
def test_settings_nothing_reads_are_refused(tmp_path, argv, flag):
    out = tmp_path / "o"
    _refused([*argv, "--no-progress", "--output-dir", str(out)], f"{flag}( .)? would not be used: ")
    assert not out.exists()


def test_a_model_too_large_for_memory_is_one_line(tmp_path, monkeypatch):
    """torch's CPU allocator refuses a tensor larger than the machine can hold with a C++ trace: one line now."""
    import clipless.cli as cli

    def too_large(config):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 2592000000000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(cli, "run_train", too_large)
    _refused(["train", "--no-progress", "--output-dir", str(tmp_path / "o")],
             r"clipless train: not enough memory \(2414.0 GiB in one tensor\): use smaller widths")
    monkeypatch.setattr(cli, "run_train", lambda config: (_ for _ in ()).throw(RuntimeError("another failure")))
    with pytest.raises(RuntimeError, match="another failure"):  # any other RuntimeError is a bug to show whole
        main(["train", "--no-progress", "--output-dir", str(tmp_path / "o")])


def test_kl_to_delta_is_clamped_and_vacuity_said():
    with pytest.warns(UserWarning, match="vacuous"):
        assert klp.kl_to_delta(4.68) == 1.0  # sqrt(4.68 / 2) = 1.53 before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert klp.kl_to_delta(0.5) == pytest.approx(0.5)


# -- files written ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["clipless", "dpsgd", "nonprivate"])
def test_every_method_creates_a_missing_output_dir(tmp_path, method):
    out = tmp_path / "new" / "nested"
    assert _train(out, "--method", method)["config"]["method"] == method


@pytest.mark.parametrize("method", ["clipless", "dpsgd", "nonprivate"])
def test_output_dir_that_is_a_file_refused_for_every_method(tmp_path, method):
    path = tmp_path / "out"
    path.write_text("keep me")
    _refused(["train", *FAST, "--method", method, "--output-dir", str(path)], "is a file, not a directory")
    assert path.read_text() == "keep me"


def test_unwritable_output_dir_refused_before_training(tmp_path):
    target = Path("/sys/clipless-test-output")  # read-only even for root
    try:
        target.mkdir()
        target.rmdir()
        pytest.skip("/sys is writable here")
    except OSError:
        pass
    _refused(["train", *FAST, "--output-dir", str(target)], "is not writable .*choose another --output-dir")


def test_train_writes_a_training_curve_of_private_quantities_only(tmp_path, monkeypatch):
    """training.png shows the held-out accuracy and epsilon per epoch; training statistics logged on request
    (``--log-train-stats``, labelled non-private in result.json) stay out of the figure."""
    import matplotlib.axes

    plotted = []
    plot = matplotlib.axes.Axes.plot

    def recorded(self, x, y, *args, **kwargs):
        plotted.append((kwargs.get("label"), list(y)))
        return plot(self, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recorded)
    result = _train(tmp_path / "run", "--log-train-stats")
    png = (tmp_path / "run" / "training.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    history = result["history"]
    assert "nonprivate_train_accuracy" in history[0] and "nonprivate_epoch_time_s" in history[0]
    assert result["nonprivate_wall_time_s"] > 0
    assert plotted == [("test accuracy (held out)", [row["test_accuracy"] for row in history]),
                       ("epsilon", [row["epsilon"] for row in history])]


def test_interrupted_result_write_keeps_the_previous_result(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _train(out, "--noise-seed", "1")
    before = (out / "result.json").read_bytes()

    def killed(obj, *args, **kwargs):  # a kill in the middle of writing the JSON document
        fh = args[0] if args else None
        if fh is not None:
            fh.write('{"test_accuracy": 0.')
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", killed)
    monkeypatch.setattr(json, "dumps", lambda *a, **k: killed(None))
    capsys.readouterr()
    # Ctrl-C: the shell's code for SIGINT and one line naming the checkpoint to resume, not a traceback
    assert main(["train", *FAST, "--output-dir", str(out), "--noise-seed", "2"]) == 130
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith("clipless train: interrupted") and f"({out / 'checkpoint.pt'})" in said, said
    assert "--resume" in said
    (kept,) = [p for p in out.iterdir() if p.is_dir()]  # the first run's files, moved aside before the second
    assert (kept / "result.json").read_bytes() == before
    # the second run's checkpoint was written, its result never was, and no temporary is left anywhere
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["checkpoint.pt", "checkpoint.pt.key"]
    assert sorted(p.name for p in kept.iterdir()) == ["checkpoint.pt", "checkpoint.pt.key", "result.json",
                                                      "training.png"]


def test_an_interruption_before_any_checkpoint_names_none(tmp_path, monkeypatch, capsys):
    from clipless.train import trainer

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer.PrivateTrainer, "fit", interrupted)
    assert main(["train", *FAST, "--output-dir", str(tmp_path / "run")]) == 130
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith("clipless train: interrupted") and "checkpoint" not in said, said


def test_full_disk_during_checkpoint_write_is_one_line_and_leaves_no_temporary(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _train(out)
    before = (out / "checkpoint.pt").read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    _refused(["train", *FAST, "--output-dir", str(out)], r"could not write .*checkpoint.pt.key: No space left on "
             "device; the previous file .* is intact")
    (kept,) = [p for p in out.iterdir() if p.is_dir()]  # the first run's files, moved aside before the second
    assert (kept / "checkpoint.pt").read_bytes() == before
    assert [p.name for p in out.iterdir() if p.is_file()] == []  # no temporary left
    assert sorted(p.name for p in kept.iterdir()) == ["checkpoint.pt", "checkpoint.pt.key", "result.json",
                                                      "training.png"]


@pytest.mark.parametrize("damage, match", [
    ("truncate", "is damaged .*checksum"),
    ("empty", "is not a clipless checkpoint"),
    ("flip", "is damaged .*checksum"),
])
def test_damaged_checkpoint_refused_on_resume(tmp_path, damage, match):
    out = tmp_path / "run"
    _train(out, "--epochs", "2")
    ckpt = out / "checkpoint.pt"
    raw = bytearray(ckpt.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) * 2 // 3]
    elif damage == "empty":
        raw = bytearray()
    else:
        raw[len(raw) // 2] ^= 0x40  # one flipped bit deep inside the optimizer state
    ckpt.write_bytes(bytes(raw))
    result = (out / "result.json").read_bytes()
    _refused(["train", "--output-dir", str(out), "--resume", "--no-progress"], match)
    assert ckpt.read_bytes() == bytes(raw) and (out / "result.json").read_bytes() == result


class _RunsCode:
    """An object whose unpickling runs a call the file names (here: it creates a file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path):
    """A checkpoint was read with ``torch.load(weights_only=False)``: one that names a callable (written by anyone,
    with a valid checksum, since the checksum is not a key) ran it on resume or export.  It is now read with
    ``weights_only=True``: tensors, numbers, strings and containers only, which is all a clipless checkpoint holds."""
    import hashlib
    import io

    import torch

    from clipless.train.checkpoint import MAGIC, CheckpointError, load_checkpoint

    out = tmp_path / "run"
    _train(out, "--epochs", "2")
    ckpt = out / "checkpoint.pt"
    state = load_checkpoint(ckpt)  # a genuine checkpoint loads
    marker = tmp_path / "ran"
    state["history"] = [_RunsCode(marker)]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    ckpt.write_bytes(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    result = (out / "result.json").read_bytes()
    with pytest.raises(CheckpointError, match="holds more than tensors, numbers, strings and containers"):
        load_checkpoint(ckpt)
    _refused(["train", "--output-dir", str(out), "--resume", "--no-progress"], "could run code .* refused")
    _refused(["export", "--output-dir", str(out)], "could run code .* refused")
    assert not marker.exists()
    assert (out / "result.json").read_bytes() == result


def test_a_new_run_in_an_earlier_runs_directory_replaces_none_of_its_files(tmp_path, capsys):
    """A new run written where an earlier one is (the default runs/latest, or the same --output-dir) replaced its
    result, checkpoint, key and figure.  They are now moved, byte for byte, into ``earlier-<time>/`` inside it,
    where a resume can still continue them; a resume itself moves nothing (it continues the files)."""
    out = tmp_path / "run"
    first = _train(out)
    names = ("result.json", "checkpoint.pt", "checkpoint.pt.key", "training.png")
    before = {name: (out / name).read_bytes() for name in names}
    capsys.readouterr()
    _train(out)
    assert "held an earlier run's files: moved to" in capsys.readouterr().err
    (kept,) = [p for p in out.iterdir() if p.is_dir()]
    assert kept.name.startswith("earlier-") and {p.name for p in kept.iterdir()} == set(names)
    assert all((kept / name).read_bytes() == data for name, data in before.items())
    assert all((out / name).exists() for name in names)
    assert main(["train", "--output-dir", str(kept), "--resume", "--no-progress"]) == 0  # still resumable there
    assert json.loads((kept / "result.json").read_text())["epsilon"] == first["epsilon"]
    assert [p for p in kept.iterdir() if p.is_dir()] == []  # the resume moved nothing
    assert main(["export", "--output-dir", str(out)]) == 0
    exported = (out / "model.pt2").read_bytes()
    _train(out)  # the second run's files get a folder of their own (named "-2" within the same second)
    folders = [p for p in out.iterdir() if p.is_dir() and p != kept]
    assert len(folders) == 1 and {p.name for p in folders[0].iterdir()} == {*names, "model.pt2"}
    assert (folders[0] / "model.pt2").read_bytes() == exported  # the export goes with the run it was made from
    assert not (out / "model.pt2").exists()


@pytest.mark.parametrize("command", ["train", "kl-study"])
def test_a_run_into_a_directory_another_run_is_writing_is_refused(tmp_path, capsys, command):
    """Two runs started into one output directory (the default runs/latest twice) each moved the other's files
    aside and replaced its checkpoint and result at every epoch. The directory is now claimed (a flock held for the
    run): a second process is refused before it moves or writes anything, and the first run's files stay."""
    import subprocess
    import sys

    out = tmp_path / "run"
    if command == "train":
        _train(out)
    else:
        out.mkdir()
        (out / "kl_study.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    holder = subprocess.Popen(  # another process running in the directory: it claims it, then waits
        [sys.executable, "-c", "import sys; from clipless.train.checkpoint import claim_directory; "
         f"claim_directory({str(out)!r}); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        args = ["train", *FAST, "--output-dir", str(out)] if command == "train" else \
            ["kl-study", "--data-dir", str(write_fake_mnist(tmp_path / "mnist")), "--output-dir", str(out)]
        _refused(args, "being written by another run .*choose another output directory")
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
        assert not [p for p in out.iterdir() if p.is_dir()]  # nothing moved aside
    finally:
        holder.communicate("")
    if command == "train":  # once it has ended, a new run goes ahead (the earlier files kept aside), twice in a row
        capsys.readouterr()
        _train(out)
        _train(out)
        assert len([p for p in out.iterdir() if p.is_dir()]) == 2


def test_a_file_system_without_flock_runs_unguarded_with_a_warning(tmp_path, monkeypatch):
    """Where the lock cannot be taken at all (a file system without flock, ENOLCK), the run goes on with a warning
    instead of refusing to start; a lock held by another process is still refused."""
    import errno
    import fcntl

    from clipless.train.checkpoint import claim_directory, release_directories

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.warns(UserWarning, match="could not lock .*No locks available.*would not be refused"):
        claim_directory(tmp_path)
    release_directories()
    monkeypatch.undo()
    assert main(["train", *FAST, "--output-dir", str(tmp_path / "run")]) == 0


def test_keep_earlier_files_moves_each_file_whole_or_not_at_all(tmp_path, monkeypatch):
    """Only the named files that exist move, into a folder of their own per call; a failed move raises one error
    and leaves every file whole, where it was or where it went."""
    from clipless.train.checkpoint import CheckpointError, keep_earlier_files

    assert keep_earlier_files(tmp_path, ("result.json",)) is None and list(tmp_path.iterdir()) == []
    for name in ("result.json", "checkpoint.pt", "notes.txt"):
        (tmp_path / name).write_text(name)
    first = keep_earlier_files(tmp_path, ("result.json", "checkpoint.pt", "training.png"))
    assert sorted(p.name for p in first.iterdir()) == ["checkpoint.pt", "result.json"]
    assert (tmp_path / "notes.txt").read_text() == "notes.txt"  # not named: left alone
    (tmp_path / "result.json").write_text("second")
    second = keep_earlier_files(tmp_path, ("result.json",))
    assert second != first and (second / "result.json").read_text() == "second"
    (tmp_path / "result.json").write_text("third")
    (tmp_path / "checkpoint.pt").write_text("third")
    real = os.replace

    def fails_on_the_second(src, dst):
        if Path(src).name == "checkpoint.pt":
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        real(src, dst)

    monkeypatch.setattr(os, "replace", fails_on_the_second)
    with pytest.raises(CheckpointError, match="could not move the earlier run's files .* nothing was replaced"):
        keep_earlier_files(tmp_path, ("result.json", "checkpoint.pt"))
    texts = sorted(p.read_text() for p in tmp_path.rglob("*") if p.is_file() and p.name != "notes.txt")
    assert texts.count("third") == 2 and "second" in texts  # every file whole, one place or the other


def test_write_atomically_cleans_up_after_any_failure(tmp_path, monkeypatch):
    from clipless.train.checkpoint import CheckpointError, write_atomically

    path = tmp_path / "result.json"
    path.write_bytes(b"old")

    def fail(fd):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(CheckpointError, match="Read-only file system; the previous file"):
        write_atomically(path, b"new")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_every_shipped_recipe_is_a_valid_config() -> None:
    """configs/*.yaml are read and checked by the same schema as the flags (a recipe that does not load is a bug)."""
    from pathlib import Path

    from clipless.cli import _read_yaml, validate

    recipes = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert {p.name for p in recipes} >= {"digits.yaml", "mnist.yaml"}
    for path in recipes:
        config = validate(_read_yaml(str(path)), f" (in {path})")
        assert config["epsilon"] > 0 and "dataset" in config


def test_the_main_job_runs_the_choice_of_its_validation_search() -> None:
    """The CLI's defaults and configs/digits.yaml are what benchmarks/main_job.py's search chose on the validation
    split (its CHOSEN): a default edited by hand, or a search that moved on without them, fails here."""
    import importlib.util
    from pathlib import Path

    from clipless.cli import DEFAULTS, _read_yaml, validate

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("main_job", root / "benchmarks" / "main_job.py")
    search = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(search)
    recipe = validate(_read_yaml(str(root / "configs" / "digits.yaml")))
    # the defaults say features "auto": scattering for images fed to an mlp (the recipe writes it out)
    for config, features in ((recipe, "scattering"), (validate(dict(DEFAULTS)), "auto")):
        assert {k: config[k] for k in search.CHOSEN} == {**search.CHOSEN, "features": features}
        assert config["epsilon"] == 3.0 and config["dataset"] == "digits" and config["model"] == "mlp"
    assert search.CHOSEN in search.CLIPLESS_GRID


def test_mnist_recipes_are_the_choices_of_the_validation_search() -> None:
    """configs/mnist.yaml and configs/mnist_eps3.yaml hold what benchmarks/mnist_search.py chose on validation
    (a recipe edited by hand, or a search that moved on without its file, fails here)."""
    import importlib.util
    from pathlib import Path

    from clipless.cli import _read_yaml, validate

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("mnist_search", root / "benchmarks" / "mnist_search.py")
    search = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(search)
    for name, chosen, epsilon in (("mnist.yaml", {"features": "scattering", **search.FINAL["first"]}, 1.0),
                                  ("mnist_eps3.yaml", {"features": "scattering", **search.FINAL["third"]}, 3.0),
                                  ("mnist_pixels.yaml", search.FINAL["pixels4"], 3.0)):
        config = validate(_read_yaml(str(root / "configs" / name)))
        assert config["epsilon"] == epsilon, name
        assert {k: config[k] for k in chosen} == chosen, name


def test_energy_layer_noise_from_the_cli_keeps_epsilon_and_unequal_sigmas(tmp_path, monkeypatch) -> None:
    import clipless.train.trainer as trainer_module

    plans = []
    original = trainer_module.PrivateTrainer.fit

    def fit(self):
        plans.append(self.optimizer.plan)
        return original(self)

    monkeypatch.setattr(trainer_module.PrivateTrainer, "fit", fit)
    result = _train(tmp_path / "run", "--features", "none", "--strategy", "per_layer", "--layer-noise", "energy",
                    "--epsilon", "2")
    plan = plans[0]
    sigmas = list(plan.layer_sigmas.values())
    assert len(sigmas) == 2 and max(sigmas) > 1.2 * min(sigmas)  # MLP 64-16-10: its layers differ in p_d g_d^2
    # the accounted multiplier is the composition of what is drawn, and the run stays within its target
    assert sum(s ** -2 for s in sigmas) ** -0.5 == pytest.approx(plan.step_sigma, rel=1e-9)
    assert result["epsilon"] <= 2.0 and result["config"]["layer_noise"] == "energy"


def test_loss_gradient_clip_can_be_turned_off_from_flags(tmp_path) -> None:
    """The default clip (0.25) is switched off by --no-loss-grad-clip, over a YAML value too; giving both flags
    is refused."""
    from clipless.cli import _parser, resolve_config

    def config(*argv: str) -> dict:
        args = _parser().parse_args(["train", "--epsilon", "1", *argv])
        return resolve_config(args)

    assert config()["loss_grad_clip"] == 0.25
    assert config("--loss-grad-clip", "0.5")["loss_grad_clip"] == 0.5
    assert config("--no-loss-grad-clip")["loss_grad_clip"] is None
    recipe = tmp_path / "r.yaml"
    recipe.write_text("loss-grad-clip: 0.1\n")
    assert config("--config", str(recipe), "--no-loss-grad-clip")["loss_grad_clip"] is None
    with pytest.raises(SystemExit):
        config("--loss-grad-clip", "0.5", "--no-loss-grad-clip")


def test_progress_bars_only_on_a_terminal(tmp_path, capsys, monkeypatch):
    """Piped or logged output (CI, ``| tee``) got one redrawn bar per epoch, with ``\\r``; bars now default to on
    only when stderr is a terminal, and ``--no-progress`` still turns them off there."""
    fast = [f for f in FAST if f != "--no-progress"]
    main(["train", *fast, "--output-dir", str(tmp_path / "piped")])
    assert "it/s" not in capsys.readouterr().err
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    main(["train", *fast, "--output-dir", str(tmp_path / "terminal")])
    assert "epoch 1" in capsys.readouterr().err
    main(["train", *FAST, "--output-dir", str(tmp_path / "off")])
    assert "it/s" not in capsys.readouterr().err
