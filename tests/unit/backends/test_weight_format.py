"""The low-precision recipe on both sides: engines compute with rounded weights, the trainer's forward sees the same.

One ``WeightFormatConfig`` goes to the engine and the trainer. Checked: the trainer's view gives the engine's
logprobs (fp32, so only the rounding could differ, and it is the same rounding), a plain trainer does not; QAT
gradients pass straight through to the full-precision weights; after a weight load the engine rounds the new
weights while its checksum still covers the bytes the trainer sent.
"""

import pytest
import torch

from miles_ray.backends import ObjectiveConfig, OptimizerConfig, TorchBackendConfig
from miles_ray.backends.objectives import GRPOAdvantageConfig
from miles_ray.backends.rl_step import RLStep, logprobs
from miles_ray.backends.torch_backend import TorchBackend
from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.models.quant import RoundedLinear, WeightFormatConfig, quant_dequant
from miles_ray.sync.buckets import unpack
from miles_ray.sync.checksum import named_tensors_checksum
from miles_ray.types import RolloutBatch, Sample

from .test_torch_backend import _batch, process_group  # noqa: F401  (module-scoped gloo group of one)


def _rollout(engine, seed=3) -> RolloutBatch:
    request = GenerateRequest(prompt_ids=[5, 17, 42, 99], params=SamplingParams(n=4, max_new_tokens=16, seed=seed))
    [out] = engine.generate([request])
    return RolloutBatch.from_samples(
        [Sample(request.prompt_ids, c.token_ids, c.logprobs, reward=0.0) for c in out.completions], pad_id=0
    )


def _max_diff(backend, batch) -> float:
    trainer = logprobs(backend, batch, temperature=1.0)
    m = batch.response_mask > 0
    return float((trainer[m] - batch.rollout_logprobs[m]).abs().max())


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_trainer_view_matches_engine_and_plain_trainer_does_not(tiny_model_path, fmt):
    recipe = WeightFormatConfig(format=fmt, block=32)
    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=tiny_model_path, max_seq_len=64, weight_format=recipe))
    assert all(
        isinstance(engine.model.get_submodule(n.removesuffix(".weight")), RoundedLinear) for n in engine._rounded
    )
    batch = _rollout(engine)
    torch.manual_seed(0)
    view = TorchBackend(TorchBackendConfig(weight_format=recipe), OptimizerConfig(lr=1e-3), tiny_model_path)
    plain = TorchBackend(TorchBackendConfig(), OptimizerConfig(), tiny_model_path)
    view_diff, plain_diff = _max_diff(view, batch), _max_diff(plain, batch)
    assert view_diff < 1e-4  # the same rounding on both sides: fp32 noise only
    assert plain_diff > 10 * view_diff  # the rounding itself is what a plain trainer would miss

    # QAT step: gradients flow to the full-precision weights through the rounding (straight-through)
    def q_proj():  # FSDP2 shards it: the full tensor
        return view.hf_model.model.layers[0].self_attn.q_proj.weight.full_tensor().detach().clone()

    before = q_proj()
    metrics = RLStep(view, ObjectiveConfig()).update(_batch(GRPOAdvantageConfig()))
    q = q_proj()
    assert metrics["grad_norm"] > 0 and not torch.equal(before, q)
    # the sync sends the full-precision weights; the engine rounds them and still hashes what it was sent
    plan = view.sync_plan(torch.float32, 1 << 30)
    sent = [t for b in plan.buckets for t in unpack(b, view.gather_bucket(b, b.dtype))]
    engine.update_weights(sent)
    layer = engine.model.get_submodule("model.layers.0.self_attn.q_proj")
    torch.testing.assert_close(layer.rounded, quant_dequant(q, fmt, 32), rtol=0, atol=0)
    assert engine.weights_checksum() == named_tensors_checksum(sent)
    assert _max_diff(view, _rollout(engine, seed=4)) < 1e-4  # still in step after the update


def test_weight_format_config_errors(tiny_model_path):
    from pydantic import ValidationError

    from miles_ray.actors.critic_group import CriticGroupConfig
    from miles_ray.backends.lora import LoRAConfig

    with pytest.raises(ValidationError, match="format"):
        WeightFormatConfig(format="nf4")
    with pytest.raises(ValidationError, match="block"):
        WeightFormatConfig(format="fp8", block=4)
    recipe = WeightFormatConfig(format="fp8")
    with pytest.raises(ValidationError, match="lora and weight_format cannot be combined"):
        TorchBackendConfig(lora=LoRAConfig(), weight_format=recipe)
    with pytest.raises(ValidationError, match="CriticGroupConfig.backend.weight_format must be None"):
        CriticGroupConfig(model_path=tiny_model_path, backend={"weight_format": recipe})
