import pytest
import torch

from miles_ray.sync import buckets_checksum, named_tensors_checksum, pack, plan_buckets, unpack


def test_buckets_respect_size_and_dtype():
    specs = [
        ("a", (4,), torch.float32),
        ("b", (4,), torch.float32),
        ("c", (2,), torch.bfloat16),
        ("d", (10,), torch.float32),
    ]
    plan = plan_buckets(specs, bucket_bytes=32)  # 8 fp32 elements per bucket
    # a full bucket closes when the next tensor would overflow it; open buckets close at the end in open order
    assert [[m.name for m in b.tensors] for b in plan.buckets] == [["a", "b"], ["c"], ["d"]]
    assert [b.dtype for b in plan.buckets] == [torch.float32, torch.bfloat16, torch.float32]
    assert plan.buckets[0].numel == 8 and plan.buckets[2].nbytes == 40  # oversize tensor gets its own bucket
    assert plan.total_bytes == 32 + 40 + 4


def test_pack_unpack_round_trip():
    tensors = {"w": torch.randn(3, 4), "b": torch.randn(5)}
    plan = plan_buckets([(k, tuple(v.shape), v.dtype) for k, v in tensors.items()], bucket_bytes=1 << 20)
    [bucket] = plan.buckets
    flat = pack(bucket, tensors)
    out = dict(unpack(bucket, flat))
    for k, v in tensors.items():
        assert torch.equal(out[k], v)
    # hashing the packed buckets equals hashing the tensors themselves (what an engine holds after loading)
    assert buckets_checksum(plan, [flat]) == named_tensors_checksum(tensors.items())


def test_duplicate_names_rejected():
    with pytest.raises(ValueError, match="unique"):
        plan_buckets([("a", (1,), torch.float32)] * 2, 1024)


def test_checksum_detects_one_changed_bit_and_dedups_ties():
    w = torch.randn(16)
    base = named_tensors_checksum([("w", w), ("v", torch.ones(3))])
    assert named_tensors_checksum([("v", torch.ones(3)), ("w", w.clone())]) == base  # order-independent
    flipped = w.clone()
    flipped.view(torch.int32)[5] ^= 1
    assert named_tensors_checksum([("w", flipped), ("v", torch.ones(3))]) != base
    assert named_tensors_checksum([("w", w), ("v", torch.ones(3, dtype=torch.bfloat16))]) != base
    # a tied parameter (same memory, second name) counts once
    assert named_tensors_checksum([("w", w), ("w_tied", w), ("v", torch.ones(3))]) == base
    # views of one flat buffer are distinct tensors
    flat = torch.arange(8.0)
    assert named_tensors_checksum([("x", flat[:4]), ("y", flat[4:])]) != named_tensors_checksum([("x", flat[:4])])
