"""Shared output of the benchmark scripts: a printed table and a JSON file; the workers' allocator setting."""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any, Sequence, Union


def print_table(header: str, lines: Sequence[str]) -> None:
    print(header)
    print("-" * len(header))
    for line in lines:
        print(line)


def write_json(path: Union[str, Path], payload: Any, quiet: bool = False) -> None:
    """``payload`` as JSON at ``path``, replaced at once: a run killed while writing leaves the earlier file whole."""
    from clipless.train.checkpoint import write_atomically

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, (json.dumps(payload, indent=2, default=str) + "\n").encode())
    if not quiet:
        print(f"wrote {out}")


def write_text(path: Union[str, Path], text: str) -> None:
    """``text`` at ``path``, replaced at once (as :func:`write_json`)."""
    from clipless.train.checkpoint import write_atomically

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomically(Path(path), text.encode())


def save_plot(fig: Any, path: Union[str, Path]) -> Path:
    """Save and close ``fig``, replacing ``path`` at once (``clipless.diagnostics.plots.save_figure``)."""
    import matplotlib.pyplot as plt

    from clipless.diagnostics.plots import save_figure

    return save_figure(plt, fig, path)


def rss_mb() -> float:
    """Resident set size of this process now, in MB (peak RSS comes from ``resource.getrusage``)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / 2 ** 20


# A worker's C allocator: "tuned" as the CLI runs (clipless.train.tune_cpu_allocator), "system" glibc's defaults.
ALLOCATORS = ("tuned", "system")


def use_allocator(name: str) -> None:
    if name == "tuned":
        from clipless.train import tune_cpu_allocator

        tune_cpu_allocator()
