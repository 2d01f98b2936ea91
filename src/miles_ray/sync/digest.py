"""The weight digest itself, importing only ``hashlib``, ``xxhash`` and ``torch``.

Kept free of package imports so a process without miles_ray installed (the vLLM server, which loads this
file by path in its worker extension) computes exactly the digest the trainer does.

The digest is XXH3-128 over the sorted per-tensor XXH3-128 digests of ``(name, dtype, shape, bytes)``: it catches
any changed byte, a missing or renamed tensor, at ~30 GB/s on one core (measured here), so verifying a sync costs a
fraction of moving the bytes (SHA-256 ran at ~2 GB/s on the same machine and was most of a colocated sync). Hashing
each tensor on its own lets a sender hash a bucket while the next one is on the wire (``TensorDigests``). It guards
against bugs and torn loads, not against an adversary (a cryptographic digest would).

An engine whose parameter *is* a received bucket's memory (same address, dtype and shape: it computes on the
bucket in place) takes that tensor's digest from when it arrived (``TensorDigests.add(known=...)``) instead of
reading the bytes again: the memory is the same and nothing writes it until the next sync, so the digest is the
one a re-read would give. A parameter that was copied, cast or reshaped on load is hashed from what it holds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
import xxhash


class TensorDigests:
    """Per-tensor digests added as tensors come (any order), combined by name at the end.

    A tensor whose memory was already added under another name (a tied parameter) is skipped: the combination
    keeps the first name in sorted order, as ``named_tensors_checksum`` does when given every name at once.
    """

    def __init__(self):
        self._digests: dict[str, bytes] = {}
        self._memory: dict[tuple[int, int], str] = {}  # (data_ptr, numel) -> the name added for it

    def add(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], known: Mapping[str, Known] | None = None
    ) -> TensorDigests:
        """Hash each tensor (read as raw bytes on CPU).

        ``known``: digests already taken, by name, with the tensor each was taken of. A tensor that *is* that
        tensor's memory (same address, dtype and shape) takes the digest without reading its bytes: an engine whose
        parameters view the buckets it received verifies them by the digests of those buckets.
        """
        for name, t in named_tensors:
            t = t.detach()
            if not self._first_name_of_memory(name, t):
                continue
            got = known.get(name) if known else None
            self._digests[name] = got.digest if got is not None and same_memory(t, got.tensor) else digest(name, t)
        return self

    def _first_name_of_memory(self, name: str, t: torch.Tensor) -> bool:
        key = (t.data_ptr(), t.numel())  # tied parameters: same memory under two names
        if key in self._memory:
            first = min(name, self._memory[key])
            self._digests.pop(max(name, self._memory[key]), None)
            self._memory[key] = first
            return first == name
        self._memory[key] = name
        return True

    def by_name(self) -> dict[str, bytes]:
        """The per-tensor digests added so far."""
        return dict(self._digests)

    def hexdigest(self) -> str:
        """The digest of everything added."""
        h = xxhash.xxh3_128()
        for name in sorted(self._digests):
            h.update(self._digests[name])
        return h.hexdigest()


class Known(NamedTuple):
    """A tensor and its digest (``digest``), taken when it arrived."""

    tensor: torch.Tensor
    digest: bytes


def digest(name: str, t: torch.Tensor) -> bytes:
    """XXH3-128 of one named tensor: its name, dtype, shape and raw bytes."""
    t = t.detach().cpu().contiguous()
    h = xxhash.xxh3_128(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(memoryview(t.view(-1).view(torch.uint8).numpy()))
    return h.digest()


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same bytes in memory (address, dtype, shape; both contiguous)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.device == b.device
        and a.is_contiguous()
        and b.is_contiguous()
    )


def named_tensors_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Hex digest of the given tensors (in any order; combined by name).

    Args:
        named_tensors: ``(name, tensor)`` pairs; tensors are read as raw bytes on CPU.

    """
    return TensorDigests().add(named_tensors).hexdigest()


def tensor_sha256(t: torch.Tensor) -> str:
    """Hex SHA-256 of one tensor's raw bytes (how SGLang checks each adapter tensor it is sent)."""
    return hashlib.sha256(memoryview(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())).hexdigest()
