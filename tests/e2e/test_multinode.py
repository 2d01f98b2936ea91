"""Across Ray nodes (#22): four simulated nodes on this machine, two racks, one spare node; then nodes are lost
and added.
Runs in its own process (``multinode_run.py``: its own Ray cluster, apart from the session's one-node cluster)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).with_name("multinode_run.py")


@pytest.fixture(scope="module")
def run(tiny_model_path, tmp_path_factory) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(SCRIPT), tiny_model_path, str(tmp_path_factory.mktemp("multinode") / "ckpt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_actors_run_where_the_rack_aware_plan_put_them(run):
    """The trainer and engine 0 share the rack-a node, engine 1 is on rack b, the other rack-b node is the spare:
    checked against the node each actor reports, not only the plan."""
    racks, nodes = run["racks"], run["nodes"]
    assert nodes == run["planned"]
    assert racks[nodes["trainer"]] == racks[nodes["engines"][0]] == "a" and racks[nodes["engines"][1]] == "b"
    assert racks[run["spare"]] == "b" and run["spare"] not in [nodes["trainer"], *nodes["engines"]]
    assert set(run["control"].values()) == {run["driver"]}  # pool, router, buffer beside the driver, on no rack
    # the dashboard's Actors tab tells the engines and ranks apart (their repr)
    for name in ("EmbeddedEngineActor(engine_id=0", "EmbeddedEngineActor(engine_id=1", "TrainerWorker(rank=0"):
        assert any(r.startswith(name) for r in run["actor_reprs"]), (name, run["actor_reprs"])


def test_grpo_sync_routing_and_checkpoints_across_nodes(run):
    """Verified GRPO syncs reach the other node's engine, the Router uses both nodes, a shared-memory broadcaster
    serves the same-node engine through shared memory and the other through the object store (same checksum as
    the broadcast), and a run checkpoint round-trips."""
    first, second = run["sync_checksums"]
    assert first != second  # each step's weights reached both engines (verified there)
    assert run["engines_used"] == [0, 1]
    shared = run["shared_memory_sync"]
    assert shared["version"] == run["weight_version"] == 2 and shared["checksum"] == second and shared["bytes"] > 0
    assert run["engine_versions"] == [2, 2] and run["checkpoint_step"] == 3


def test_a_lost_engine_node_loses_no_prompt_and_its_engine_returns_on_the_spare(run):
    """cluster.remove_node under a rollout: every prompt once, engine 1 evicted, then started on the spare node
    with the trainer's weights (checksum), and both engines serve the current version."""
    assert run["rollout_group_ids"] == list(range(1, 13)) and run["rollout_samples"] == 48
    assert run["evicted"] == [1] and run["healed"] == [1]
    assert run["healed_node"] == run["spare"] and run["healed_checksum_matches"]
    assert run["engines_after_heal"] == [0, 1] and run["versions_after_heal"] == [2]


def test_the_pool_grows_onto_a_node_added_back(run):
    """cluster.add_node after the loss: grow_pool starts engine 2 on the new node with the current weights and the
    Router sends it requests."""
    assert run["grown_engine"] == 2 and run["grown_node"] == run["added_node"] and run["grown_checksum_matches"]
    assert run["engines_after_grow"] == [0, 1, 2]


def test_a_lost_trainer_node_resumes_on_the_spare_like_an_uninterrupted_run(run):
    """The trainer's node (with engine 0) is removed after a step past the last checkpoint: the rank restarts on
    the spare, the checkpoint (weights, optimizer, data position) loads, the same step gives bit-identical weights;
    engine 0 comes back on the spare too and every engine serves the new weights."""
    assert run["resumed_step"] == 1 and run["resumed"] == run["uninterrupted"]
    assert run["restarted_trainer_node"] == run["spare"] and run["engine0_node_after"] == run["spare"]
    assert run["healed_after_trainer_loss"] == [0] and run["engine_checksums_match"] == [True, True, True]
    assert run["engines_after_restart"] == [0, 1, 2] and run["versions_after_restart"] == [run["resumed"][1]]


def test_shutdown_removes_every_placement_group_the_run_made(run):
    """The plan's group and the one-bundle groups made by the pool and the trainer group for bundles moved to the
    spare node or added (which would otherwise hold their resources as long as the driver lives)."""
    assert run["groups_before_shutdown"] >= 3 and run["groups_after_shutdown"] == 0
