"""Import paths that moved keep working for one release, with a warning.

Two kinds of alias, both without a file at the old path (a file there would keep
a second module of the same name in the tree, which ``tests/test_layout.py``
forbids):

- a **module** that moved (``flowerbed.parallel.data`` is now
  ``flowerbed.parallel.job_data``): the package calls :func:`alias_modules` in its
  ``__init__``; ``import`` of the old path then warns and binds the new module
  itself, so ``old.X is new.X``. (``import a.b.c`` finds ``c`` through
  ``sys.meta_path``; the finder here answers for the old names only, after every
  real module, and the import system returns whatever ``sys.modules`` holds for
  the name once the loader ran: the new module.)
- a **name** a package or module no longer holds (``run_segment`` of
  ``flowerbed.parallel.pipeline``, now a package): the module sets
  ``__getattr__ = moved_names(__name__, {name: new module})``.

Either warning (:class:`DeprecationWarning`) names the new path and points at the
line that used the old one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

_OWN_FRAMES = (__file__, importlib.__file__)


def _user_stacklevel() -> int:
    """``stacklevel`` for :func:`warnings.warn`, called by this module's caller,
    that names the first frame outside this module and the import machinery
    (``warn`` itself skips the frames of ``importlib._bootstrap``)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name in _OWN_FRAMES:
            level += 1
        elif not ("importlib" in name and "_bootstrap" in name):
            break
        frame = frame.f_back  # type: ignore[assignment]
    return level


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names of moved modules and loads them as the new ones."""

    def __init__(self) -> None:
        self.moves: dict[str, str] = {}

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.moves:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        old, new = module.__name__, self.moves[module.__name__]
        warnings.warn(
            f"{old} moved to {new}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=_user_stacklevel(),
        )
        sys.modules[old] = importlib.import_module(new)


_FINDER = _MovedModules()


def alias_modules(moves: Mapping[str, str]) -> None:
    """Make each old module path (key) import, with a warning, as the new one."""
    _FINDER.moves.update(moves)
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)


def moved_names(module: str, moves: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for names of ``module`` that now live in other
    modules (``{name: new module}``): it warns and returns the new module's name."""

    def __getattr__(name: str) -> Any:
        if name not in moves:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home = moves[name]
        warnings.warn(
            f"{module}.{name} moved to {home}.{name}; the old path goes in the "
            "next release",
            DeprecationWarning,
            stacklevel=_user_stacklevel(),
        )
        return getattr(importlib.import_module(home), name)

    return __getattr__
