"""Weight checksums that a trainer and an engine compute independently and compare after a sync.

The checksum is a SHA-256 digest over ``(name, dtype, shape, bytes)`` of every tensor, in name order, so
it detects any changed byte, a missing tensor or a renamed one. Tied parameters (the same memory under
two names) are hashed once, under the first name. SHA-256 rather than BLAKE2b: CPUs with SHA extensions
hash it ~2.5x faster (1.7 vs 0.7 GB/s measured on this project's dev machine).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from miles_ray.sync.plan import SyncPlan, unpack


def named_tensors_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Hex digest of the given tensors (sorted by name).

    Args:
        named_tensors: ``(name, tensor)`` pairs; tensors are read as raw bytes on CPU.

    """
    h = hashlib.sha256()
    seen: set[int] = set()
    items = sorted(named_tensors, key=lambda kv: kv[0])
    for name, t in items:
        t = t.detach()
        key = (t.data_ptr(), t.numel())  # tied parameters: same memory under two names
        if key in seen:
            continue
        seen.add(key)
        t = t.cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(memoryview(t.view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def buckets_checksum(plan: SyncPlan, flats: Iterable[torch.Tensor]) -> str:
    """Checksum of the tensors packed in a sync's flat bucket buffers (one flat per ``plan`` bucket, in order).

    Equals ``named_tensors_checksum`` of the unpacked tensors, so a sender hashing its buckets and an engine
    hashing the parameters it loaded from them agree.
    """
    return named_tensors_checksum(t for bucket, flat in zip(plan.buckets, flats) for t in unpack(bucket, flat))
