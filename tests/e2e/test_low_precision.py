"""A low-precision recipe through the real actors: one WeightFormatConfig for the engines and the trainer.

INT4 QAT with TIS, two GRPO steps on a colocated rank and engine: after every sync the engine (computing with
int4-rounded weights) and the trainer (forward through the same rounding) give the same logprobs.
"""

import pytest
import ray
from helpers import ShortResponseTask
from transformers import AutoTokenizer

from miles_ray import placement
from miles_ray.actors import (
    ReplayBuffer,
    ReplayBufferConfig,
    RolloutPool,
    RolloutPoolConfig,
    Router,
    RouterConfig,
    TrainerGroup,
    TrainerGroupConfig,
    WeightBroadcaster,
    WeightBroadcasterConfig,
)
from miles_ray.engines.base import SamplingParams
from miles_ray.engines.embedded import EmbeddedEngineConfig
from miles_ray.models.quant import WeightFormatConfig
from miles_ray.rollout import generate_groups

pytestmark = pytest.mark.e2e


def test_int4_qat_recipe_keeps_engine_and_trainer_in_step(make_placement, tiny_model_path):
    recipe = WeightFormatConfig(format="int4", block=32)
    pl = make_placement(placement.colocated(1))
    config = TrainerGroupConfig(
        model_path=tiny_model_path, optimizer={"lr": 1e-3}, backend={"weight_format": recipe},
        mismatch_correction={"kind": "tis", "cap": 2.0}, old_logprobs="rollout",
    )  # fmt: skip
    trainer = TrainerGroup.remote(config, pl)
    engine = EmbeddedEngineConfig(model_path=tiny_model_path, weight_format=recipe)
    pool = RolloutPool.remote(RolloutPoolConfig(num_engines=1, engine=engine), pl)
    engines = ray.get(pool.engines.remote())
    router = Router.remote(RouterConfig(), engines)
    wb = WeightBroadcaster.remote(WeightBroadcasterConfig(transport="shared_memory"), ray.get(trainer.workers.remote()),
                                  engines)  # fmt: skip
    buffer = ReplayBuffer.remote(ReplayBufferConfig())
    task = ShortResponseTask(AutoTokenizer.from_pretrained(tiny_model_path))
    params = SamplingParams(n=4, max_new_tokens=12, ignore_eos=True)
    checksums = []
    for _ in range(2):
        ray.get(buffer.add.remote(generate_groups(router, task, params, num_prompts=2)))
        refs = ray.get(buffer.get_batch.remote(2))
        samples = [s for g in ray.get([g.ref for g in refs]) for s in g]
        trainer_lp = ray.get(trainer.compute_logprobs.remote(refs))
        diff = max(max(abs(a - b) for a, b in zip(t, s.rollout_logprobs)) for t, s in zip(trainer_lp, samples))
        assert diff < 1e-4
        metrics = ray.get(trainer.train_step.remote(refs))
        assert metrics["grad_norm"] > 0
        checksums.append(ray.get(wb.sync.remote(metrics["weight_version"]))["checksum"])  # verified
    assert len(set(checksums)) == 2
