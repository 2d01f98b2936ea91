"""MoE routing replay: the engine records each token's experts, the trainer replays exactly those."""

import pytest
import torch

from miles_ray.backends import ObjectiveConfig, OptimizerConfig, TorchBackendConfig
from miles_ray.backends.objectives import GRPOAdvantageConfig, compute_advantages
from miles_ray.backends.rl_step import RLStep, logprobs
from miles_ray.backends.torch_backend import TorchBackend
from miles_ray.backends.torch_parallel import policy_only
from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.types import RolloutBatch, Sample

from .test_torch_backend import process_group  # noqa: F401  (module-scoped gloo group of one)

PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_path(request):
    """The tiny Mixtral (every layer sparse) and the tiny Qwen3-MoE (a dense layer between its two sparse ones)."""
    return request.getfixturevalue("tiny_moe_path" if request.param == "mixtral" else "tiny_qwen3_moe_path")


@pytest.fixture(scope="module")
def rollout(moe_path):
    """Four sampled responses of the tiny MoE (fp32 engine) as samples carrying their routes."""
    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=moe_path, max_batch_size=8, max_seq_len=64))
    request = GenerateRequest(prompt_ids=PROMPT, params=SamplingParams(n=4, max_new_tokens=10, seed=1))
    [out] = engine.generate([request])
    samples = [
        Sample(PROMPT, c.token_ids, c.logprobs, reward=float(i % 2), routes=c.routes)
        for i, c in enumerate(out.completions)
    ]
    return out, samples


def _backend(path, replay: bool, checkpointing=False, lr=1e-2, packing="default", parallel="fsdp2") -> TorchBackend:
    extra = {} if packing == "default" else {"packing": packing}
    cfg = TorchBackendConfig(
        routing_replay=replay, gradient_checkpointing=checkpointing, micro_batch_size=2, parallel=parallel, **extra
    )
    return TorchBackend(cfg, OptimizerConfig(lr=lr), path)


def _capture(backend):
    """The experts each router of the trainer ended up using, per forward (after the replay hook)."""
    used = []
    for router in backend.routes.routers:
        router.register_forward_hook(lambda _m, _a, out: used.append(out[2].clone()))
    return used


def test_engine_records_a_route_for_every_fed_token(rollout):
    out, samples = rollout
    for c in out.completions:
        assert c.routes.dtype == torch.uint8 and c.routes.shape == (len(PROMPT) + len(c.token_ids) - 1, 2, 2)
        assert int(c.routes.max()) < 8
        # prefix sharing: every sample carries the prompt routes of the one prefill
        assert torch.equal(c.routes[: len(PROMPT)], out.completions[0].routes[: len(PROMPT)])
    batch = RolloutBatch.from_samples(samples, pad_id=0)
    assert batch.routes.shape == (4, batch.input_ids.shape[1], 2, 2) and batch.routes.dtype == torch.int16
    for i, s in enumerate(samples):
        n = len(PROMPT) + len(s.response_ids) - 1
        assert torch.equal(batch.routes[i, :n], s.routes.to(torch.int16)) and bool((batch.routes[i, n:] == -1).all())
    assert batch.shard(1, 2).routes.shape[0] == 2


def test_replayed_routes_are_exactly_the_recorded_ones(moe_path, rollout):
    """fp32: trainer logprobs equal the engine's with replay; forced foreign routes are used as given (one padded
    row per sample, so the experts used line up with the batch's routes)."""
    _, samples = rollout
    backend = _backend(moe_path, replay=True, packing=None)
    used = _capture(backend)
    batch = RolloutBatch.from_samples(samples, pad_id=0)
    lp = logprobs(backend, batch, temperature=1.0)
    m = batch.response_mask > 0
    torch.testing.assert_close(lp[m], batch.rollout_logprobs[m], atol=1e-4, rtol=1e-4)
    assert backend.routes.take_mismatch()[0] == 0  # fp32: its own routers agree with the engine's everywhere

    # other experts than the engine chose (each shifted by 3): what the trainer's routers would not pick
    forced = [
        Sample(s.prompt_ids, s.response_ids, s.rollout_logprobs, routes=(s.routes.long() + 3) % 8) for s in samples
    ]
    fbatch = RolloutBatch.from_samples(forced, pad_id=0)
    used.clear()
    shifted = logprobs(backend, fbatch, temperature=1.0)
    assert not torch.allclose(shifted[m], lp[m], atol=1e-3)  # the experts really changed the output
    num_layers = len(backend.routes.routers)
    for mb in range(2):  # micro-batches of 2 samples: one forward each, layers in order
        per_layer = used[mb * num_layers : (mb + 1) * num_layers]
        got = torch.stack(per_layer, dim=1).view(2, fbatch.input_ids.shape[1], num_layers, 2)
        want = fbatch.routes[2 * mb : 2 * mb + 2].long()
        recorded = want[..., 0] >= 0
        assert torch.equal(got[recorded], want[recorded])  # exactly the recorded experts, in recorded order
    differ, recorded_pairs = backend.routes.take_mismatch()
    assert recorded_pairs == int((fbatch.routes[..., 0] >= 0).sum()) and differ > 0.9 * recorded_pairs


