"""Optional components (vLLM, SGLang, megatron-core) that are absent: a skip on a developer's machine, a failure in CI.

``scripts/test.sh`` installs all three and sets ``MILES_RAY_REQUIRE=vllm,sglang,megatron``, so there a broken
install turns the suite red instead of into skips nobody reads.
"""

import importlib
import os

import pytest


def required(component: str) -> bool:
    """Whether ``MILES_RAY_REQUIRE`` (a comma-separated list) names ``component``."""
    return component in {c.strip() for c in os.environ.get("MILES_RAY_REQUIRE", "").split(",")}


def missing(component: str, reason: str) -> None:
    """Skip (or, where ``component`` is required, fail) the calling test or module."""
    if required(component):
        pytest.fail(f"{reason} (MILES_RAY_REQUIRE names {component!r}: it must run here)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def import_or_missing(module: str, component: str):
    """``importlib.import_module(module)``, or ``missing`` when it does not import."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing(component, f"{module} does not import: {exc}")
