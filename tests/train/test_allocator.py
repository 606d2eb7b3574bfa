"""The CPU allocator tuning keeps freed activation memory in the process (checked on resident memory)."""

import platform
import subprocess
import sys
import textwrap

import pytest

from clipless.train import allocator
from clipless.train.allocator import tune_cpu_allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# Resident memory before and after freeing four written 24 MiB tensors, as a step frees its activations: memory
# returned to the OS leaves the process (the next step faults it in again); kept memory stays resident for reuse.
_PROBE = textwrap.dedent("""
    import ctypes, importlib.util, os, sys, torch
    spec = importlib.util.spec_from_file_location("allocator", sys.argv[2])  # the module alone: a quicker start
    allocator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(allocator)
    if sys.argv[1] == "tuned":
        assert allocator.tune_cpu_allocator()
    else:  # glibc's initial mmap threshold, held fixed: how much its defaults return depends on what ran before
        ctypes.CDLL(None).mallopt(allocator._M_MMAP_THRESHOLD, 128 * 1024)
    page = os.sysconf("SC_PAGE_SIZE")
    def resident():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * page / 2**20
    for _ in range(3):  # glibc raises its mmap threshold as blocks are freed: what holds in steady state
        x = [torch.ones(6 * 2**20) for _ in range(4)]
        held = resident()
        del x
        freed = resident()
    print(held - freed)
""")


def _returned_mb(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode, allocator.__file__], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the allocator tuning applies to glibc on Linux only")
def test_freed_activation_memory_stays_in_the_process_once_tuned():
    assert _returned_mb("returning") > 64  # the probe sees memory handed back to the OS
    assert _returned_mb("tuned") < 8  # tuned, the next step reuses it without faulting pages in again


@pytest.mark.skipif(GLIBC, reason="elsewhere the tuning is a no-op")
def test_the_tuning_is_a_no_op_without_glibc():
    assert tune_cpu_allocator() is False


@pytest.mark.parametrize("command", [["train"], ["audit"], ["pretrain"], ["kl-study", "--data-dir", "x"]])
@pytest.mark.parametrize("opt_out", [False, True])
def test_the_cli_tunes_the_allocator_of_its_long_commands_unless_told_not_to(monkeypatch, command, opt_out):
    import clipless.cli as cli

    calls = []
    monkeypatch.setattr(cli, "tune_cpu_allocator", lambda: calls.append(1) or True)
    monkeypatch.setattr(cli, "_run", lambda args: 0)
    assert cli.main(command + (["--system-allocator"] if opt_out else [])) == 0
    assert calls == ([] if opt_out else [1])


def test_export_leaves_the_allocator_alone(monkeypatch):
    import clipless.cli as cli

    calls = []
    monkeypatch.setattr(cli, "tune_cpu_allocator", lambda: calls.append(1) or True)
    monkeypatch.setattr(cli, "_run", lambda args: 0)
    assert cli.main(["export"]) == 0
    assert calls == []
