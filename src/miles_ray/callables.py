"""Extension points given as a callable or an import path, resolved once where the config is made.

Rewards, losses, rollout functions, group filters and trainer hooks all take either a Python callable or a
string ``"pkg.module:attr"`` (or ``"pkg.module.attr"``); ``resolve_callable`` is the one place that turns the
string into the object, with an error naming the config field when it cannot.

Usage::

    fn = resolve_callable("miles_ray.rollout:has_reward_signal", "group_filter")
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def resolve_callable(spec: str | Callable, what: str = "callable") -> Callable:
    """Resolve ``"pkg.module:attr"`` / ``"pkg.module.attr"`` or return a callable as is.

    Args:
        spec: the callable, or its import path.
        what: the config field it came from, named in errors.

    Raises:
        ValueError: if the path cannot be imported or does not name a callable.

    """
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{what} must be a callable or an import path 'pkg.module:attr', got {spec!r}")
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"{what} {spec!r} cannot be imported: {exc}") from exc
    if not callable(obj):
        raise ValueError(f"{what} {spec!r} is not callable")
    return obj
