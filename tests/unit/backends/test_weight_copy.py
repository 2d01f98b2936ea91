"""The bf16 weight copy: autocast's losses and gradients exactly, and a bf16 sync that sends the copy, kept current."""

import pytest
import torch

from miles_ray.backends import ObjectiveConfig, OptimizerConfig, TorchBackendConfig
from miles_ray.backends.objectives import KLConfig
from miles_ray.backends.rl_step import RLStep, logprobs
from miles_ray.backends.torch_backend import TorchBackend

from .test_packing import _grouped_batch
from .test_torch_backend import process_group  # noqa: F401  (module-scoped gloo group of one)

BF16 = {"parallel": "ddp", "autocast": "bfloat16"}


def _two_steps(path: str, weight_copy: bool, checkpointing: bool):
    """Two RL steps (KL to the on-rank reference, 3 micro-batches each): metrics, gradients, weights, logprobs."""
    torch.manual_seed(0)
    config = TorchBackendConfig(
        weight_copy=weight_copy, micro_batch_size=3, gradient_checkpointing=checkpointing, **BF16
    )
    backend = TorchBackend(config, OptimizerConfig(lr=1e-3), path, reference=True)
    grads, step = [], backend.clip_and_step

    def capture(loss_sum=0.0):  # the gradients the optimizer is about to apply, then the real step
        grads.append({n: p.grad.clone() for n, p in backend.hf_model.named_parameters()})
        return step(loss_sum)

    backend.clip_and_step = capture
    rl = RLStep(backend, ObjectiveConfig(kl=KLConfig(coef=0.5)))
    metrics = [rl.update(_grouped_batch(seed=s)) for s in (0, 1)]
    weights = {n: p.detach().clone() for n, p in backend.hf_model.named_parameters()}
    return backend, metrics, grads, weights, logprobs(backend, _grouped_batch(seed=2), temperature=1.0)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_the_copy_gives_autocast_s_losses_and_gradients_exactly(tiny_model_path, checkpointing):
    """Same seed and data with and without the copy: equal metrics, gradients, weights and logprobs, bit for bit.

    The second step runs on weights the first step's optimizer wrote: a copy left stale would differ there.
    Gradient checkpointing recomputes layers outside the copy's block, with autocast's casts: the same values.
    """
    plain = _two_steps(tiny_model_path, False, checkpointing)
    with_copy = _two_steps(tiny_model_path, True, checkpointing)
    assert plain[0].weight_copy is None and plain[0].reference.weight_copy is None
    assert with_copy[0].weight_copy is not None and with_copy[0].reference.weight_copy is not None  # frozen: its own
    (_, m0, g0, w0, lp0), (_, m1, g1, w1, lp1) = plain, with_copy
    assert m0[1]["grad_norm"] > 0 and m0[1]["ref_kl"] > 0
    assert m0 == m1
    for step0, step1 in zip(g0, g1, strict=True):
        assert all(torch.equal(step0[n], step1[n]) for n in step0)
    assert all(torch.equal(w0[n], w1[n]) for n in w0)
    assert torch.equal(lp0, lp1)


