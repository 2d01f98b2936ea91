"""Checks that a class implements a ``Protocol`` in full: every member, sync or async as declared, same parameters.

``isinstance`` with a ``runtime_checkable`` Protocol only looks for names; an engine actor whose
``receive_broadcast`` lost a parameter, or became synchronous, would pass it and fail mid-run. ``protocol_gaps``
compares signatures, so a contract test (and a user writing their own engine actor or backend) finds the gap
before anything runs.

Usage::

    assert protocol_gaps(SGLangEngineActor, EngineInterface) == []
"""

from __future__ import annotations

import inspect
from typing import Any


def protocol_members(protocol: type) -> list[str]:
    """The names a Protocol declares: its methods, properties and annotated attributes, its bases' included."""
    names: list[str] = []
    for klass in reversed(protocol.__mro__):
        if klass is object or not getattr(klass, "_is_protocol", False):
            continue
        own = [n for n, v in vars(klass).items() if (callable(v) or isinstance(v, property)) and n[0] != "_"]
        own += list(getattr(klass, "__annotations__", {}))
        names += [n for n in own if n not in names]
    return names


def protocol_gaps(cls: type, protocol: type) -> list[str]:
    """What ``cls`` lacks to implement ``protocol``; empty when it implements it.

    A method must exist, be ``async`` exactly when the Protocol's is, and accept every parameter of the
    Protocol's method in the same order, under the same name unless the Protocol declares it positional-only (more
    parameters are fine if they have defaults).
    An annotated attribute must exist on the class or be set in its ``__init__``.
    """
    gaps = []
    for name in protocol_members(protocol):
        wanted = getattr(protocol, name, None)
        if not callable(wanted):  # an attribute: a class attribute, or assigned in __init__
            if not hasattr(cls, name) and f"self.{name}" not in _init_source(cls):
                gaps.append(f"{name}: attribute missing")
            continue
        got = getattr(cls, name, None)
        if not callable(got):
            gaps.append(f"{name}: method missing")
            continue
        if inspect.iscoroutinefunction(wanted) != inspect.iscoroutinefunction(got):
            gaps.append(f"{name}: must be {'async' if inspect.iscoroutinefunction(wanted) else 'sync'}")
        gaps += [f"{name}: {p}" for p in _parameter_gaps(wanted, got)]
    return gaps


def _parameter_gaps(wanted: Any, got: Any) -> list[str]:
    want = [p for p in inspect.signature(wanted).parameters.values() if p.name != "self"]
    have = [p for p in inspect.signature(got).parameters.values() if p.name != "self"]
    if any(p.kind is p.VAR_POSITIONAL for p in have) and any(p.kind is p.VAR_KEYWORD for p in have):
        return []  # (*args, **kwargs) accepts anything
    gaps = []
    for i, p in enumerate(want):
        if i >= len(have):
            gaps.append(f"parameter {i} ({p.name!r}) missing")
        elif have[i].name != p.name and p.kind is not p.POSITIONAL_ONLY:  # positional-only: any name will do
            gaps.append(f"parameter {i} must be {p.name!r}")
    gaps += [f"extra parameter {p.name!r} needs a default" for p in have[len(want) :] if p.default is p.empty]
    return gaps


def _init_source(cls: type) -> str:
    """The source of every ``__init__`` along the class's MRO (where attributes are assigned)."""
    sources = []
    for klass in cls.__mro__:
        if "__init__" in vars(klass) and klass is not object:
            try:
                sources.append(inspect.getsource(klass.__init__))
            except (OSError, TypeError):  # a C-implemented or dynamically made __init__ has no source
                pass
    return "".join(sources)
