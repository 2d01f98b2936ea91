"""Old public names that keep working for a while, with a ``DeprecationWarning`` naming the new one.

A module lists its renamed names with ``moved(...)`` and assigns the result to its ``__getattr__``; the old name
resolves on first use (so no import cycle is created by the alias) and warns each time.

Usage (in ``miles_ray/actors/__init__.py``)::

    __getattr__ = moved(__name__, {"RolloutWorker": "miles_ray.actors.async_rollout:AsyncRollout"})
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved(module: str, renames: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` resolving each old name in ``renames`` to its new ``"pkg.module:attr"``, warning.

    Raises:
        AttributeError: (from the returned function) for any other name, as a module would.

    """

    def __getattr__(name: str) -> Any:
        if name not in renames:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        target = renames[name]
        path, _, attr = target.partition(":")
        warnings.warn(f"{module}.{name} is deprecated: use {path}.{attr}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(path), attr)

    return __getattr__
