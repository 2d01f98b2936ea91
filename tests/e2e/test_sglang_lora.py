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
from helpers import grpo_in_step, sglang_stack, sglang_train_and_sync
from helpers import sglang_diff_to_trainer as _max_diff_to_trainer
from helpers import sglang_generate as _generate

from miles_ray import placement
from miles_ray.actors import TrainerGroup, TrainerGroupConfig, WeightBroadcaster, WeightBroadcasterConfig
from miles_ray.engines.sglang import SGLangLoRAConfig

pytestmark = [pytest.mark.e2e, pytest.mark.sglang]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def stack(ray_cluster):
    lora = SGLangLoRAConfig(max_lora_rank=8, target_modules=ALL_LINEAR)
    with sglang_stack(lora=lora, trainer_backend={"lora": {"rank": 4, "alpha": 8, "target_modules": ALL_LINEAR}}) as s:
        yield s


def _served_adapters(stack) -> set[str]:
    auth = {"Authorization": f"Bearer {stack['api_key']}"}  # the server's own random key
    models = requests.get(f"{stack['url']}/v1/models", headers=auth, timeout=30).json()["data"]
    return {m["id"] for m in models} - {"tiny"}


def test_grpo_steps_with_adapters_on_sglang(stack):
    # first, on fresh adapters (B = 0: the server's base weights are the policy until the first sync)
    assert _max_diff_to_trainer(stack, _generate(stack)) < 1e-4
    ray.get(stack["shared_memory"].sync.remote(ray.get(stack["trainer"].weight_version.remote())))
    checksums = grpo_in_step(stack["trainer"], stack["router"], stack["broadcast"], stack["model_path"], steps=2)
    assert len(set(checksums)) == 2  # each step's adapter reached the server, every tensor's sha256 checked there


@pytest.mark.parametrize("transport", ["broadcast", "shared_memory"])
def test_adapter_sync_moves_the_server_with_the_trainer(stack, transport):
    report = sglang_train_and_sync(stack, transport)  # the server computes base + the trained adapter
    full_bytes = sum(p.numel() * 4 for p in _base_parameters(stack["model_path"]))
    assert report["bytes"] < full_bytes / 5  # the adapter only
    version = report["version"]
    deadline = time.time() + 60  # the previous adapter goes once its requests are done (none here)
    while _served_adapters(stack) != {f"tiny-v{version}"}:
        assert time.time() < deadline, _served_adapters(stack)
        time.sleep(0.2)


def test_full_weight_trainer_is_refused_by_a_lora_engine(stack, make_placement):
    """An engine serving adapters only is refused when the broadcaster is built, not at the first sync."""
    pl = make_placement(placement.colocated(1))
    trainer = TrainerGroup.remote(TrainerGroupConfig(model_path=stack["model_path"]), pl)
    wb = WeightBroadcaster.remote(
        WeightBroadcasterConfig(transport="shared_memory"), ray.get(trainer.workers.remote()), stack["engines"]
    )
    with pytest.raises(ray.exceptions.ActorDiedError, match=r"engines \[0\] serve LoRA adapters only"):
        ray.get(wb.last_report.remote())
    ray.kill(trainer)


def _base_parameters(path):
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(path).parameters())
