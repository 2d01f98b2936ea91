"""The torch backend under the RL step, in-process (world size 1, gloo): objectives, micro-batch invariance."""

import os
import socket

import pytest
import torch
import torch.distributed as dist

from miles_ray.backends import OptimizerConfig, TorchBackendConfig, compute_advantages
from miles_ray.backends.objectives import (
    GRPOAdvantageConfig,
    GSPOLossConfig,
    ObjectiveConfig,
    PPOClipLossConfig,
    ReinforcePPAdvantageConfig,
    RLOOAdvantageConfig,
)
from miles_ray.backends.rl_step import RLStep, logprobs
from miles_ray.backends.torch_backend import TorchBackend
from miles_ray.backends.torch_parallel import FRESH_OPTIMIZER
from miles_ray.types import RolloutBatch, Sample


@pytest.fixture(scope="module", autouse=True)
def process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _batch(advantage_cfg) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(8):
        prompt = torch.randint(10, 500, (3 + i % 3,), generator=g).tolist()
        resp = torch.randint(10, 500, (2 + i % 4,), generator=g).tolist()
        samples.append(Sample(prompt, resp, [-20.0] * len(resp), reward=float(i % 3), group_id=i // 4))
    batch = RolloutBatch.from_samples(samples, pad_id=0)
    batch.advantages = compute_advantages(
        advantage_cfg, batch.rewards, torch.tensor([s.group_id for s in samples]), batch.response_mask
    )
    return batch


def _step(backend, loss=None, **objective) -> RLStep:
    """The RL step over ``backend`` with ``loss`` (PPO-clip by default) and more objective fields."""
    return RLStep(backend, ObjectiveConfig(loss=loss or PPOClipLossConfig(), **objective))


def _params(backend):
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in backend.hf_model.parameters()]  # FSDP2
    return torch.cat([p.detach().reshape(-1) for p in full])


@pytest.mark.parametrize("parallel", ["fsdp2", "ddp"])
@pytest.mark.parametrize(
    "loss", [PPOClipLossConfig(), PPOClipLossConfig(aggregation="seq_mean_token_sum"), GSPOLossConfig()]
)
def test_micro_batching_does_not_change_the_update(tiny_model_path, parallel, loss):
    """Same seed, same data: 1 micro-batch of 8 and 4 micro-batches of 2 give the same loss and weights."""
    results = []
    for mbs in (8, 2):
        torch.manual_seed(0)
        config = TorchBackendConfig(parallel=parallel, micro_batch_size=mbs)
        backend = TorchBackend(config, OptimizerConfig(lr=1e-3), tiny_model_path)
        before = _params(backend)
        metrics = _step(backend, loss).update(_batch(GRPOAdvantageConfig()))
        results.append((metrics, _params(backend) - before))
    (m1, d1), (m2, d2) = results
    assert m1["grad_norm"] > 0 and d1.abs().max() > 0
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
    # Adam's first step is ~lr * sign(grad): 1e-5 is 1% of a step, and a wrong normalisation moves whole steps
    torch.testing.assert_close(d1, d2, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize(
    "advantage", [GRPOAdvantageConfig(normalize_std=False), RLOOAdvantageConfig(), ReinforcePPAdvantageConfig()]
)
def test_every_advantage_estimator_trains(tiny_model_path, advantage):
    backend = TorchBackend(TorchBackendConfig(), OptimizerConfig(lr=1e-3), tiny_model_path)
    metrics = _step(backend).update(_batch(advantage))
    assert metrics["grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert "clipfrac" in metrics and metrics["num_tokens"] == float(_batch(advantage).response_mask.sum())


def test_logprobs_match_a_plain_hf_forward(tiny_model_path):
    from transformers import AutoModelForCausalLM

    backend = TorchBackend(TorchBackendConfig(parallel="ddp"), OptimizerConfig(), tiny_model_path)
    batch = _batch(GRPOAdvantageConfig())
    ours = logprobs(backend, batch, temperature=0.7)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1] / 0.7
    ref = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    m = batch.response_mask > 0
    torch.testing.assert_close(ours[m], ref[m], atol=1e-5, rtol=1e-5)


def test_autocast_auto_follows_native_bf16(tiny_model_path):
    """'auto' is bf16 autocast exactly where the CPU computes bf16 natively; 'bfloat16' always is (logprobs move)."""
    from miles_ray.devices import native_bf16

    caps = torch.cpu.get_capabilities()
    assert native_bf16(torch.device("cpu")) == bool(caps["avx512_bf16"] or caps["amx_bf16"])
    batch = _batch(GRPOAdvantageConfig())
    out = {}
    for mode in ("none", "bfloat16", "auto"):
        backend = TorchBackend(TorchBackendConfig(parallel="ddp", autocast=mode), OptimizerConfig(), tiny_model_path)
        out[mode] = (backend.autocast, logprobs(backend, batch, temperature=1.0))
    assert out["none"][0] is False and out["bfloat16"][0] is True
    assert out["auto"][0] is native_bf16(torch.device("cpu"))
    m = batch.response_mask > 0
    assert (out["none"][1][m] - out["bfloat16"][1][m]).abs().max() > 1e-4  # bf16 matmuls round
    torch.testing.assert_close(out["auto"][1], out["bfloat16" if out["auto"][0] else "none"][1])
    with pytest.raises(ValueError, match="autocast"):
        TorchBackendConfig(autocast="fp16")


def test_tis_weights_and_entropy_bonus_change_the_update(tiny_model_path):
    """TIS reweights tokens by min(exp(train - rollout), cap); the entropy bonus adds its own gradient."""
    from miles_ray.backends.objectives import MismatchCorrectionConfig

    def update(**objective):
        torch.manual_seed(0)
        backend = TorchBackend(TorchBackendConfig(), OptimizerConfig(lr=1e-3), tiny_model_path)
        before = _params(backend)
        metrics = _step(backend, **objective).update(_batch(GRPOAdvantageConfig()))
        return metrics, _params(backend) - before

    base_m, base = update()
    # rollout logprobs are -20, far below the random model's ~-10.8: every ratio exceeds the cap of 2
    tis_m, tis = update(mismatch_correction=MismatchCorrectionConfig(kind="tis", cap=2.0))
    assert tis_m["is_weight_clipped_frac"] == 1.0 and base_m["is_weight_clipped_frac"] == 0.0
    assert tis_m["loss"] == pytest.approx(2.0 * base_m["loss"], rel=1e-5)  # every token weighted by the cap
    mis_m, mis = update(mismatch_correction=MismatchCorrectionConfig(kind="mis", cap=2.0))
    assert mis_m["loss"] == 0.0 and mis.abs().max() == 0  # every token dropped: no update at all
    ent_m, ent = update(entropy_coef=0.1)
    assert ent_m["entropy"] == pytest.approx(base_m["entropy"]) and ent_m["entropy"] > 0
    assert not torch.allclose(ent, base)
    with pytest.raises(ValueError, match="mismatch_correction needs loss.kind='ppo_clip'"):
        ObjectiveConfig(loss=GSPOLossConfig(), mismatch_correction=MismatchCorrectionConfig())


def test_custom_loss_extension_point(tiny_model_path):
    """A loss given by import path runs through the same path as the built-in one: same loss, same update."""
    from miles_ray.backends.objectives import CustomLossConfig

    def update(loss_config):
        torch.manual_seed(0)
        backend = TorchBackend(TorchBackendConfig(), OptimizerConfig(lr=1e-3), tiny_model_path)
        before = _params(backend)
        metrics = _step(backend, loss_config).update(_batch(GRPOAdvantageConfig()))
        return metrics, _params(backend) - before

    builtin_m, builtin = update(PPOClipLossConfig(clip_high=0.28))
    custom_m, custom = update(
        CustomLossConfig(fn="miles_ray.algo.losses:ppo_clip_loss", kwargs={"clip_low": 0.2, "clip_high": 0.28})
    )
    assert custom_m["loss"] == pytest.approx(builtin_m["loss"], rel=1e-6)
    torch.testing.assert_close(custom, builtin)
    with pytest.raises(ValueError, match="loss.fn 'nope:fn' cannot be imported"):
        CustomLossConfig(fn="nope:fn")
    with pytest.raises(TypeError, match=r"must return \(scalar tensor, dict of floats\)"):
        update(CustomLossConfig(fn=lambda lp, old, adv, mask: lp.sum()))


@pytest.mark.parametrize("parallel", ["fsdp2", "ddp"])
def test_kl_to_reference_as_loss(tiny_model_path, parallel):
    """Step 1: policy == reference, so KL and its gradient are 0 (same update as no KL); step 2 they are not."""
    from miles_ray.backends.objectives import KLConfig

    def two_steps(kl):
        torch.manual_seed(0)
        config = TorchBackendConfig(parallel=parallel)
        backend = TorchBackend(config, OptimizerConfig(lr=1e-2), tiny_model_path, reference=kl is not None)
        step = _step(backend, kl=kl)
        updates, metrics = [], []
        for _ in range(2):
            before = _params(backend)
            metrics.append(step.update(_batch(GRPOAdvantageConfig())))
            updates.append(_params(backend) - before)
        return step, updates, metrics

    _, plain, _ = two_steps(None)
    step, with_kl, m = two_steps(KLConfig(coef=1.0, estimator="k3"))
    backend = step.backend
    assert m[0]["ref_kl"] == pytest.approx(0.0, abs=1e-7) and m[1]["ref_kl"] > 0
    torch.testing.assert_close(with_kl[0], plain[0])
    assert not torch.allclose(with_kl[1], plain[1])
    batch = _batch(GRPOAdvantageConfig())
    tok = step.token_kl(batch)  # policy moved, reference did not
    assert tok.shape == batch.response_mask.shape and tok.abs().sum() > 0
    assert (tok[batch.response_mask == 0] == 0).all()
    ref = logprobs(backend.reference, batch, 1.0)
    assert not torch.allclose(ref, logprobs(backend, batch, 1.0))


def test_reference_logprobs_passed_in_equal_the_on_rank_reference(tiny_model_path):
    """A ReferenceGroup's logprobs (here a frozen PolicyModel) give the same KL updates as the on-rank copy."""
    from miles_ray.backends.objectives import KLConfig
    from miles_ray.backends.torch_backend import PolicyModel

    cfg, kl = TorchBackendConfig(micro_batch_size=4), KLConfig(coef=1.0, estimator="k3")
    frozen = PolicyModel(cfg, None, tiny_model_path)
    assert all(not p.requires_grad for p in frozen.hf_model.parameters()) and frozen.optimizer is None
    runs = []
    for local in (True, False):
        torch.manual_seed(0)
        backend = TorchBackend(cfg, OptimizerConfig(lr=1e-2), tiny_model_path, reference=local)
        step = _step(backend, kl=kl)
        assert (backend.reference is not None) == local
        out = []
        for _ in range(2):
            batch = _batch(GRPOAdvantageConfig())
            ref = None if local else logprobs(frozen, batch, 1.0)
            out.append(step.update(batch, ref_logprobs=ref)["ref_kl"])
        out.append(_params(backend))
        runs.append(out)
    assert runs[0][1] > 0 and runs[0][1] == pytest.approx(runs[1][1], rel=1e-6)
    torch.testing.assert_close(runs[0][2], runs[1][2])


@pytest.mark.parametrize("parallel", ["fsdp2", "ddp"])  # DDP: parameters in one buffer (flat_params)
def test_compiled_layers_give_the_eager_step(tiny_model_path, parallel):
    """backend.compile: torch.compile of every decoder layer; the same loss, gradient norm and update as eager."""
    runs = []
    for compile_ in (False, True):
        torch.manual_seed(0)
        config = TorchBackendConfig(compile=compile_, parallel=parallel)
        backend = TorchBackend(config, OptimizerConfig(lr=1e-3), tiny_model_path)
        before = _params(backend)
        metrics = _step(backend).update(_batch(GRPOAdvantageConfig()))
        runs.append((metrics, _params(backend) - before))
    (eager, d_eager), (compiled, d_compiled) = runs
    assert compiled["loss"] == pytest.approx(eager["loss"], abs=1e-6)
    assert compiled["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-4)
    # Adam's first update is lr * g / (|g| + eps): where |g| is near eps (1e-8) the fp32 rounding that compiled
    # kernels change moves it by a few percent of lr, so the bound is relative to lr (1e-3), not absolute
    torch.testing.assert_close(d_compiled, d_eager, atol=5e-5, rtol=1e-3)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_qwen3_families_under_fsdp2_and_ddp(family, request):
    """Qwen3 and Qwen3-MoE through HF: packed logprobs equal a plain HF forward; FSDP2 and DDP take the same step."""
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue("tiny_qwen3_path" if family == "qwen3" else "tiny_qwen3_moe_path")
    batch = _batch(GRPOAdvantageConfig())
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    ref = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    m = batch.response_mask > 0
    steps = {}
    for parallel in ("fsdp2", "ddp"):
        torch.manual_seed(0)
        config = TorchBackendConfig(parallel=parallel, micro_batch_size=4)
        backend = TorchBackend(config, OptimizerConfig(lr=1e-3), path)
        torch.testing.assert_close(logprobs(backend, batch, temperature=1.0)[m], ref[m], atol=1e-5, rtol=1e-5)
        before = _params(backend)
        steps[parallel] = (_step(backend).update(batch), _params(backend) - before)
    (fsdp, d_fsdp), (ddp, d_ddp) = steps["fsdp2"], steps["ddp"]
    assert fsdp["grad_norm"] > 0 and fsdp["loss"] == pytest.approx(ddp["loss"], abs=1e-6)
    assert fsdp["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=1e-4)
    torch.testing.assert_close(d_fsdp, d_ddp, atol=1e-5, rtol=1e-3)


def test_ddp_parameters_are_sent_in_place(tiny_model_path, tmp_path):
    """DDP on a CPU lays the trained parameters out in sync order: a sync in their dtype sends their own memory.

    Every fp32 bucket is a view of the parameters (same memory, the bytes ``gather_bucket`` packs) before and after
    an optimizer step and a checkpoint load; a bf16 sync packs (a cast), and FSDP2's shards are never sent in place.
    """
    for parallel in ("ddp", "fsdp2"):
        backend = TorchBackend(TorchBackendConfig(parallel=parallel), OptimizerConfig(lr=1e-3), tiny_model_path)
        plan = backend.sync_plan(torch.float32, bucket_bytes=1 << 20)
        assert len(plan.buckets) > 1
        if parallel == "fsdp2":
            assert all(backend.bucket_in_place(b) is None for b in plan.buckets)
            continue
        _assert_sent_in_place(backend, plan)
        backend.save(str(tmp_path / "ckpt"))
        saved = _params(backend)
        for _ in range(2):  # the views follow the parameters through optimizer steps
            _step(backend).update(_batch(GRPOAdvantageConfig()))
            _assert_sent_in_place(backend, plan)
        backend.load(str(tmp_path / "ckpt"))  # into the same memory
        assert torch.equal(_params(backend), saved)
        _assert_sent_in_place(backend, plan)
        bf16 = backend.sync_plan(torch.bfloat16, bucket_bytes=1 << 20)
        assert all(backend.bucket_in_place(b) is None for b in bf16.buckets)


def _assert_sent_in_place(backend, plan):
    params = {p.data_ptr() for p in backend.hf_model.parameters()}
    for bucket in plan.buckets:
        view = backend.bucket_in_place(bucket)
        assert view is not None and view.data_ptr() in params
        assert torch.equal(view, backend.gather_bucket(bucket, torch.float32))


@pytest.mark.parametrize("parallel", ["fsdp2", "ddp"])
def test_a_checkpoint_before_the_first_step_changes_no_later_step(tiny_model_path, tmp_path, parallel):
    """Regression: torch's ``get_state_dict`` makes a fresh optimizer's state by a zero-gradient step, so a save
    before the first step left AdamW counting that step (bias correction of every later update changed), and a
    load of that checkpoint did the same. Saved or loaded fresh, the run now trains as if never checkpointed."""
    fresh = str(tmp_path / "fresh")

    def run(save: str | None = None, load: str | None = None):
        backend = TorchBackend(TorchBackendConfig(parallel=parallel), OptimizerConfig(lr=1e-3), tiny_model_path)
        if save:
            backend.save(save)
        if load:
            backend.load(load)
        norms = [_step(backend).update(_batch(GRPOAdvantageConfig()))["grad_norm"] for _ in range(3)]
        return norms, _params(backend), backend

    plain = run()
    for norms, params, _ in (run(save=fresh), run(load=fresh)):
        assert norms == plain[0] and torch.equal(params, plain[1])
    plain[2].save(fresh)  # a re-save after steps into that directory: its state is real again
    assert not os.path.exists(os.path.join(fresh, FRESH_OPTIMIZER))
