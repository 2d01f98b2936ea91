"""Parameters laid out in one buffer, in the order a weight sync sends them, so a sync can send them as they lie.

A sync packs each bucket's tensors into a flat buffer before sending it: for SmolLM2-135M in fp32 a 538 MB copy
per sync. On a CPU that copy competes for the cores with gloo's send and receive threads and the checksums, and
it was the largest part of what separated a verified broadcast from a raw gloo broadcast of the same bytes
(``docs/performance.md``). When the trained parameters already lie in one buffer per dtype, in their
``named_parameters`` order (the order the sync plan lists them), each bucket whose dtype is theirs *is* a slice
of that buffer: ``bucket_view`` returns it and nothing is copied. Megatron's DDP keeps its parameters in
contiguous buffers for the same reason.

Usage::

    flatten_parameters([p for p in model.parameters() if p.requires_grad])    # once, before wrapping
    flat = bucket_view(bucket, dict(model.named_parameters()))                 # None: pack it as before
"""

from __future__ import annotations

import torch

from miles_ray.sync.buckets import Bucket


@torch.no_grad()
def flatten_parameters(params: list[torch.nn.Parameter]) -> None:
    """Move ``params`` into one new buffer per dtype and device, in the order given (each parameter a view of it).

    The parameters keep their identity (optimizers, hooks and tied modules still hold the same objects); only
    their storage moves. Parameters given twice (tied) move once.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    seen: set[int] = set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            groups.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), group in groups.items():
        flat = torch.empty(sum(p.numel() for p in group), dtype=dtype, device=device)
        offset = 0
        for p in group:
            n = p.numel()
            flat[offset : offset + n].copy_(p.reshape(-1))
            p.data = flat[offset : offset + n].view(p.shape)
            offset += n


def bucket_view(bucket: Bucket, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The bucket's flat buffer as a view of the memory its tensors occupy, or None where they do not lie so.

    They lie so when every tensor is a plain, contiguous tensor of the bucket's dtype, all in one storage, each at
    the bucket's offset from the first: exactly the layout ``pack`` would write. The view reads the tensors'
    own memory, so it is only valid until they next change (an optimizer step).
    """
    first = tensors[bucket.tensors[0].name]
    if not _plain(first, bucket.dtype):
        return None
    storage, start = first.untyped_storage(), first.storage_offset()
    for m in bucket.tensors:
        t = tensors[m.name]
        if not _plain(t, bucket.dtype) or t.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        if t.storage_offset() != start + m.offset or t.numel() != m.numel:
            return None
    return torch.empty(0, dtype=bucket.dtype, device=first.device).set_(storage, start, (bucket.numel,))


def _plain(t: torch.Tensor, dtype: torch.dtype) -> bool:
    # a DTensor (FSDP2's shard) has the full tensor elsewhere; a non-contiguous one is not laid out as packed
    return not hasattr(t, "full_tensor") and t.dtype == dtype and t.is_contiguous()


def flat_base(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The one buffer ``tensors`` tile end to end (in any order, no gaps), as a 1-D tensor over it, or None."""
    if not tensors or not all(_plain(t, tensors[0].dtype) for t in tensors):
        return None
    storage = tensors[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in tensors):
        return None
    spans = sorted((t.storage_offset(), t.numel()) for t in tensors)
    if any(start != prev + n for (prev, n), (start, _) in zip(spans, spans[1:])):
        return None
    total = spans[-1][0] + spans[-1][1] - spans[0][0]
    return torch.empty(0, dtype=tensors[0].dtype, device=tensors[0].device).set_(storage, spans[0][0], (total,))
