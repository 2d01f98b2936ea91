"""LoRA in the torch backend (peft) and the embedded engine: what trains, what syncs, what the engine computes."""

import pytest
import torch

from miles_ray.backends import ObjectiveConfig, OptimizerConfig, TorchBackendConfig
from miles_ray.backends.lora import LoRAConfig
from miles_ray.backends.objectives import GRPOAdvantageConfig, KLConfig
from miles_ray.backends.rl_step import RLStep, logprobs
from miles_ray.backends.torch_backend import TorchBackend
from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.sync.buckets import unpack
from miles_ray.sync.checksum import named_tensors_checksum
from miles_ray.types import RolloutBatch, Sample

from .test_torch_backend import _batch, process_group  # noqa: F401  (module-scoped gloo group of one)

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_backend(path, parallel="fsdp2", lr=1e-2, checkpointing=False, **lora):
    torch.manual_seed(0)
    lora = LoRAConfig(rank=4, alpha=8, **lora)
    cfg = TorchBackendConfig(parallel=parallel, gradient_checkpointing=checkpointing, lora=lora)
    return TorchBackend(cfg, OptimizerConfig(lr=lr), path)


def _train(backend, **objective) -> dict:
    """One GRPO step of ``backend`` on the shared test batch."""
    return RLStep(backend, ObjectiveConfig(**objective)).update(_batch(GRPOAdvantageConfig()))


def _named(backend) -> dict[str, torch.Tensor]:
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in backend.hf_model.named_parameters()}
    return {n: p.detach().clone() for n, p in full.items()}


@pytest.mark.parametrize("parallel,checkpointing", [("fsdp2", False), ("ddp", False), ("fsdp2", True)])
def test_only_adapters_train_and_only_adapters_sync(tiny_model_path, parallel, checkpointing):
    """Frozen embeddings under activation checkpointing still pass gradients to the adapters."""
    backend = _lora_backend(tiny_model_path, parallel, checkpointing=checkpointing)
    before = _named(backend)
    trainable = {n for n, p in backend.hf_model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    metrics = _train(backend)
    after = _named(backend)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert metrics["grad_norm"] > 0 and changed  # B starts at 0: the first step moves B only (A gets no grad)
    assert changed <= trainable and all(".lora_B." in n for n in changed)

    plan = backend.sync_plan(torch.float32, 1 << 20)
    spec = plan.adapter
    assert spec.rank == 4 and spec.scaling == pytest.approx(2.0)
    assert spec.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    num_layers = backend.hf_model.config.num_hidden_layers
    assert len(plan.names) == num_layers * 4 * 2  # A and B of 4 projections per layer
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) and ".default." not in n for n in plan.names)
    full = sum(p.numel() for p in backend.hf_model.parameters() if not p.requires_grad)
    assert plan.total_bytes < full * 4 / 10  # a tenth of the fp32 base at most on the tiny model


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_engine_with_synced_adapter_matches_the_trainer(family, request):
    """Trained adapter -> engine (unmerged LoRA): the engine's sampled-token logprobs equal the trainer's (fp32).
    On Qwen3-MoE the adapters sit on the attention projections (see the next test)."""
    tiny_model_path = request.getfixturevalue("tiny_model_path" if family == "llama" else "tiny_qwen3_moe_path")
    backend = _lora_backend(tiny_model_path, target_modules=ALL_LINEAR if family == "llama" else ALL_LINEAR[:4])
    for _ in range(2):  # two steps: A and B both non-zero
        _train(backend)
    plan = backend.sync_plan(torch.float32, 1 << 20)
    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=tiny_model_path, max_batch_size=8, max_seq_len=64))
    request = GenerateRequest(prompt_ids=[5, 17, 42, 99], params=SamplingParams(n=4, max_new_tokens=12, seed=3))
    [base_out] = engine.generate([request])
    assert engine.install_adapter(plan.adapter) and not engine.install_adapter(plan.adapter)
    [zero_out] = engine.generate([request])  # zero adapters change nothing
    assert [c.token_ids for c in zero_out.completions] == [c.token_ids for c in base_out.completions]
    sent = [t for b in plan.buckets for t in unpack(b, backend.gather_bucket(b, b.dtype))]  # what a sync sends
    engine.update_weights(sent)
    [out] = engine.generate([request])
    assert [c.token_ids for c in out.completions] != [c.token_ids for c in base_out.completions]

    samples = [Sample(request.prompt_ids, c.token_ids, c.logprobs, reward=0.0) for c in out.completions]
    batch = RolloutBatch.from_samples(samples, pad_id=0)
    trainer = logprobs(backend, batch, 1.0)
    m = batch.response_mask > 0
    torch.testing.assert_close(batch.rollout_logprobs[m], trainer[m], atol=1e-4, rtol=1e-4)
    # the engine's checksum over the synced names equals the checksum of what the trainer sent
    assert engine.weights_checksum(plan.names) == named_tensors_checksum(sent) != engine.weights_checksum()
    with pytest.raises(ValueError, match="one adapter spec per run"):
        engine.install_adapter(plan.adapter.__class__(rank=8, scaling=1.0, target_modules=("q_proj",)))