def test_a_layer_s_weights_get_their_gradients_as_the_backward_passes_the_layer(tiny_model_path):
    """The last layer's weights have their gradients before the backward reaches the first layer.

    DDP reduces a bucket once all its gradients are in, so a weight's gradient held back to the end of the backward
    holds every reduction back with it (on the quick-start's two ranks, ~0.8 s of waiting after the backward).
    """
    backend = TorchBackend(TorchBackendConfig(**BF16), OptimizerConfig(lr=1e-3), tiny_model_path)
    assert backend.weight_copy is not None
    layers, events = backend.hf_model.model.layers, []
    for name, p in layers[-1].named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: events.append(f"last layer {name}"))

    def first_layer_input(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        hidden.register_hook(lambda grad: events.append("first layer's input"))

    layers[0].register_forward_pre_hook(first_layer_input, with_kwargs=True)
    with backend.forward_context():
        logits = backend.hf_model(input_ids=torch.randint(0, 100, (2, 16))).logits
    logits.float().logsumexp(-1).mean().backward()
    first_input = events.index("first layer's input")
    assert {"last layer mlp.down_proj.weight", "last layer self_attn.q_proj.weight"} <= set(events[:first_input])


def _cast(backend, bucket) -> torch.Tensor:
    """The bucket's parameters cast to the bucket's dtype and packed, as a sync without the copy sends them."""
    params = dict(backend.hf_model.named_parameters())
    return torch.cat([params[m.name].detach().reshape(-1).to(bucket.dtype) for m in bucket.tensors])


def test_a_bf16_sync_sends_the_copy_as_the_weights_change(tiny_model_path, tmp_path):
    """Each bf16 bucket is a view of the copy and holds the weights cast, after optimizer steps and a load."""
    backend = TorchBackend(TorchBackendConfig(**BF16), OptimizerConfig(lr=1e-3), tiny_model_path)
    plan = backend.sync_plan(torch.bfloat16, bucket_bytes=1 << 19)
    assert len(plan.buckets) > 1

    def sent_from_the_copy() -> torch.Tensor:
        copy = backend.weight_copy.copies
        lo, hi = min(c.data_ptr() for c in copy), max(c.data_ptr() for c in copy)
        for bucket in plan.buckets:
            view = backend.bucket_in_place(bucket)
            assert view is not None and lo <= view.data_ptr() <= hi
            assert torch.equal(view, _cast(backend, bucket))
            assert torch.equal(backend.gather_bucket(bucket, torch.bfloat16), view)
        return torch.cat([backend.bucket_in_place(b) for b in plan.buckets])

    first = sent_from_the_copy()
    backend.save(str(tmp_path / "ckpt"))
    RLStep(backend, ObjectiveConfig()).update(_grouped_batch())
    assert not torch.equal(sent_from_the_copy(), first)  # the step moved the weights and the copy followed
    backend.load(str(tmp_path / "ckpt"))
    assert torch.equal(sent_from_the_copy(), first)
    fp32 = backend.sync_plan(torch.float32, bucket_bytes=1 << 19)  # the weights' own dtype: their own memory
    params = {p.data_ptr() for p in backend.hf_model.parameters()}
    assert all(backend.bucket_in_place(b).data_ptr() in params for b in fp32.buckets)


@pytest.mark.parametrize(
    "config",
    [
        {"parallel": "ddp", "autocast": "none"},
        {"parallel": "fsdp2", "autocast": "bfloat16"},
        {**BF16, "lora": {"rank": 4, "alpha": 8}},
        {**BF16, "weight_copy": False},
    ],
    ids=["no_autocast", "fsdp2", "lora", "off"],
)
def test_no_copy_where_it_does_not_apply(tiny_model_path, config):
    backend = TorchBackend(TorchBackendConfig(**config), OptimizerConfig(lr=1e-3), tiny_model_path)
    assert backend.weight_copy is None
    assert not backend.publish_in_place(torch.bfloat16, _shared)  # a shared-memory sync copies the buckets


def _shared(nbytes: int) -> torch.Tensor:
    from miles_ray.sync.shm import shared_buffer

    return shared_buffer(nbytes)[0]


def test_a_published_copy_stays_unwritten_while_engines_may_compute_on_it(tiny_model_path, tmp_path):
    """``publish_in_place``: the copy moves into three shared buffers; no write (an optimizer step, a checkpoint
    load) goes to the set published last or the time before, and the forwards read the copy wherever it is: the
    same metrics, bit for bit, as a copy never published."""
    from miles_ray.sync.shm import handle_of

    backends = []
    for _ in range(2):
        torch.manual_seed(0)
        backends.append(TorchBackend(TorchBackendConfig(**BF16), OptimizerConfig(lr=1e-3), tiny_model_path))
    backend, private = backends
    plan = backend.sync_plan(torch.bfloat16, bucket_bytes=1 << 19)
    published = []  # (the buckets handed to engines, their values then)

    def unchanged() -> bool:  # engines compute on the last set published; they may still view the one before
        return all(torch.equal(v, x) for views, values in published[-2:] for v, x in zip(views, values))

    for step in range(4):
        assert backend.publish_in_place(torch.bfloat16, _shared)
        views = [backend.bucket_in_place(b) for b in plan.buckets]
        assert all(handle_of(v) is not None for v in views)  # in shared memory: engines map the copy itself
        assert all(torch.equal(v, _cast(backend, b)) for v, b in zip(views, plan.buckets))
        published.append((views, [v.clone() for v in views]))
        metrics = [RLStep(b, ObjectiveConfig()).update(_grouped_batch(seed=step)) for b in backends]
        assert metrics[0] == metrics[1]
        assert unchanged()
    assert len({views[0].data_ptr() for views, _ in published}) == 3  # three sets in turn
    backend.save(str(tmp_path / "ckpt"))
    backend.load(str(tmp_path / "ckpt"))  # a write the version counters show: to the free set as well
    assert unchanged()
    assert backend.publish_in_place(torch.bfloat16, _shared)
    assert all(torch.equal(backend.bucket_in_place(b), _cast(backend, b)) for b in plan.buckets)
    assert private.publish_in_place(torch.float32, _shared) is False  # the copy is bf16; fp32 buckets are copied
