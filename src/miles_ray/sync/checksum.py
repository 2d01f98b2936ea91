"""Weight checksums that a trainer and an engine compute independently and compare after a sync.

The checksum is a SHA-256 digest over ``(name, dtype, shape, bytes)`` of every tensor, in name order, so
it detects any changed byte, a missing tensor or a renamed one. Tied parameters (the same memory under
two names) are hashed once, under the first name. SHA-256 rather than BLAKE2b: CPUs with SHA extensions
hash it ~2.5x faster (1.7 vs 0.7 GB/s measured on this project's dev machine).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from miles_ray.sync.digest import named_tensors_checksum
from miles_ray.sync.plan import SyncPlan, unpack


def buckets_checksum(plan: SyncPlan, flats: Iterable[torch.Tensor]) -> str:
    """Checksum of the tensors packed in a sync's flat bucket buffers (one flat per ``plan`` bucket, in order).

    Equals ``named_tensors_checksum`` of the unpacked tensors, so a sender hashing its buckets and an engine
    hashing the parameters it loaded from them agree.
    """
    return named_tensors_checksum(t for bucket, flat in zip(plan.buckets, flats) for t in unpack(bucket, flat))


__all__ = ["buckets_checksum", "named_tensors_checksum"]
