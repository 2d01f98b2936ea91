"""Packed micro-batches: the layout itself, and the same losses and gradients as one padded row per sample."""

import pytest
import torch

from miles_ray.backends import ObjectiveConfig, OptimizerConfig, TorchBackendConfig
from miles_ray.backends.objectives import GRPOAdvantageConfig, KLConfig, compute_advantages
from miles_ray.backends.packing import pack_rows, plan_micro_batches, segments
from miles_ray.backends.rl_step import RLStep, logprobs
from miles_ray.backends.torch_backend import TorchBackend
from miles_ray.types import RolloutBatch, Sample

from .test_torch_backend import process_group  # noqa: F401  (module-scoped gloo group of one)


def _grouped_batch(num_groups=2, group_size=4, seed=0) -> RolloutBatch:
    """``num_groups`` prompts with ``group_size`` responses each (GRPO), plus one sample whose prompt is its own."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for k in range(num_groups):
        prompt = torch.randint(10, 500, (5 + 2 * k,), generator=g).tolist()
        for i in range(group_size):
            resp = torch.randint(10, 500, (2 + (i + k) % 4,), generator=g).tolist()
            samples.append(Sample(prompt, resp, [-2.0] * len(resp), reward=float(i % 2), group_id=k))
    samples.append(Sample([3, 4, 5], [6, 7], [-2.0, -2.0], reward=1.0, group_id=num_groups))
    batch = RolloutBatch.from_samples(samples, pad_id=0)
    group_ids = torch.tensor([s.group_id for s in samples])
    batch.advantages = compute_advantages(GRPOAdvantageConfig(), batch.rewards, group_ids, batch.response_mask)
    return batch


def test_layout_of_a_shared_prefix_segment():
    samples = [Sample([1, 2, 3], [4, 5], [0.0, 0.0]), Sample([1, 2, 3], [6], [0.0]), Sample([9, 8], [7], [0.0])]
    batch = RolloutBatch.from_samples(samples, pad_id=0)
    assert [s.samples for s in segments(batch, share_prefix=True)] == [(0, 1), (2,)]
    packed = pack_rows(batch, share_prefix=True)  # a segment per row
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [9, 8, 7, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 0, 0, 0]]
    allowed = packed.attention[0, 0].int().tolist()
    assert allowed[4] == [1, 1, 1, 1, 1, 0]  # the second token of response 0 sees the prompt and its own response
    assert allowed[5] == [1, 1, 1, 0, 0, 1]  # response 1 sees the prompt and itself, never response 0
    assert packed.attention[1, 0, 4].int().tolist() == [0, 0, 0, 0, 1, 0]  # padding: itself alone
    # logprob position t predicts token t+1: the prompt's last token (col 2) predicts both first response tokens
    width = packed.input_ids.shape[1]
    assert packed.source[0].tolist() == [-1, -1, 2, 3] and packed.source[1].tolist() == [-1, -1, 2, -1]
    assert packed.source[2].tolist() == [-1, width + 1, -1, -1]
    assert packed.num_tokens == 9 < int(batch.attention_mask.sum())  # the prompt once: 9 tokens, not 12
    one_row = pack_rows(batch, share_prefix=False, max_row_tokens=100)
    assert one_row.input_ids.shape == (1, 12) and one_row.position_ids[0].tolist()[5:10] == [0, 1, 2, 3, 0]


def test_micro_batches_keep_segments_whole_within_the_bounds_and_cut_larger_ones():
    batch = _grouped_batch(num_groups=3, group_size=4)  # segments of 4, 4, 4 samples and a single one
    plans = plan_micro_batches(batch, max_samples=6)
    assert [p.tolist() for p in plans] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12]]
    tokens = [s.num_tokens for s in segments(batch, share_prefix=True)]
    plans = plan_micro_batches(batch, max_samples=64, max_tokens=tokens[0] + tokens[1])
    assert [len(p) for p in plans] == [8, 5]
    # a segment over a bound is cut into pieces within it (each keeps its prompt): the bounds hold memory
    assert [p.tolist() for p in plan_micro_batches(batch, max_samples=3)] == [
        [0, 1, 2],
        [3],
        [4, 5, 6],
        [7],
        [8, 9, 10],
        [11, 12],
    ]
    assert [len(p) for p in plan_micro_batches(batch, max_samples=2, share_prefix=False)] == [2] * 6 + [1]
    budget = tokens[0] // 2  # under one segment: each micro-batch's packed tokens stay within it
    plans = plan_micro_batches(batch, max_samples=64, max_tokens=budget)
    assert sorted(r for p in plans for r in p.tolist()) == list(range(13)) and len(plans) > 4
    for plan in plans:
        packed = sum(s.num_tokens for s in segments(batch.select(plan), share_prefix=True))
        assert packed <= budget or len(plan) == 1


def _grads_and_metrics(config: TorchBackendConfig, batch: RolloutBatch, path: str, **objective):
    """One RL step; the gradients just before the optimizer step, and the step's metrics."""
    torch.manual_seed(0)
    backend = TorchBackend(config, OptimizerConfig(lr=1e-3), path, reference="kl" in objective)
    grads = {}
    step = backend.clip_and_step

    def capture(loss_sum=0.0):  # what the optimizer is about to apply, then the real step
        for name, p in backend.hf_model.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[name] = g.detach().clone()
        return step(loss_sum)

    backend.clip_and_step = capture
    metrics = RLStep(backend, ObjectiveConfig(**objective)).update(batch)
    return grads, metrics


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
@pytest.mark.parametrize(
    "variant",
    [{}, {"kl": KLConfig(coef=0.5)}, {"lora": True}, {"checkpointing": True}, {"micro_batch_size": 3}],
    ids=["plain", "kl_loss", "lora", "checkpointing", "groups_cut_by_micro_batches"],
)
def test_shared_prefix_training_equals_padded_training(tiny_model_path, parallel, variant):
    """fp32: loss, metrics and every parameter's gradient of the shared-prefix step equal the padded step's."""
    batch = _grouped_batch()
    common = {
        "parallel": parallel,
        "micro_batch_size": variant.get("micro_batch_size", 16),  # 3: each group of 4 spans two micro-batches
        "gradient_checkpointing": variant.get("checkpointing", False),
    }
    if variant.get("lora"):
        common["lora"] = {"rank": 4, "alpha": 8}
    objective = {"kl": variant["kl"]} if "kl" in variant else {}
    padded = _grads_and_metrics(TorchBackendConfig(packing=None, **common), batch, tiny_model_path, **objective)
    shared = _grads_and_metrics(TorchBackendConfig(**common), batch, tiny_model_path, **objective)
    (g_pad, m_pad), (g_shr, m_shr) = padded, shared
    assert m_pad["num_tokens"] == m_shr["num_tokens"] and m_pad["grad_norm"] > 0
    for key in ("loss", "grad_norm", "entropy", "train_rollout_logprob_abs_diff_mean", "clipfrac", "ref_kl"):
        assert m_shr[key] == pytest.approx(m_pad[key], rel=1e-5, abs=1e-7), key
    assert set(g_pad) == set(g_shr) and g_pad
    scale = max(g.abs().max().item() for g in g_pad.values())
    for name in g_pad:  # fp32 summation order differs: within 1e-5 of the largest gradient entry
        torch.testing.assert_close(g_shr[name], g_pad[name], atol=1e-5 * scale, rtol=1e-4, msg=name)


