"""Weight checksums that a trainer and an engine compute independently and compare after a sync.

The ``full`` checksum is an XXH3-128 digest over ``(name, dtype, shape, bytes)`` of every tensor, in name order
(``sync.digest``), so it detects any changed byte, a missing tensor or a renamed one. Tied parameters (the same
memory under two names) are hashed once, under the first name. The ``probe`` checksum covers the first values of
each tensor only, for servers that cannot hand back whole tensors in HF layout (SGLang).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from miles_ray.sync.buckets import SyncPlan, unpack
from miles_ray.sync.digest import TensorDigests, named_tensors_checksum


def buckets_checksum(plan: SyncPlan, flats: Iterable[torch.Tensor], sample: int | None = None) -> str:
    """Checksum of the tensors packed in a sync's flat bucket buffers (one flat per ``plan`` bucket, in order).

    Equals ``named_tensors_checksum`` of the unpacked tensors (``sample``: sampled, ``sync.digest``), so a sender
    hashing its buckets and an engine hashing the parameters it loaded from them agree.
    """
    digests = TensorDigests(sample)
    for bucket, flat in zip(plan.buckets, flats):
        digests.add_bucket(bucket, flat)
    return digests.hexdigest()


def probe_rows(named_tensors: Iterable[tuple[str, torch.Tensor]], num_values: int = 16) -> dict[str, list[float]]:
    """The first ``num_values`` values of each tensor's first row (a 1-D tensor: its first value), as floats.

    What a server that cannot return whole tensors in HF layout (SGLang's ``/get_weights_by_name``) can
    report of each one: an engine hashes these values of what it holds, the trainer of what it sent.
    """
    return {name: t.detach()[:1].reshape(-1)[:num_values].float().tolist() for name, t in named_tensors}


def probe_checksum(rows: dict[str, list[float]]) -> str:
    """Hex digest of ``probe_rows`` output (values as float32, names sorted)."""
    h = hashlib.sha256()
    for name in sorted(rows):
        h.update(f"{name}|".encode())
        h.update(memoryview(torch.tensor(rows[name], dtype=torch.float32).numpy()))
    return h.hexdigest()


def sent_checksums(
    plan: SyncPlan, flats: list[torch.Tensor], kinds: Iterable[str], sample: int | None = None
) -> dict[str, str]:
    """The checksums of one sync's buckets engines asked for: ``full`` (every byte, or sampled) and/or ``probe``."""
    out = {}
    for kind in set(kinds):
        if kind == "full":
            out[kind] = buckets_checksum(plan, flats, sample)
        elif kind == "probe":
            out[kind] = probe_checksum(probe_rows(t for b, f in zip(plan.buckets, flats) for t in unpack(b, f)))
        else:
            raise ValueError(f"checksum kind must be 'full' or 'probe', got {kind!r}")
    return out


__all__ = ["buckets_checksum", "named_tensors_checksum", "probe_checksum", "probe_rows", "sent_checksums"]
