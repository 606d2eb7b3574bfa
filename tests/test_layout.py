"""The package layout holds: a privacy core that imports nothing else of ours, no import cycle, no private
name imported across folders, and ``python -m clipless`` is the ``clipless`` command."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

import clipless

PACKAGE = Path(clipless.__file__).parent


def _module_name(path: Path) -> str:
    parts = ("clipless",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> List[Tuple[str, List[str]]]:
    """``(imported clipless module, names)`` for every import of ours in ``path`` (relative ones resolved)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "clipless":
                continue
            names = [a.name for a in node.names]
            submodules = [f"{target}.{n}" for n in names if (PACKAGE.parent / f"{target}.{n}".replace(".", "/")).exists()
                          or (PACKAGE.parent / (f"{target}.{n}".replace(".", "/") + ".py")).exists()]
            found.append((target, names))
            found += [(m, []) for m in submodules]
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "clipless"]
    return found


def _graph() -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        graph[_module_name(path)] = {target for target, _ in _imports(path)}
    return graph


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else ""


def test_privacy_core_imports_nothing_else_of_ours():
    violations = []
    for path in (PACKAGE / "privacy").rglob("*.py"):
        for target, _ in _imports(path):
            if not target.startswith("clipless.privacy"):
                violations.append(f"{_module_name(path)} imports {target}")
    assert not violations, violations
    # and at run time: importing the core loads no other part of the package
    code = ("import sys, clipless.privacy; print(sorted(m for m in sys.modules if m.startswith('clipless') and "
            "not m.startswith('clipless.privacy') and m != 'clipless'))")
    # importing clipless.privacy runs clipless/__init__ first, which loads the wings; load the core alone instead
    loader = ("import importlib.util, sys, types; pkg = types.ModuleType('clipless'); pkg.__path__ = [%r]; "
              "sys.modules['clipless'] = pkg; import clipless.privacy; "
              "print(sorted(m for m in sys.modules if m.startswith('clipless.') and not "
              "m.startswith('clipless.privacy')))" % str(PACKAGE))
    out = subprocess.run([sys.executable, "-c", loader], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    assert code  # the plain import is what users write; the loader above isolates the core


def test_no_import_cycle():
    graph = _graph()
    state: Dict[str, int] = {}
    cycle: List[str] = []

    def visit(node: str, stack: List[str]) -> bool:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph or nxt == node:
                continue
            # a package's __init__ importing its own modules is not a cycle of modules
            if node == nxt.rsplit(".", 1)[0] or nxt == "clipless":
                continue
            if state.get(nxt) == 1:
                cycle.extend(stack + [node, nxt])
                return True
            if state.get(nxt) is None and visit(nxt, stack + [node]):
                return True
        state[node] = 2
        return False

    for module in sorted(graph):
        if module.count(".") and not module.endswith("__init__") and state.get(module) is None:
            if visit(module, []):
                break
    assert not cycle, " -> ".join(cycle)


def test_no_private_name_imported_across_folders():
    violations = []
    for path in PACKAGE.rglob("*.py"):
        here = _folder(_module_name(path))
        for target, names in _imports(path):
            if _folder(target) != here:
                violations += [f"{_module_name(path)} imports {target}.{n}" for n in names if n.startswith("_")]
    assert not violations, violations


def test_python_dash_m_clipless_is_the_command():
    out = subprocess.run([sys.executable, "-m", "clipless", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout and "pretrain" in out.stdout


def test_public_all_is_sorted_and_importable():
    assert clipless.__all__ == sorted(clipless.__all__)
    for name in clipless.__all__:
        assert getattr(clipless, name) is not None
