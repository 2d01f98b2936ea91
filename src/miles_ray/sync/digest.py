"""The weight digest itself, importing only ``hashlib`` and ``torch``.

Kept free of package imports so a process without miles_ray installed (the vLLM server, which loads this
file by path in its worker extension) computes exactly the digest the trainer does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


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


def tensor_sha256(t: torch.Tensor) -> str:
    """Hex SHA-256 of one tensor's raw bytes (how SGLang checks each adapter tensor it is sent)."""
    return hashlib.sha256(memoryview(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())).hexdigest()
