"""An MoE policy through the real actors: routes recorded by the engines, replayed by the trainer, experts synced.

Two GRPO steps on the tiny Mixtral, two trainer ranks (FSDP2) and two engines, disaggregated (gloo broadcast):
every sample carries its routes, the trainer replays them (its logprobs equal the engines' in fp32), the router
and expert tensors sync to both engines and are verified by checksum.
"""

import pytest
import ray
from helpers import grpo_in_step, tiny_stack

from miles_ray import placement
from miles_ray.engines.requests import SamplingParams
from miles_ray.stack import StackConfig, build_stack

pytestmark = pytest.mark.e2e


def test_grpo_on_moe_with_routing_replay(make_placement, tiny_moe_path):
    pl = make_placement(placement.disaggregated(2, 2))
    backend = {"routing_replay": True, "micro_batch_size": 2}
    config = StackConfig(
        trainer={"model_path": tiny_moe_path, "num_ranks": 2, "optimizer": {"lr": 1e-2}, "backend": backend},
        pool={"num_engines": 2, "engine": {"model_path": tiny_moe_path, "max_seq_len": 128}},
        broadcaster={"transport": "broadcast"},
    )
    stack = build_stack(config, pl)

    def check(samples, metrics):  # prompt + all response tokens but the last were fed to the model
        assert all(s.routes.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, 2, 2) for s in samples)
        assert metrics["moe_route_mismatch_frac"] == 0.0  # replayed (and fp32: its own routers agree)

    checksums = grpo_in_step(stack.trainer, stack.router, stack.broadcaster, tiny_moe_path, check=check)
    assert len(set(checksums)) == 2  # the checksums cover every parameter: routers and fused experts included


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_routes_after_abort_resume_belong_to_the_new_weights(make_placement, family, request):
    """A sync lands mid-generation (``abort_resume``): the continuation re-prefills the whole sequence on the new
    weights, so its routes cover every fed token and, replayed, give the trainer the engine's tail logprobs.
    Qwen3-MoE: q/k norms, an untied head and a dense layer between its two MoE layers, synced and replayed alike."""
    tiny_moe_path = request.getfixturevalue("tiny_moe_path" if family == "mixtral" else "tiny_qwen3_moe_path")
    import torch
    from helpers import wait_until_decoding

    from miles_ray.engines.requests import GenerateRequest
    from miles_ray.types import GroupRef, Sample

    pl = make_placement(placement.colocated(1))
    trainer = {"optimizer": {"lr": 1e-2}, "backend": {"routing_replay": True}}
    broadcaster = {"transport": "shared_memory", "in_flight": "abort_resume"}
    stack = tiny_stack(pl, tiny_moe_path, trainer=trainer, broadcaster=broadcaster)
    trainer, engines, wb = stack.trainer, stack.engines, stack.broadcaster
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
