"""SGLang engines for real: one SGLang 0.5.23 server (on this CPU, see ``miles_ray.engines.sglang``) for this
module, behind the Router and the WeightBroadcaster, with a real trainer on a tiny Llama.

Weights reach the server both ways SGLang offers: the server's rank joins the trainer's gloo broadcast group
(``/init_weights_update_group`` + ``/update_weights_from_distributed``, disaggregated) and, colocated, tensors by
shared-memory handle (``/update_weights_from_tensor``). The server's interpreter comes from
``MILES_RAY_SGLANG_PYTHON`` or ``.venv-sglang`` (``scripts/setup_sglang.sh``); without one these tests skip.
"""

from pathlib import Path

import pytest
import ray
from helpers import grpo_in_step, max_logprob_diff, server_python, trainer_logprobs, wait_outstanding

from miles_ray import placement
from miles_ray.actors import (
    RolloutPool,
    RolloutPoolConfig,
    Router,
    RouterConfig,
    TrainerGroup,
    TrainerGroupConfig,
    WeightBroadcaster,
    WeightBroadcasterConfig,
)
from miles_ray.engines.base import GenerateRequest, SamplingParams
from miles_ray.engines.sglang import SITE_DIR, SGLangEngineConfig
from miles_ray.sync.checksum import probe_checksum, probe_rows

pytestmark = [pytest.mark.e2e, pytest.mark.sglang]
PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def stack(ray_cluster):
    """One SGLang engine, router, trainer (1 rank) and two broadcasters (broadcast, shared memory)."""
    shim = {"PYTHONPATH": str(SITE_DIR), "SGLANG_USE_CPU_ENGINE": "1"}  # the CPU shim, as the engine sets it
    python = server_python("MILES_RAY_SGLANG_PYTHON", ".venv-sglang", "sglang.srt.entrypoints.http_server", shim)
    if python is None:
        pytest.skip("no SGLang environment: run scripts/setup_sglang.sh or set MILES_RAY_SGLANG_PYTHON")
    from miles_ray.models.hub import tiny_llama_dir

    model_path = str(tiny_llama_dir())
    pl = placement.create(placement.colocated(1))
    engine = SGLangEngineConfig(model_path=model_path, python=python, context_length=512, max_total_tokens=4096)
    pool = RolloutPool.remote(RolloutPoolConfig(engine=engine, served_model_name="tiny"), pl)
    engines = ray.get(pool.engines.remote())
    trainer = TrainerGroup.remote(TrainerGroupConfig(model_path=model_path, optimizer={"lr": 1e-2}), pl)
    workers = ray.get(trainer.workers.remote())
    stack = {
        "pool": pool, "engines": engines, "router": Router.remote(RouterConfig(), engines), "trainer": trainer,
        "model_path": model_path,
        "broadcast": WeightBroadcaster.remote(WeightBroadcasterConfig(transport="broadcast", backend="gloo"),
                                              workers, engines),
        "shared_memory": WeightBroadcaster.remote(WeightBroadcasterConfig(transport="shared_memory"), workers, engines),
    }  # fmt: skip
    yield stack
    ray.get(engines[0].shutdown.remote())
    ray.util.remove_placement_group(pl.pg)


def _generate(stack, n=4, max_new_tokens=10, temperature=1.0):
    params = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=True)
    return ray.get(stack["router"].generate.remote(GenerateRequest(list(PROMPT), params)))


def _max_diff_to_trainer(stack, out):
    return max_logprob_diff(out.completions, trainer_logprobs(stack["trainer"], PROMPT, out.completions))


def _train_step(stack, out):
    from miles_ray.actors.replay_buffer import GroupRef
    from miles_ray.types import Sample

    completions = enumerate(out.completions)
    samples = [Sample(list(PROMPT), c.token_ids, c.logprobs, reward=float(i % 2)) for i, c in completions]
    return ray.get(stack["trainer"].train_step.remote([GroupRef(ray.put(samples), len(samples), 0, 0)]))


def test_generate_through_the_router_matches_the_trainer(stack):
    out = _generate(stack)
    assert out.engine_id == 0 and len(out.completions) == 4
    assert all(len(c.token_ids) == len(c.logprobs) == 10 and c.finish_reason == "length" for c in out.completions)
    assert _max_diff_to_trainer(stack, out) < 1e-4  # fp32 on both sides: SGLang's logprobs are the trainer's