def test_adapters_on_fused_moe_experts_are_refused(tiny_qwen3_moe_path):
    """peft maps gate/up/down_proj of an MoE model onto its 3-D expert tensors, which no engine takes adapters on."""
    with pytest.raises(ValueError, match="put adapters on model.layers.0.mlp.experts.*target the attention"):
        _lora_backend(tiny_qwen3_moe_path, target_modules=ALL_LINEAR)


def test_merged_export_and_peft_adapter_equal_the_policy(tiny_model_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from miles_ray.backends.lora import write_peft_adapter

    backend = _lora_backend(tiny_model_path, target_modules=("q_proj", "v_proj", "down_proj"))
    for _ in range(2):
        _train(backend)
    batch = _batch(GRPOAdvantageConfig())
    policy = logprobs(backend, batch, 1.0)
    weights, adapters = backend.hf_state(torch.float32)
    assert all(".lora_" not in n and ".base_layer." not in n for n in weights)
    merged = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    missing, unexpected = merged.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    out = write_peft_adapter(tmp_path / "adapter", backend.config.lora, tiny_model_path, adapters)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), str(out)).eval()
    m = batch.response_mask > 0
    for model in (merged, peft_model):
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        torch.testing.assert_close(lp[m], policy[m], atol=1e-5, rtol=1e-5)


def test_kl_reference_is_the_base_with_adapters_off(tiny_model_path):
    """No second model: the reference is the policy with adapters off, equal to the untouched base model."""
    torch.manual_seed(0)
    cfg = TorchBackendConfig(lora=LoRAConfig(rank=4, alpha=8))
    backend = TorchBackend(cfg, OptimizerConfig(lr=1e-2), tiny_model_path, reference=True)
    plain = TorchBackend(TorchBackendConfig(), OptimizerConfig(), tiny_model_path)
    batch = _batch(GRPOAdvantageConfig())
    base = logprobs(plain, batch, 1.0)
    metrics = [_train(backend, kl=KLConfig(coef=0.5, estimator="k3")) for _ in range(2)]
    assert metrics[0]["ref_kl"] == pytest.approx(0.0, abs=1e-7) and metrics[1]["ref_kl"] > 0
    torch.testing.assert_close(logprobs(backend.reference, batch, 1.0), base)
    assert not torch.allclose(logprobs(backend, batch, 1.0), base)  # adapters back on after the reference
    assert all(p.requires_grad for n, p in backend.hf_model.named_parameters() if ".lora_" in n)


def test_lora_config_errors(tiny_model_path):
    from pydantic import ValidationError

    from miles_ray.actors.critic_group import CriticGroupConfig
    from miles_ray.actors.reference import ReferenceGroupConfig

    with pytest.raises(ValidationError, match="target_modules must be module names"):
        LoRAConfig(target_modules=("model.layers.0.q_proj",))
    with pytest.raises(ValidationError, match="rank"):
        LoRAConfig(rank=0)
    with pytest.raises(ValueError, match=r"lora.target_modules \['qkv'\] name no linear layer"):
        _lora_backend(tiny_model_path, target_modules=("qkv",))
    lora_backend = TorchBackendConfig(lora=LoRAConfig())
    for cls in (CriticGroupConfig, ReferenceGroupConfig):
        with pytest.raises(ValidationError, match=rf"{cls.__name__}.backend.lora must be None"):
            cls(model_path=tiny_model_path, backend=lora_backend)


def test_checkpoint_round_trip_restores_adapters_and_optimizer(tiny_model_path, tmp_path):
    """DCP save/load of a LoRA policy: a restored rank takes the same next step as the one that kept going."""
    backend = _lora_backend(tiny_model_path)
    _train(backend)
    backend.save(str(tmp_path / "ckpt"))
    restored = _lora_backend(tiny_model_path)
    restored.load(str(tmp_path / "ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(_named(backend).values(), _named(restored).values()))
    for b in (backend, restored):
        _train(b)
    after, after_restored = _named(backend), _named(restored)
    torch.testing.assert_close(after, after_restored)  # Adam moments came back too: same second step
