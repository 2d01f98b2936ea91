"""An MoE policy through the real actors: routes recorded by the engines, replayed by the trainer, experts synced.

Two GRPO steps on the tiny Mixtral, two trainer ranks (FSDP2) and two engines, disaggregated (gloo broadcast):
every sample carries its routes, the trainer replays them (its logprobs equal the engines' in fp32), the router
and expert tensors sync to both engines and are verified by checksum.
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
from miles_ray.engines.base import SamplingParams
from miles_ray.engines.embedded import EmbeddedEngineConfig

pytestmark = pytest.mark.e2e


def test_grpo_on_moe_with_routing_replay(make_placement, tiny_moe_path):
    pl = make_placement(placement.disaggregated(2, 2))
    config = TrainerGroupConfig(model_path=tiny_moe_path, num_ranks=2, optimizer={"lr": 1e-2},
                                backend={"routing_replay": True, "micro_batch_size": 2})  # fmt: skip
    trainer = TrainerGroup.remote(config, pl)
    engine = EmbeddedEngineConfig(model_path=tiny_moe_path, max_seq_len=128)
    pool = RolloutPool.remote(RolloutPoolConfig(num_engines=2, engine=engine), pl)
    engines = ray.get(pool.engines.remote())
    router = Router.remote(RouterConfig(), engines)
    wb = WeightBroadcaster.remote(WeightBroadcasterConfig(transport="broadcast"), ray.get(trainer.workers.remote()),
                                  engines)  # fmt: skip

    def check(samples, metrics):  # prompt + all response tokens but the last were fed to the model
        assert all(s.routes.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, 2, 2) for s in samples)
        assert metrics["moe_route_mismatch_frac"] == 0.0  # replayed (and fp32: its own routers agree)

    checksums = grpo_in_step(trainer, router, wb, tiny_moe_path, check=check)
    assert len(set(checksums)) == 2  # the checksums cover every parameter: routers and fused experts included


def test_routes_after_abort_resume_belong_to_the_new_weights(make_placement, tiny_moe_path):
    """A sync lands mid-generation (``abort_resume``): the continuation re-prefills the whole sequence on the new
    weights, so its routes cover every fed token and, replayed, give the trainer the engine's tail logprobs."""
    import torch
    from helpers import engines_and_router, wait_until_decoding

    from miles_ray.actors.replay_buffer import GroupRef
    from miles_ray.engines.base import GenerateRequest
    from miles_ray.types import Sample

    pl = make_placement(placement.colocated(1))
    config = TrainerGroupConfig(model_path=tiny_moe_path, optimizer={"lr": 1e-2}, backend={"routing_replay": True})
    trainer = TrainerGroup.remote(config, pl)
    pool, engines, _ = engines_and_router(pl, tiny_moe_path, 1)
    cfg = WeightBroadcasterConfig(transport="shared_memory", in_flight="abort_resume")
    wb = WeightBroadcaster.remote(cfg, ray.get(trainer.workers.remote()), engines)
    ray.get(wb.sync.remote(0))
    # one step so version 1 differs; these samples recorded no route (an empty one), so the trainer routes itself
    step = [Sample([1, 2, 3], [4 + i, 5], [-1.0, -1.0], reward=float(i), routes=torch.empty(0, 2, 2)) for i in range(4)]
    ray.get(trainer.train_step.remote([GroupRef(ray.put(step), 4, 0, 0)]))
    long = 400
    params = SamplingParams(n=2, max_new_tokens=long, ignore_eos=True, seed=3)
    running = engines[0].generate.remote(GenerateRequest([1, 2, 3], params, request_id="r0"))
    wait_until_decoding(engines[0])
    ray.get(wb.sync.remote(1))
    out = ray.get(running)
    assert out.weight_version == 1 and all(len(c.token_ids) == long for c in out.completions)
    samples = [Sample([1, 2, 3], c.token_ids, c.logprobs, routes=c.routes) for c in out.completions]
    assert all(s.routes.shape == (3 + long - 1, 2, 2) for s in samples)
    trained = ray.get(trainer.compute_logprobs.remote([GroupRef(ray.put(samples), len(samples), 1, 0)]))
    for s, lp in zip(samples, trained):
        diffs = [abs(a - b) for a, b in zip(s.rollout_logprobs, lp)]
        cut = next(k for k in range(len(diffs)) if max(diffs[k:]) < 1e-4)
        assert 0 < cut < long and max(diffs[:cut]) > 1e-3  # the tail matches; the prefix came from version 0
