"""A low-precision recipe through the real actors: one WeightFormatConfig for the engines and the trainer.

INT4 QAT with TIS, two GRPO steps on a colocated rank and engine: after every sync the engine (computing with
int4-rounded weights) and the trainer (forward through the same rounding) give the same logprobs.
"""

import pytest
import ray
from helpers import grpo_in_step

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
from miles_ray.engines.embedded import EmbeddedEngineConfig
from miles_ray.models.quant import WeightFormatConfig

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
    checksums = grpo_in_step(trainer, router, wb, tiny_model_path)  # int4 engine == trainer's int4 view
    assert len(set(checksums)) == 2
