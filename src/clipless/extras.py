"""Optional dependencies: each is imported where it is used, with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str) -> ModuleType:
    """``import module``, or an ImportError saying ``pip install "clipless[extra]"``."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{module} is needed here and is not installed: pip install \"clipless[{extra}]\" "
                          f"(or all extras: clipless[all])") from err