def test_packed_forward_replays_the_routes_of_every_packed_token(moe_path, rollout):
    """Packed with a shared prompt: the router sees each token once at its packed position, with its recorded route
    (the prompt's from the one prefill every sample shares), and the logprobs still equal the engine's."""
    from miles_ray.backends.packing import pack_rows

    _, samples = rollout
    backend = _backend(moe_path, replay=True)
    used = _capture(backend)
    forced = [
        Sample(s.prompt_ids, s.response_ids, s.rollout_logprobs, routes=(s.routes.long() + 3) % 8) for s in samples
    ]
    batch = RolloutBatch.from_samples(forced, pad_id=0)
    logprobs(backend, batch, temperature=1.0)
    num_layers = len(backend.routes.routers)
    for mb, rows in enumerate(backend.micro_batches(batch)):  # one forward per micro-batch, layers in order
        packed = pack_rows(batch.select(rows), max_row_tokens=backend.config.packing.max_row_tokens)
        got = torch.stack(used[mb * num_layers : (mb + 1) * num_layers], dim=1)
        want = packed.routes.reshape(-1, num_layers, 2).long()
        recorded = want[..., 0] >= 0
        assert recorded.sum() > 0 and torch.equal(got.view_as(want)[recorded], want[recorded])
    own = _backend(moe_path, replay=True)
    plain = RolloutBatch.from_samples(samples, pad_id=0)
    m = plain.response_mask > 0
    torch.testing.assert_close(logprobs(own, plain, 1.0)[m], plain.rollout_logprobs[m], atol=1e-4, rtol=1e-4)


def test_without_replay_the_trainer_routes_itself_and_counts_the_mismatch(moe_path, rollout):
    _, samples = rollout
    backend = _backend(moe_path, replay=False)
    forced = [
        Sample(s.prompt_ids, s.response_ids, s.rollout_logprobs, routes=(s.routes.long() + 3) % 8) for s in samples
    ]
    own = logprobs(backend, RolloutBatch.from_samples(samples, pad_id=0), temperature=1.0)
    assert backend.routes.take_mismatch()[0] == 0  # fp32: the trainer routes as the engine did
    ignored = logprobs(backend, RolloutBatch.from_samples(forced, pad_id=0), temperature=1.0)
    assert torch.equal(own, ignored)  # routes only observed
    differ, recorded = backend.routes.take_mismatch()
    assert recorded > 0 and differ > 0.9 * recorded


@pytest.mark.parametrize("parallel,checkpointing", [("fsdp2", False), ("fsdp2", True), ("ddp", False)])
def test_train_step_with_replay_trains_the_router(moe_path, rollout, parallel, checkpointing):
    """Replay keeps the trainer's router weights at the replayed experts, so the router still learns."""
    _, samples = rollout
    backend = _backend(moe_path, replay=True, checkpointing=checkpointing, parallel=parallel)
    batch = RolloutBatch.from_samples(samples, pad_id=0)
    batch.advantages = compute_advantages(GRPOAdvantageConfig(), batch.rewards, torch.zeros(4), batch.response_mask)
    router = backend.routes.routers[0].weight
    before = (router.full_tensor() if hasattr(router, "full_tensor") else router).detach().clone()
    metrics = RLStep(backend, ObjectiveConfig()).update(batch)
    after = router.full_tensor() if hasattr(router, "full_tensor") else router
    assert metrics["moe_route_mismatch_frac"] == 0.0 and metrics["train_rollout_logprob_abs_diff_max"] < 1e-4
    assert not torch.equal(before, after.detach())


def test_replay_errors_name_the_cause(tiny_model_path, moe_path, rollout):
    with pytest.raises(ValueError, match="routing replay needs an MoE model"):
        _backend(tiny_model_path, replay=True)
    backend = _backend(moe_path, replay=True)
    _, samples = rollout
    bare = [Sample(s.prompt_ids, s.response_ids, s.rollout_logprobs) for s in samples]
    with pytest.raises(ValueError, match="routing_replay is on but the batch carries no routes"):
        logprobs(backend, RolloutBatch.from_samples(bare, pad_id=0), temperature=1.0)
    wrong = [Sample(s.prompt_ids, s.response_ids, s.rollout_logprobs, routes=s.routes[:, :1]) for s in samples]
    with pytest.raises(ValueError, match="the model has 2 MoE layers with top_k=2"):
        logprobs(backend, RolloutBatch.from_samples(wrong, pad_id=0), temperature=1.0)
    with pytest.raises(ValueError, match="routes must be"):
        Sample([1, 2], [3], [0.0], routes=torch.zeros(5, 2, 2))
    with pytest.raises(ValueError, match="critic.backend.routing_replay must be False"):
        policy_only(TorchBackendConfig(routing_replay=True), "critic")
