"""The Megatron backend at TP=1 in one process (gloo): same logprobs and the same GRPO step as the torch backend.

TP=2, checkpoint resharding and the GRPO run with engines are in tests/e2e/test_megatron.py (several ranks).
"""

import pytest
import torch
from installs import import_or_missing

import_or_missing("megatron.core", "megatron")
pytestmark = pytest.mark.megatron

from miles_ray.backends import ObjectiveConfig, OptimizerConfig, TorchBackendConfig  # noqa: E402
from miles_ray.backends.megatron_backend import MegatronBackend, MegatronBackendConfig  # noqa: E402
from miles_ray.backends.objectives import GRPOAdvantageConfig  # noqa: E402
from miles_ray.backends.rl_step import RLStep, logprobs  # noqa: E402
from miles_ray.backends.torch_backend import TorchBackend  # noqa: E402

from .test_torch_backend import _batch, process_group  # noqa: E402, F401  (module-scoped gloo group of one)


@pytest.fixture(scope="module", autouse=True)
def model_parallel(process_group):  # noqa: F811
    yield
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def _backends(path, lr=1e-2):
    optim = OptimizerConfig(lr=lr)
    megatron = MegatronBackend(MegatronBackendConfig(micro_batch_size=3), optim, path)
    torch_ = TorchBackend(TorchBackendConfig(parallel="ddp", micro_batch_size=3), optim, path)
    return megatron, torch_


def test_same_logprobs_and_same_step_as_the_torch_backend(tiny_model_path, hf):
    megatron, torch_ = _backends(tiny_model_path)
    batch = _batch(GRPOAdvantageConfig())
    m = batch.response_mask > 0
    lp = logprobs(megatron, batch, temperature=1.0)
    torch.testing.assert_close(lp[m], logprobs(torch_, batch, temperature=1.0)[m], atol=1e-5, rtol=1e-5)
    a, b = RLStep(megatron, ObjectiveConfig()).update(batch), RLStep(torch_, ObjectiveConfig()).update(batch)
    for key in ("loss", "grad_norm", "entropy", "num_tokens", "train_rollout_logprob_abs_diff_mean"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    after = logprobs(megatron, batch, temperature=1.0)
    torch.testing.assert_close(after[m], logprobs(torch_, batch, temperature=1.0)[m], atol=1e-4, rtol=1e-4)
    assert (after[m] - lp[m]).abs().max() > 1e-3  # the weights moved
    # what a sync sends: HF names and shapes, the trained weights
    full, _ = megatron.hf_state(torch.float32)
    ref = dict(torch_.hf_model.named_parameters())
    assert set(full) == set(ref)
    # Adam divides by sqrt(v): fp32 rounding differences of tiny gradients move a weight by a little of lr (1e-2)
    assert max((full[n] - ref[n].detach()).abs().max().item() for n in ref) < 2e-4


def test_config_errors_name_the_field(tiny_model_path):
    with pytest.raises(ValueError, match="pipeline_model_parallel_size"):
        MegatronBackendConfig(parallel={"pipeline_model_parallel_size": 2})
    with pytest.raises(ValueError, match="sequence_parallel needs tensor_model_parallel_size > 1"):
        MegatronBackendConfig(parallel={"sequence_parallel": True})
    with pytest.raises(ValueError, match="transformer_args may not set \\['hidden_size'\\]"):
        MegatronBackendConfig(transformer_args={"hidden_size": 8})
    with pytest.raises(ValueError, match="'no_such_field'\\] are not megatron TransformerConfig fields"):
        MegatronBackend(
            MegatronBackendConfig(transformer_args={"no_such_field": 1}), OptimizerConfig(), tiny_model_path
        )


def test_cpu_shim_maps_only_what_megatron_needs():
    from miles_ray.backends import megatron_cpu

    assert megatron_cpu.apply() is True  # no CUDA here: patched (idempotent)
    assert torch.cuda.current_device() == torch.device("cpu")
    with megatron_cpu.cpu_devices():
        t = torch.zeros(2, device="cuda")
        assert t.device.type == "cpu" and t.type() == "torch.cuda.FloatTensor" and t.cuda() is t
    assert torch.zeros(1).type() == "torch.FloatTensor"  # outside the context nothing is rewritten


def test_packed_shared_prefix_step_equals_the_padded_step(tiny_model_path):
    """Megatron's packed rows (shared prompts forwarded once, its own attention-mask convention) give the padded
    logprobs, loss and gradient norm."""
    from .test_packing import _grouped_batch

    batch = _grouped_batch()
    m = batch.response_mask > 0
    runs = {}
    for name, packing in (("padded", None), ("packed", {})):
        torch.manual_seed(0)
        backend = MegatronBackend(
            MegatronBackendConfig(micro_batch_size=16, packing=packing), OptimizerConfig(), tiny_model_path
        )
        runs[name] = (logprobs(backend, batch, temperature=1.0)[m], RLStep(backend, ObjectiveConfig()).update(batch))
    torch.testing.assert_close(runs["packed"][0], runs["padded"][0], atol=1e-5, rtol=1e-5)
    for key in ("loss", "grad_norm", "entropy", "num_tokens"):
        assert runs["packed"][1][key] == pytest.approx(runs["padded"][1][key], rel=1e-5, abs=1e-7), key
