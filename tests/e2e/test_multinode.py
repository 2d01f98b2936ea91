"""Across Ray nodes (#22): a cluster of three simulated nodes on this machine, run in its own process
(``multinode_run.py``: its own Ray cluster, apart from the session's one-node cluster)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).with_name("multinode_run.py")


def test_grpo_sync_routing_and_checkpoints_across_nodes(tiny_model_path, tmp_path):
    """Trainer and engines on three different nodes (checked by node id, not only the plan): verified GRPO syncs
    between nodes, both nodes' engines serve, a shared-memory broadcaster reaches engines on other nodes through
    the object store with the same checksum as the broadcast, and a run checkpoint round-trips."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(SCRIPT), tiny_model_path, str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    nodes = [out["nodes"]["trainer"], *out["nodes"]["engines"]]
    assert len(set(nodes)) == 3 and out["alive_nodes"] == 3  # one role per node, as STRICT_SPREAD asked
    first, second = out["sync_checksums"]
    assert first != second  # each step's weights reached the other nodes' engines (verified there)
    assert out["engines_used"] == [0, 1]  # the Router sent requests to both nodes
    shared = out["shared_memory_sync"]
    assert shared["version"] == out["weight_version"] == 2 and shared["checksum"] == second and shared["bytes"] > 0
    assert out["engine_versions"] == [2, 2] and out["checkpoint_step"] == 3
