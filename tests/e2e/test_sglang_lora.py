"""LoRA on a real SGLang server: a peft-trained policy's adapter-only syncs become SGLang adapters.

One SGLang 0.5.23 server started with ``SGLangEngineConfig.lora`` (on this CPU through the engine's shim), a
trainer with ``backend.lora`` on every linear layer (SGLang fuses q/k/v and gate/up and splits the adapters over
the fused layers itself), and both transports: the engine actor in the trainer's broadcast group relaying each
adapter, and shared-memory buckets. The server checks the SHA-256 of every adapter tensor it is sent. Skips
without ``.venv-sglang`` (``scripts/setup_sglang.sh``).
"""

import time

import pytest
import ray
import requests
from helpers import grpo_in_step, max_logprob_diff, server_python, trainer_logprobs

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
from miles_ray.actors.replay_buffer import GroupRef
from miles_ray.engines.base import GenerateRequest, SamplingParams
from miles_ray.engines.sglang import SITE_DIR, SGLangEngineConfig, SGLangLoRAConfig
from miles_ray.types import Sample

pytestmark = [pytest.mark.e2e, pytest.mark.sglang]
PROMPT = [1, 2, 3, 4, 5]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def stack(ray_cluster):
    shim = {"PYTHONPATH": str(SITE_DIR), "SGLANG_USE_CPU_ENGINE": "1"}
    python = server_python("MILES_RAY_SGLANG_PYTHON", ".venv-sglang", "sglang.srt.entrypoints.http_server", shim)
    if python is None:
        pytest.skip("no SGLang environment: run scripts/setup_sglang.sh or set MILES_RAY_SGLANG_PYTHON")
    from miles_ray.models.hub import tiny_llama_dir

    model_path = str(tiny_llama_dir())
    pl = placement.create(placement.colocated(1))
    lora = SGLangLoRAConfig(max_lora_rank=8, target_modules=ALL_LINEAR)
    engine = SGLangEngineConfig(model_path=model_path, python=python, context_length=512, lora=lora)
    pool = RolloutPool.remote(RolloutPoolConfig(engine=engine, served_model_name="tiny"), pl)
    engines = ray.get(pool.engines.remote())
    backend = {"lora": {"rank": 4, "alpha": 8, "target_modules": ALL_LINEAR}}
    trainer_config = TrainerGroupConfig(model_path=model_path, optimizer={"lr": 1e-2}, backend=backend)
    trainer = TrainerGroup.remote(trainer_config, pl)
    workers = ray.get(trainer.workers.remote())
    stack = {
        "pl": pl, "pool": pool, "engines": engines, "router": Router.remote(RouterConfig(), engines),
        "trainer": trainer, "model_path": model_path, "url": ray.get(engines[0].health.remote())["url"],
        "broadcast": WeightBroadcaster.remote(WeightBroadcasterConfig(transport="broadcast", backend="gloo"),
                                              workers, engines),
        "shared_memory": WeightBroadcaster.remote(WeightBroadcasterConfig(transport="shared_memory"), workers, engines),
    }  # fmt: skip
    yield stack
    ray.get(engines[0].shutdown.remote())
    ray.util.remove_placement_group(pl.pg)


def _generate(stack, n=4, max_new_tokens=10):
    params = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=1.0, ignore_eos=True)
    return ray.get(stack["router"].generate.remote(GenerateRequest(list(PROMPT), params)))


def _max_diff_to_trainer(stack, out):
    return max_logprob_diff(out.completions, trainer_logprobs(stack["trainer"], PROMPT, out.completions))


def _served_adapters(stack) -> set[str]:
    models = requests.get(f"{stack['url']}/v1/models", timeout=30).json()["data"]
    return {m["id"] for m in models} - {"tiny"}


def test_grpo_steps_with_adapters_on_sglang(stack):
    # first, on fresh adapters (B = 0: the server's base weights are the policy until the first sync)
    assert _max_diff_to_trainer(stack, _generate(stack)) < 1e-4
    ray.get(stack["shared_memory"].sync.remote(ray.get(stack["trainer"].weight_version.remote())))
    checksums = grpo_in_step(stack["trainer"], stack["router"], stack["broadcast"], stack["model_path"], steps=2)
    assert len(set(checksums)) == 2  # each step's adapter reached the server, every tensor's sha256 checked there


@pytest.mark.parametrize("transport", ["broadcast", "shared_memory"])
def test_adapter_sync_moves_the_server_with_the_trainer(stack, transport):
    engine = stack["engines"][0]
    before = _generate(stack)
    samples = [Sample(list(PROMPT), c.token_ids, c.logprobs, reward=float(i % 2)) for i, c in
               enumerate(before.completions)]  # fmt: skip
    metrics = ray.get(stack["trainer"].train_step.remote([GroupRef(ray.put(samples), len(samples), 0, 0)]))
    version = metrics["weight_version"]
    report = ray.get(stack[transport].sync.remote(version))  # raises unless the engine's checksum is the trainer's
    assert report["version"] == version and report["checksum"] == ray.get(engine.weights_checksum.remote())
    full_bytes = sum(p.numel() * 4 for p in _base_parameters(stack["model_path"]))
    assert report["bytes"] < full_bytes / 5  # the adapter only
    after = _generate(stack)
    assert after.weight_version == after.first_weight_version == version
    assert _max_diff_to_trainer(stack, after) < 1e-4  # the server computes base + the trained adapter
    assert _max_diff_to_trainer(stack, before) > 1e-3  # which differs from the one before
    deadline = time.time() + 60  # the previous adapter goes once its requests are done (none here)
    while _served_adapters(stack) != {f"tiny-v{version}"}:
        assert time.time() < deadline, _served_adapters(stack)
        time.sleep(0.2)


def test_full_weight_trainer_is_refused_by_a_lora_engine(stack, make_placement):
    """An engine serving adapters only is refused when the broadcaster is built, not at the first sync."""
    trainer = TrainerGroup.remote(TrainerGroupConfig(model_path=stack["model_path"]),
                                  make_placement(placement.colocated(1)))  # fmt: skip
    wb = WeightBroadcaster.remote(
        WeightBroadcasterConfig(transport="shared_memory"), ray.get(trainer.workers.remote()), stack["engines"]
    )
    with pytest.raises(ray.exceptions.ActorDiedError, match=r"engines \[0\] serve LoRA adapters only"):
        ray.get(wb.last_report.remote())
    ray.kill(trainer)


def _base_parameters(path):
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(path).parameters())
