"""Every Python example of the README runs as written (a block that does not start with an import continues the
previous one; a block that starts with ``# a fragment`` is part of a larger loop and is not run)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)


def _examples():
    """Groups of blocks that run in one namespace, each named by the README line it starts on."""
    text = README.read_text()
    groups = []
    for match in _BLOCK.finditer(text):
        code = textwrap.dedent(match.group(2))
        line = text[:match.start()].count("\n") + 1
        if code.startswith("# a fragment"):
            continue
        if code.startswith(("import ", "from ")) or not groups:
            groups.append((line, [code]))
        else:
            groups[-1][1].append(code)
    return groups


def test_the_readme_has_examples():
    assert len(_examples()) >= 6


@pytest.mark.slow
@pytest.mark.parametrize("line, blocks", _examples(), ids=lambda v: f"line {v}" if isinstance(v, int) else "")
def test_readme_example_runs(line, blocks, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever an example writes stays out of the checkout
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, f"README.md:{line}", "exec"), namespace)
