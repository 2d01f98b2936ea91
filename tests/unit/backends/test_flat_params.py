"""Parameters in one buffer (``backends.flat_params``): buckets as views of their memory, and when not."""

import torch

from miles_ray.backends.flat_params import bucket_view, flatten_parameters
from miles_ray.sync.buckets import pack, plan_buckets


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 11))
    model[2].weight = model[0].weight  # tied, as an LM head often is
    return model


def _plan(named, dtype=torch.float32, bucket_bytes=256):
    return plan_buckets([(n, tuple(p.shape), dtype) for n, p in named], bucket_bytes)


def test_flattened_parameters_keep_values_identity_and_training():
    model = _model()
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    flatten_parameters(list(model.parameters()) + [model[0].weight])  # a parameter given twice moves once
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1])
    assert model[2].weight is model[0].weight
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    assert all(not torch.equal(p, before[n][1]) for n, p in model.named_parameters())
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} == storages  # still one buffer


def test_buckets_are_views_exactly_where_the_layout_is_pack_s():
    model = _model()
    named = list(model.named_parameters())
    plan = _plan(named)  # the embedding (66 floats) alone; the two linears' 3 tensors (53) together
    assert [len(b.tensors) for b in plan.buckets] == [1, 3]
    tensors = dict(named)
    assert bucket_view(plan.buckets[1], tensors) is None  # separate allocations: packed as before
    flatten_parameters([p for _, p in named])
    for bucket in plan.buckets:
        view = bucket_view(bucket, tensors)
        assert view is not None and torch.equal(view, pack(bucket, tensors)) and not view.requires_grad
        view.add_(1.0)  # the view is the parameters' memory
        assert torch.equal(pack(bucket, tensors), view)
    assert all(bucket_view(b, tensors) is None for b in _plan(named, torch.bfloat16).buckets)  # a cast packs
    reordered = _plan(named[::-1])  # the linears' tensors in another order than they lie in
    assert [len(b.tensors) for b in reordered.buckets] == [3, 1]
    assert bucket_view(reordered.buckets[0], tensors) is None and bucket_view(reordered.buckets[1], tensors) is not None
