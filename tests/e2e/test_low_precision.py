"""A low-precision recipe through the real actors: one WeightFormatConfig for the engines and the trainer.

INT4 QAT with TIS, two GRPO steps on a colocated rank and engine: after every sync the engine (computing with
int4-rounded weights) and the trainer (forward through the same rounding) give the same logprobs.
"""

import pytest
from helpers import grpo_in_step

from miles_ray import placement
from miles_ray.models.quant import WeightFormatConfig
from miles_ray.stack import StackConfig, build_stack

pytestmark = pytest.mark.e2e


def test_int4_qat_recipe_keeps_engine_and_trainer_in_step(make_placement, tiny_model_path):
    recipe = WeightFormatConfig(format="int4", block=32)
    trainer = {
        "model_path": tiny_model_path,
        "optimizer": {"lr": 1e-3},
        "backend": {"weight_format": recipe},
        "mismatch_correction": {"kind": "tis", "cap": 2.0},
        "old_logprobs": "rollout",
    }
    pool = {"engine": {"model_path": tiny_model_path, "weight_format": recipe}}  # one recipe for both sides
    stack = build_stack(StackConfig(trainer=trainer, pool=pool), make_placement(placement.colocated(1)))
    checksums = grpo_in_step(stack.trainer, stack.router, stack.broadcaster, tiny_model_path)  # int4 == int4 view
    assert len(set(checksums)) == 2
