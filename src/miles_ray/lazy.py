"""Names a package exports without importing their modules until first use.

The package root re-exports the actors, which import Ray; the engine, the trainer backends, the RL step and the
sync transports do not need Ray and must import without it (a GPU box or a plain ``torchrun`` job may have
none). A package lists its Ray-bound names with ``lazy(...)`` and assigns the result to its ``__getattr__``.

Usage (in ``miles_ray/__init__.py``)::

    __getattr__ = lazy(__name__, {"TrainerGroup": "miles_ray.actors.trainer_group:TrainerGroup"})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy(module: str, names: dict[str, str], fallback: Callable[[str], Any] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` importing each of ``names`` on first use and keeping it.

    ``names`` maps a name to ``"pkg.module:attr"`` (or ``"pkg.module"`` for a submodule); any other name goes to
    ``fallback`` (e.g. ``deprecation.moved``).

    Raises:
        AttributeError: (from the returned function) for a name neither knows, as a module would.

    """

    def __getattr__(name: str) -> Any:
        if name not in names:
            if fallback is not None:
                return fallback(name)
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        path, _, attr = names[name].partition(":")
        value = importlib.import_module(path)
        if attr:
            value = getattr(value, attr)
        setattr(sys.modules[module], name, value)  # resolved once
        return value

    return __getattr__
