"""Names of journeyman 0.1 that 0.2 changed, kept with a ``DeprecationWarning`` until 0.3."""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

REMOVED_IN = "journeyman 0.3"


def warn(old: str, new: str, *, stacklevel: int = 3) -> None:
    warnings.warn(
        f"{old} is now {new} ({old} goes in {REMOVED_IN})", DeprecationWarning, stacklevel=stacklevel
    )


class _CallableModule(types.ModuleType):
    """A module that 0.1 users called as the function ``jm.<name>`` of the same name."""

    _function: Callable[..., Any]
    _new: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = self.__name__.rpartition(".")[2]
        warn(f"jm.{name}(...)", self._new)
        return self._function(*args, **kwargs)


def callable_module(module: str, function: Callable[..., Any], new: str) -> None:
    """``jm.replay`` and ``jm.ruler`` are modules now: calling one still calls ``function``, with a
    warning that names ``new``, what to call instead."""
    found = sys.modules[module]
    found.__class__ = _CallableModule
    found._function = function  # type: ignore[attr-defined]
    found._new = new  # type: ignore[attr-defined]
