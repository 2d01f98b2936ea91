"""The weight digest: any changed byte or name changes it; digests taken on arrival stand in for a parameter only
when the parameter *is* that memory."""

import torch

from miles_ray.sync.digest import (
    SAMPLE_BLOCK,
    SAMPLE_PHASES,
    SAMPLE_WIDTH,
    Known,
    TensorDigests,
    copy_with_digests,
    digest,
    named_tensors_checksum,
)

W = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}


def test_a_byte_a_name_or_a_dtype_changes_the_digest():
    base = named_tensors_checksum(W.items())
    assert named_tensors_checksum(reversed(list(W.items()))) == base  # order does not matter
    changed = {**W, "a": W["a"].clone()}
    changed["a"][1, 2] += 1e-6
    assert named_tensors_checksum(changed.items()) != base
    assert named_tensors_checksum({"c": W["a"], "b": W["b"]}.items()) != base
    assert named_tensors_checksum({**W, "a": W["a"].double()}.items()) != base


def test_a_known_digest_stands_for_the_same_memory_only():
    honest = named_tensors_checksum(W.items())
    wrong = {"a": Known(W["a"], b"\0" * 16)}  # a digest that is not a's: shows whether it was used
    assert TensorDigests().add(W.items(), known=wrong).hexdigest() != honest  # same memory: taken, bytes not read
    copy = {**W, "a": W["a"].clone()}
    assert TensorDigests().add(copy.items(), known=wrong).hexdigest() == honest  # other memory: hashed
    right = {name: Known(t, digest(name, t)) for name, t in W.items()}
    assert TensorDigests().add(W.items(), known=right).hexdigest() == honest


def test_tied_parameters_count_once_under_the_first_name():
    tied = {"embed": W["a"], "head": W["a"], "b": W["b"]}
    assert named_tensors_checksum(tied.items()) == named_tensors_checksum({"embed": W["a"], "b": W["b"]}.items())


def test_copy_with_digests_copies_and_hashes_what_it_wrote():
    src = torch.randn(5000)
    dst = torch.zeros(5000)
    # byte ranges: one inside a chunk, one over several chunks, an empty one, one ending mid-chunk; 1 KiB chunks
    shapes = {"a": (10,), "b": (700, 2), "e": (0,), "c": (99,)}
    spans, at = [], 40
    for name, shape in shapes.items():
        n = torch.Size(shape).numel() * 4
        spans.append((name, torch.float32, shape, at, at + n))
        at += n
    got = copy_with_digests(spans, dst.view(torch.uint8), src.view(torch.uint8), chunk_bytes=1 << 10)
    assert torch.equal(dst[10 : at // 4], src[10 : at // 4]) and not dst[:10].any() and not dst[at // 4 :].any()
    expected = [
        digest(name, src.view(torch.uint8)[a:b].view(torch.float32).view(shape)) for name, _, shape, a, b in spans
    ]
    assert got == expected


def test_a_bucket_s_digests_equal_those_of_its_unpacked_tensors():
    from miles_ray.sync.buckets import plan_buckets, unpack

    specs = [("a", (300, 7), torch.bfloat16), ("b", (5,), torch.bfloat16), ("c", (2048, 3), torch.bfloat16)]
    (bucket,) = plan_buckets(specs, 1 << 20).buckets
    flat = torch.randn(bucket.numel).to(torch.bfloat16)
    for sample in (None, 9):
        by_bucket = TensorDigests(sample).add_bucket(bucket, flat).by_name()
        assert by_bucket == TensorDigests(sample).add(unpack(bucket, flat)).by_name() and len(by_bucket) == 3


def test_a_sampled_digest_reads_one_window_of_every_4_kib_that_moves_with_the_sample():
    w = torch.randn(5 * SAMPLE_BLOCK // 4 + 3)  # 5 blocks of bytes and a 12-byte tail
    full, sampled = digest("w", w), digest("w", w, sample=0)
    assert sampled != full and digest("w", w, sample=SAMPLE_PHASES) == sampled  # the sample wraps around
    for offset in (0, SAMPLE_WIDTH, 3 * SAMPLE_BLOCK + 100, 5 * SAMPLE_BLOCK + 4):  # bytes of blocks 0, 0, 3, the tail
        changed = w.clone()
        changed.view(torch.uint8)[offset] ^= 1
        window = offset // SAMPLE_WIDTH % SAMPLE_PHASES
        tail = offset >= 5 * SAMPLE_BLOCK
        assert digest("w", changed) != full
        # the sample whose window holds the byte sees it (the tail: every sample); the others do not
        assert digest("w", changed, sample=window) != digest("w", w, sample=window)
        other = (window + 1) % SAMPLE_PHASES
        assert (digest("w", changed, sample=other) != digest("w", w, sample=other)) == tail
    assert named_tensors_checksum({"v": w}.items(), sample=0) != named_tensors_checksum(W.items(), sample=0)
    assert digest("v", w, sample=0) != sampled  # the name counts, as in every digest


def test_the_cpu_sampled_digest_equals_the_digest_of_the_gathered_bytes_a_gpu_sends_to_the_host():
    import xxhash

    from miles_ray.sync.digest import _head, sampled_bytes

    w = torch.randn(3 * SAMPLE_BLOCK // 4 + 5)  # 3 blocks and a 20-byte tail
    data = w.view(torch.uint8)
    for sample in (0, 7, SAMPLE_PHASES - 1):
        gathered = sampled_bytes(data, sample)  # what digest() hashes for a tensor on a GPU
        at = sample * SAMPLE_WIDTH
        expected = [data[b * SAMPLE_BLOCK + at : b * SAMPLE_BLOCK + at + SAMPLE_WIDTH] for b in range(3)]
        assert torch.equal(gathered, torch.cat([*expected, data[3 * SAMPLE_BLOCK :]]))
        on_host = xxhash.xxh3_128(_head("w", w.dtype, w.shape, sample) + gathered.numpy().tobytes()).digest()
        assert digest("w", w, sample=sample) == on_host
