"""The C allocator under CPU training: freed activation memory kept for the next step, not handed back to the OS.

glibc's ``malloc`` serves blocks above a threshold (128 KiB, raised as such blocks are freed) with fresh
``mmap`` pages and trims the heap top once more than twice that threshold is free. A training step frees and
re-allocates the same activation-sized blocks every time, so each step writes into pages the kernel must fault
in and zero again. Keeping those blocks made the private CNN step 14-18% (batch 256) and 32-38% (batch 1024)
faster in two runs on a 2-core machine (``benchmarks/speed.py --allocators system tuned``, docs/results.md).
The CLI tunes the allocator of its own process; code that imports clipless calls :func:`tune_cpu_allocator`.
"""

from __future__ import annotations

import ctypes
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_cpu_allocator"]

_M_TRIM_THRESHOLD = -1  # mallopt parameters, <malloc.h>
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit systems (half its 64 MiB heap size): blocks up to it come from the heap.
MMAP_THRESHOLD = 32 * 2**20
# Free memory at the heap top is kept up to this (mallopt takes an int): in effect, never trimmed.
TRIM_THRESHOLD = 2**31 - 1


def tune_cpu_allocator() -> bool:
    """Keep freed memory in the process: ``mallopt(M_MMAP_THRESHOLD, 32 MiB)`` and ``mallopt(M_TRIM_THRESHOLD,
    2^31 - 1)``, so blocks up to 32 MiB are reused without page faults (as PyTorch's CUDA caching allocator reuses
    device memory). The resident memory then stays near its peak instead of falling between steps, and the peak
    can be higher (reused blocks fit less tightly: 380-411 against 315-320 MB for the private CNN step at batch
    1024). Returns whether it applied: Linux with glibc only (elsewhere, a no-op returning ``False``).
    Process-wide and permanent; calling it again changes nothing."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the process runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 for a value it rejects
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
