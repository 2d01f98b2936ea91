"""PPO through real actors: a CriticGroup and a ReferenceGroup beside a two-rank TrainerGroup (real Ray, tiny model)."""

import pytest
import ray

from miles_ray import placement
from miles_ray.actors import (
    CriticGroup,
    CriticGroupConfig,
    ReferenceGroup,
    ReferenceGroupConfig,
    TrainerGroup,
    TrainerGroupConfig,
)
from miles_ray.types import GroupRef, Sample

pytestmark = pytest.mark.e2e


def _groups():
    samples = [
        Sample([1, 2, 3 + i], [4 + i, 5, 6, 7][: 2 + i % 3], [-1.0] * (2 + i % 3), reward=float(i % 2), group_id=i)
        for i in range(4)
    ]
    return [GroupRef(ray.put(samples[:2]), 2, 0, 0), GroupRef(ray.put(samples[2:]), 2, 0, 1)]


def _trainer_config(model_path, **kw):
    advantage, kl = {"kind": "gae", "lam": 0.9}, {"coef": 0.1, "estimator": "k3"}
    return TrainerGroupConfig(
        model_path=model_path, num_ranks=2, optimizer={"lr": 1e-2}, advantage=advantage, kl=kl, **kw
    )


def test_ppo_with_critic_and_reference_actors(make_placement, tiny_model_path):
    """Values start at 0 and learn the returns; reference KL is 0 at step 1; the reference actor gives the same
    updates as the on-rank reference copy (same seed, same data)."""
    pl = make_placement(placement.colocated(2, critic=True, reference=True))
    critic_cfg = CriticGroupConfig(model_path=tiny_model_path, num_ranks=2, optimizer={"lr": 1e-3})
    groups = _groups()
    runs = {}
    for name, use_actor in (("actor", True), ("on_rank", False)):
        critic = CriticGroup.remote(critic_cfg, pl)
        reference = None
        if use_actor:
            reference = ReferenceGroup.remote(ReferenceGroupConfig(model_path=tiny_model_path, num_ranks=2), pl)
        if name == "actor":
            values = ray.get(critic.compute_values.remote(groups))
            assert [len(v) for v in values] == [2, 3, 4, 2] and all(x == 0.0 for v in values for x in v)
        trainer = TrainerGroup.remote(_trainer_config(tiny_model_path), pl, critic=critic, reference=reference)
        runs[name] = [ray.get(trainer.train_step.remote(groups)) for _ in range(4)]
        runs[name].append(ray.get(trainer.compute_logprobs.remote(groups)))
        for handle in (trainer, critic, reference):
            if handle is not None:
                ray.kill(handle)
    steps = runs["actor"]
    assert steps[0]["ref_kl"] == pytest.approx(0.0, abs=1e-7) and steps[1]["ref_kl"] > 0
    assert steps[0]["critic/value_clipfrac"] == 0.0 and steps[0]["critic/num_tokens"] == 11
    assert steps[-2]["critic/value_loss"] < steps[0]["critic/value_loss"]  # the critic fits the returns
    assert steps[0]["advantage_abs_mean"] > 0
    for a, b in zip(runs["actor"][:4], runs["on_rank"][:4]):
        assert a["ref_kl"] == pytest.approx(b["ref_kl"], rel=1e-5, abs=1e-9)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-9)
        assert a["critic/value_loss"] == pytest.approx(b["critic/value_loss"], rel=1e-5)
    for lp_a, lp_b in zip(runs["actor"][-1], runs["on_rank"][-1]):
        assert lp_a == pytest.approx(lp_b, abs=1e-5)


def test_ppo_wiring_errors_name_what_is_missing(make_placement, tiny_model_path):
    pl = make_placement(placement.colocated(1))
    cfg = _trainer_config(tiny_model_path).model_copy(update={"num_ranks": 1})
    with pytest.raises(ray.exceptions.RayActorError, match="advantage.kind='gae' and a critic go together"):
        ray.get(TrainerGroup.remote(cfg, pl).weight_version.remote())
    with pytest.raises(ray.exceptions.RayActorError, match="0 critic slots .*critic=True"):
        ray.get(CriticGroup.remote(CriticGroupConfig(model_path=tiny_model_path), pl).compute_values.remote([]))
    plain = TrainerGroupConfig(model_path=tiny_model_path)
    with pytest.raises(ray.exceptions.RayActorError, match="TrainerGroupConfig.kl is None"):
        ray.get(TrainerGroup.remote(plain, pl, reference=object()).weight_version.remote())