def test_packed_rows_equal_padded_logprobs_and_critic_values(tiny_model_path):
    """Several segments per row (block-diagonal) and a segment per row give the padded logprobs and values."""
    from miles_ray.backends.critic import TorchCriticBackend
    from miles_ray.backends.rl_step import critic_values

    batch = _grouped_batch(num_groups=3)
    m = batch.response_mask > 0
    results = {}
    for name, packing in [("padded", None), ("segment rows", {}), ("packed rows", {"max_row_tokens": 64})]:
        config = TorchBackendConfig(parallel="ddp", packing=packing)
        torch.manual_seed(0)
        policy = TorchBackend(config, OptimizerConfig(), tiny_model_path)
        critic = TorchCriticBackend(config, OptimizerConfig(), tiny_model_path)
        with torch.no_grad():  # a non-zero value head, so that values depend on the states
            critic.hf_model.value_head.weight.normal_(generator=torch.Generator().manual_seed(1))
        results[name] = (logprobs(policy, batch, 1.0)[m], critic_values(critic, batch)[m])
    for name in ("segment rows", "packed rows"):
        torch.testing.assert_close(results[name][0], results["padded"][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(results[name][1], results["padded"][1], atol=1e-5, rtol=1e-5)


def test_shared_prefix_training_with_routing_replay_equals_padded(tiny_moe_path):
    """MoE with replay: the packed step routes every token through its recorded experts, as the padded one does."""
    from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from miles_ray.engines.requests import GenerateRequest, SamplingParams

    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=tiny_moe_path, max_batch_size=8, max_seq_len=64))
    prompts = [[5, 17, 42, 99, 7], [11, 12, 13]]
    outs = engine.generate([GenerateRequest(p, SamplingParams(n=3, max_new_tokens=6, seed=1)) for p in prompts])
    samples = [
        Sample(p, c.token_ids, c.logprobs, reward=float(i % 2), group_id=k, routes=c.routes)
        for k, (p, out) in enumerate(zip(prompts, outs))
        for i, c in enumerate(out.completions)
    ]
    batch = RolloutBatch.from_samples(samples, pad_id=0)
    group_ids = torch.tensor([s.group_id for s in samples])
    batch.advantages = compute_advantages(GRPOAdvantageConfig(), batch.rewards, group_ids, batch.response_mask)
    common = {"parallel": "ddp", "micro_batch_size": 16, "routing_replay": True}
    g_pad, m_pad = _grads_and_metrics(TorchBackendConfig(packing=None, **common), batch, tiny_moe_path)
    g_shr, m_shr = _grads_and_metrics(TorchBackendConfig(**common), batch, tiny_moe_path)
    assert m_shr["moe_route_mismatch_frac"] == m_pad["moe_route_mismatch_frac"] == 0.0
    assert m_shr["loss"] == pytest.approx(m_pad["loss"], rel=1e-5, abs=1e-7)
    assert m_shr["train_rollout_logprob_abs_diff_max"] < 1e-4  # the engine's logprobs (fp32, replayed routes)
    scale = max(g.abs().max().item() for g in g_pad.values())
    for name in g_pad:
        torch.testing.assert_close(g_shr[name], g_pad[name], atol=1e-5 * scale, rtol=1e-4, msg=name)