def test_grpo_steps_with_sglang_engines(stack):
    # runs second, on the checkpoint's weights: after the lr 1e-2 steps below the tiny policy can be peaked enough
    # that a group's 4 samples all get one reward (zero advantages, zero gradient)
    version = ray.get(stack["trainer"].weight_version.remote())
    ray.get(stack["broadcast"].sync.remote(version))
    checksums = grpo_in_step(stack["trainer"], stack["router"], stack["broadcast"], stack["model_path"], steps=2)
    assert len(set(checksums)) == 2  # each step's weights reached the server, verified


@pytest.mark.parametrize("transport", ["broadcast", "shared_memory"])
def test_sync_after_a_train_step_reaches_the_server(stack, transport):
    engine = stack["engines"][0]
    before = _generate(stack)
    metrics = _train_step(stack, before)
    version = metrics["weight_version"]
    report = ray.get(stack[transport].sync.remote(version))  # raises unless the server's probe checksum matches
    assert report["version"] == version and report["checksum"] == ray.get(engine.weights_checksum.remote())
    assert ray.get(engine.weight_version.remote()) == version
    assert ray.get(engine.server_weight_version.remote()) == str(version)  # SGLang's own record
    after = _generate(stack)
    assert after.weight_version == version
    assert _max_diff_to_trainer(stack, after) < 1e-4  # the server computes with the trained weights
    assert _max_diff_to_trainer(stack, before) > 1e-3  # and they differ from the old ones


def test_probe_checksum_tells_other_weights_apart(stack):
    """The probe the broadcaster compares changes when the server's weights change, and equals the trainer's."""
    from safetensors.torch import load_file

    engine = stack["engines"][0]
    server = ray.get(engine.weights_checksum.remote())
    assert server is not None  # set by the syncs above
    original = load_file(str(Path(stack["model_path"]) / "model.safetensors"))
    plan_names = ray.get(ray.get(stack["trainer"].workers.remote())[0].sync_plan.remote("float32", 1 << 30)).names
    assert probe_checksum(probe_rows((n, original[n]) for n in plan_names)) != server  # the checkpoint was trained


def test_pause_keeps_requests_and_abort_ends_them(stack):
    engine = stack["engines"][0]
    ray.get(engine.pause.remote("in_place"))
    pending = stack["router"].generate.remote(GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4)))
    ready, _ = ray.wait([pending], timeout=2.0)
    assert not ready  # held while paused
    ray.get(engine.resume.remote())
    assert len(ray.get(pending, timeout=60).completions[0].token_ids) == 4
    long = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=500, ignore_eos=True), request_id="long")
    future = engine.generate.remote(long)
    wait_outstanding(engine, 1)
    ray.get(engine.pause.remote("in_place"))  # held in the server's batch: it cannot finish before the abort
    ray.get(engine.abort.remote("long"))
    ray.get(engine.resume.remote())
    [completion] = ray.get(future, timeout=60).completions
    assert completion.finish_reason == "abort" and len(completion.token_ids) == len(completion.logprobs) < 500
    with pytest.raises(ValueError, match="pause mode"):
        ray.get(engine.pause.remote("later"))


def test_memory_release_around_a_train_step(stack):
    """The colocated protocol against the real server: release, train, resume weights, sync, resume KV cache.

    On this CPU the server has no memory saver (it needs CUDA), so nothing is freed and the engine says so
    (False); what runs for real is the route sequence, SGLang's idle check and the weights it keeps across it.
    """
    engine, pool = stack["engines"][0], stack["pool"]
    long = GenerateRequest(list(PROMPT), SamplingParams(max_new_tokens=400, ignore_eos=True), request_id="busy")
    future = engine.generate.remote(long)
    wait_outstanding(engine, 1)
    with pytest.raises(ray.exceptions.RayTaskError, match="release_memory with 1 requests in flight"):
        ray.get(pool.release_memory.remote())
    ray.get(engine.abort.remote("busy"))
    ray.get(future, timeout=60)
    before = _generate(stack)
    assert ray.get(pool.release_memory.remote()) == [False]
    metrics = _train_step(stack, before)
    assert ray.get(pool.resume_memory.remote("weights")) == [False]
    ray.get(stack["shared_memory"].sync.remote(metrics["weight_version"]))  # verified
    ray.get(pool.resume_memory.remote("kv_cache"))
    after = _generate(stack)
    assert after.weight_version == metrics["weight_version"] and _max_diff_to_trainer(stack, after) < 1e-4
