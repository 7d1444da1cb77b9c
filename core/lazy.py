"""Package names imported on first use.

A package that re-exports names from heavy submodules (torch, Flower) lists them
as ``{name: module}`` and sets ``__getattr__ = lazy_names(__name__, exports)``:
``import`` of the package stays cheap, and the first access of a name imports its
module and binds the name in the package, so later accesses are plain lookups.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports each of ``exports``
    (``{name: module}``) from its module on first access and keeps it."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    return __getattr__
