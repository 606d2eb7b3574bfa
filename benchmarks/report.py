"""Shared output of the benchmark scripts: a printed table and a JSON file; the workers' allocator setting."""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any, Dict, Sequence


def print_table(header: str, lines: Sequence[str]) -> None:
    print(header)
    print("-" * len(header))
    for line in lines:
        print(line)


def write_json(path: str, payload: Dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {out}")


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
