"""The stack builder's checks, made before any actor starts (the end-to-end tests build real stacks with it)."""

import pytest
from pydantic import ValidationError

from miles_ray import placement
from miles_ray.placement.groups import Placement
from miles_ray.stack import StackConfig, build_stack

TRAINER = {"model_path": "m"}
POOL = {"engine": {"model_path": "m"}}


def test_configs_are_cross_checked():
    with pytest.raises(ValidationError, match="trainer.advantage.kind='gae' and critic go together"):
        StackConfig(trainer={**TRAINER, "advantage": {"kind": "gae"}}, pool=POOL)
    with pytest.raises(ValidationError, match="trainer.advantage.kind='gae' and critic go together"):
        StackConfig(trainer=TRAINER, pool=POOL, critic={"model_path": "m"})
    with pytest.raises(ValidationError, match="reference is given but trainer.kl is None"):
        StackConfig(trainer=TRAINER, pool=POOL, reference={"model_path": "m"})
    megatron_kl = {**TRAINER, "backend": {"kind": "megatron"}, "kl": {"coef": 0.1}}
    with pytest.raises(ValidationError, match="keeps no KL reference on its ranks: give reference"):
        StackConfig(trainer=megatron_kl, pool=POOL)
    with pytest.raises(ValidationError, match=r"pool\.engine\n  Value error, engine\.kind must be one of"):
        StackConfig(trainer=TRAINER, pool={"engine": {"kind": "tgi", "model_path": "m"}})
    with pytest.raises(ValidationError, match="detached=True needs name_prefix"):
        StackConfig(trainer=TRAINER, pool=POOL, detached=True)
    with pytest.raises(ValidationError, match=r"health\.interval_s\n  Input should be greater than 0"):
        StackConfig(trainer=TRAINER, pool=POOL, health={"interval_s": 0})
    with pytest.raises(ValidationError, match=r"health\.max_failure\n  Extra inputs are not permitted"):
        StackConfig(trainer=TRAINER, pool=POOL, health={"max_failure": 2})
    config = StackConfig(trainer={**TRAINER, "advantage": {"kind": "gae"}}, pool=POOL, critic={"model_path": "m"})
    assert config.broadcaster is None and config.buffer.max_staleness is None


@pytest.mark.parametrize(
    ("fields", "plan", "message"),
    [
        ({"trainer": {**TRAINER, "num_ranks": 2}}, placement.colocated(1), "trainer.num_ranks=2 .* 1 trainer slots"),
        ({"pool": {**POOL, "num_engines": 3}}, placement.disaggregated(1, 2), "pool.num_engines=3 .* 2 engine slots"),
        (
            {"trainer": {**TRAINER, "advantage": {"kind": "gae"}}, "critic": {"model_path": "m"}},
            placement.colocated(1),
            "critic.num_ranks=1 but the placement plan has 0 critic slots",
        ),
    ],
)
def test_counts_must_fit_the_plan_before_anything_starts(fields, plan, message):
    config = StackConfig(**{"trainer": TRAINER, "pool": POOL, **fields})
    not_created = Placement(plan, pg=None, bundle_order=tuple(range(len(plan.bundles))))  # never reached
    with pytest.raises(ValueError, match=message):
        build_stack(config, not_created)
