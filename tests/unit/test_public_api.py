"""The public surface exists, every module imports on its own (no cycles), and sglang/megatron stay optional."""

import importlib
import pkgutil
import subprocess
import sys

import miles_ray

EXPECTED = [
    "TrainerGroup",
    "TrainerGroupConfig",
    "RolloutPool",
    "RolloutPoolConfig",
    "Router",
    "RouterConfig",
    "ReplayBuffer",
    "ReplayBufferConfig",
    "WeightBroadcaster",
    "WeightBroadcasterConfig",
    "Sample",
    "RolloutBatch",
    "SamplingParams",
    "EmbeddedEngineConfig",
    "HttpServerConfig",
    "TrainerHooksConfig",
    "SGLangEngineConfig",
    "VLLMEngineConfig",
    "CriticGroup",
    "CriticGroupConfig",
    "ReferenceGroup",
    "ReferenceGroupConfig",
    "AsyncRollout",
    "AsyncRolloutConfig",
    "Stack",
    "StackConfig",
    "build_stack",
    "placement",
]


def test_public_exports():
    for name in EXPECTED:
        assert hasattr(miles_ray, name), name
    assert set(EXPECTED) <= set(miles_ray.__all__)


def _modules():
    return [m.name for m in pkgutil.walk_packages(miles_ray.__path__, "miles_ray.")]


def test_every_module_imports_alone_in_a_fresh_interpreter():
    # a cycle shows up as an ImportError when a module is the first miles_ray module imported; one interpreter
    # drops every miles_ray module before each import (torch & co. stay loaded, so this stays fast)
    code = (
        "import importlib, sys\n"
        "for m in sys.argv[1:]:\n"
        "    for k in [k for k in sys.modules if k == 'miles_ray' or k.startswith('miles_ray.')]:\n"
        "        del sys.modules[k]\n"
        "    importlib.import_module(m)\n"
    )
    res = subprocess.run([sys.executable, "-c", code, *_modules()], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-1500:]


def test_import_does_not_pull_optional_engines():
    code = "import sys, miles_ray, miles_ray.actors; print(any(m in sys.modules for m in ('sglang', 'megatron')))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_all_modules_listed():
    assert "miles_ray.actors.trainer_group" in _modules()
    for mod in _modules():
        importlib.import_module(mod)
