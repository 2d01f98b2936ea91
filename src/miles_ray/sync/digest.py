"""The weight digest itself, importing only ``hashlib``, ``numpy``, ``xxhash`` and ``torch``.

Kept free of package imports so a process without miles_ray installed (the vLLM server, which loads this
file by path in its worker extension) computes exactly the digest the trainer does.

The digest is XXH3-128 over the sorted per-tensor XXH3-128 digests of ``(name, dtype, shape, bytes)``: it catches
any changed byte, a missing or renamed tensor, at ~30 GB/s on one core (measured here), so verifying a sync costs a
fraction of moving the bytes (SHA-256 ran at ~2 GB/s on the same machine and was most of a colocated sync). Hashing
each tensor on its own lets a sender hash a bucket while the next one is on the wire (``TensorDigests``). It guards
against bugs and torn loads, not against an adversary (a cryptographic digest would).

A *sampled* digest (``sample``, ``WeightBroadcasterConfig(verify="sampled")``) hashes each tensor's name, dtype and
shape, and of its bytes one 64-byte window in every 4 KiB (and the last partial 4 KiB whole), the window at offset
``64 * (sample % 64)``: it reads 1/64 of the bytes, so any 4 KiB run of a tensor (a page that was not written, a
shifted or swapped tensor, another tensor's bytes) is checked on every sync, and with the sample advancing by one
per sync, every byte within 64 consecutive syncs. A change confined to the other 63/64 of a tensor's bytes passes
that sync's check.

An engine whose parameter *is* a received bucket's memory (same address, dtype and shape: it computes on the
bucket in place) takes that tensor's digest from when it arrived (``TensorDigests.add(known=...)``) instead of
reading the bytes again: the memory is the same and nothing writes it until the next sync, so the digest is the
one a re-read would give. A parameter that was copied, cast or reshaped on load is hashed from what it holds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import xxhash

if TYPE_CHECKING:  # for annotations only: this file runs where miles_ray is not installed
    from miles_ray.sync.buckets import Bucket, TensorMeta

SAMPLE_BLOCK, SAMPLE_WIDTH = 4096, 64  # a sampled digest reads SAMPLE_WIDTH bytes of every SAMPLE_BLOCK
SAMPLE_PHASES = SAMPLE_BLOCK // SAMPLE_WIDTH  # consecutive samples that cover every byte


class TensorDigests:
    """Per-tensor digests added as tensors come (any order), combined by name at the end.

    A tensor whose memory was already added under another name (a tied parameter) is skipped: the combination
    keeps the first name in sorted order, as ``named_tensors_checksum`` does when given every name at once.
    """

    def __init__(self, sample: int | None = None):
        self.sample = sample  # None: every byte; else the sampled digest's window (``digest``)
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
            if not self._first_name_of_memory(name, (t.data_ptr(), t.numel())):
                continue
            got = known.get(name) if known else None
            known_here = got is not None and same_memory(t, got.tensor)
            self._digests[name] = got.digest if known_here else digest(name, t, self.sample)
        return self

    def add_bucket(self, bucket: Bucket, flat: torch.Tensor) -> TensorDigests:
        """Hash each tensor a sync bucket packs (``sync.buckets.Bucket``) in ``flat``, its buffer in its dtype.

        Equals ``add(unpack(bucket, flat))``; on CPU it slices one NumPy view of the buffer instead of making a torch
        view per tensor, a few microseconds less per tensor (hundreds of tensors per sync).
        """
        if flat.device.type != "cpu":
            return self.add((m.name, flat[m.offset : m.offset + m.numel].view(m.shape)) for m in bucket.tensors)
        for name, memory, taken in bucket_digests(bucket.tensors, flat, self.sample):
            self.put(name, memory, taken)
        return self

    def put(self, name: str, memory: tuple[int, int], taken: bytes) -> TensorDigests:
        """Add ``taken``, a digest computed elsewhere (``copy_with_digests``) of the tensor ``name`` at ``memory``.

        ``memory``: the tensor's address and number of elements (which tell a tied parameter).
        """
        if self._first_name_of_memory(name, memory):
            self._digests[name] = taken
        return self

    def _first_name_of_memory(self, name: str, key: tuple[int, int]) -> bool:
        # key: (address, number of elements); tied parameters are the same memory under two names
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


def digest(name: str, t: torch.Tensor, sample: int | None = None) -> bytes:
    """XXH3-128 of one named tensor: its name, dtype, shape and raw bytes (``sample``: ``sampled_bytes`` of them)."""
    t = t.detach()
    t = t if t.is_contiguous() else t.contiguous()
    data = t.view(-1).view(torch.uint8)
    if data.device.type == "cpu":
        return _hash(name, t.dtype, t.shape, data.numpy(), sample)
    if sample is not None:  # on the device: a GPU moves 1/64 of the bytes to the host
        data = sampled_bytes(data, sample)
    return _hash(name, t.dtype, t.shape, data.cpu().numpy(), sample, sampled=True)


def sampled_bytes(data: torch.Tensor, sample: int) -> torch.Tensor:
    """The bytes a sampled digest reads of ``data`` (1-D ``uint8``): one window of every block, and the tail whole.

    Gathered where ``data`` is (a GPU's copy to the host is 1/64 of the tensor); on CPU ``_hash`` reads the same
    bytes without gathering them.
    """
    whole, at = _windows(data.numel(), sample)
    return torch.cat([data[:whole].view(-1, SAMPLE_BLOCK)[:, at : at + SAMPLE_WIDTH].reshape(-1), data[whole:]])


def _windows(nbytes: int, sample: int) -> tuple[int, int]:
    """The bytes in whole blocks, and where in each block the window of ``sample`` starts."""
    return nbytes // SAMPLE_BLOCK * SAMPLE_BLOCK, sample % SAMPLE_PHASES * SAMPLE_WIDTH


def _hash(name: str, dtype: torch.dtype, shape, data: np.ndarray, sample: int | None, sampled: bool = False) -> bytes:
    """The digest of a tensor's bytes ``data`` (``sampled``: already reduced to ``sampled_bytes``)."""
    h = xxhash.xxh3_128(_head(name, dtype, shape, sample))
    if sample is None or sampled:
        h.update(data)
    else:  # the windows, then the tail: the digest of ``sampled_bytes`` without gathering them into one buffer
        whole, at = _windows(data.size, sample)
        h.update(np.ascontiguousarray(data[:whole].reshape(-1, SAMPLE_BLOCK)[:, at : at + SAMPLE_WIDTH]).reshape(-1))
        h.update(data[whole:])
    return h.digest()


def _head(name: str, dtype: torch.dtype, shape, sample: int | None) -> bytes:
    """What a digest hashes before the bytes: the name, dtype, shape and, if sampled, which windows."""
    sampled = "" if sample is None else f"sampled {sample % SAMPLE_PHASES}|"
    return f"{name}|{dtype}|{tuple(shape)}|{sampled}".encode()


def copy_with_digests(
    tensors: list[tuple[str, torch.dtype, tuple[int, ...], int, int]],
    dst: torch.Tensor,
    src: torch.Tensor,
    chunk_bytes: int = 2 << 20,
) -> list[bytes]:
    """Copy the bytes ``tensors`` span from ``src`` into ``dst``; return each one's digest, as ``digest`` gives it.

    ``dst`` and ``src`` are 1-D ``uint8`` CPU tensors of one size; ``tensors`` are ``(name, dtype, shape, start,
    end)`` byte ranges of them, in order. The copy goes ``chunk_bytes`` at a time and the tensors' bytes in a chunk
    are hashed right after it is written, while it is in cache: reading the bytes again from memory costs about
    half as much as the copy itself. One copy call per chunk and one hash update per tensor and chunk keep the
    interpreter's share small (two threads share it).
    """
    hashers = [xxhash.xxh3_128(_head(name, dtype, shape, None)) for name, dtype, shape, _, _ in tensors]
    if not tensors:
        return []
    out, k = dst.numpy(), 0
    first, last = tensors[0][3], tensors[-1][4]
    for begin in range(first, last, chunk_bytes):
        end = min(last, begin + chunk_bytes)
        dst[begin:end].copy_(src[begin:end])
        while k < len(tensors) and tensors[k][3] < end:  # the tensors this chunk holds bytes of
            start, stop = tensors[k][3:]
            hashers[k].update(out[max(start, begin) : min(stop, end)])
            if stop > end:  # goes on in the next chunk
                break
            k += 1
    return [h.digest() for h in hashers]


def bucket_digests(
    tensors: Sequence[TensorMeta], flat: torch.Tensor, sample: int | None = None
) -> list[tuple[str, tuple[int, int], bytes]]:
    """``(name, (address, numel), digest)`` of each of a bucket's ``tensors`` in ``flat``, its CPU buffer in its dtype.

    Adds to no ``TensorDigests``, so threads may share a bucket's tensors out (``TensorDigests.put`` them after).
    """
    data, size, base = flat.view(torch.uint8).numpy(), flat.element_size(), flat.data_ptr()
    out = []
    for m in tensors:
        start, end = m.offset * size, (m.offset + m.numel) * size
        out.append((m.name, (base + start, m.numel), _hash(m.name, flat.dtype, m.shape, data[start:end], sample)))
    return out


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


def named_tensors_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]], sample: int | None = None) -> str:
    """Hex digest of the given tensors (in any order; combined by name).

    Args:
        named_tensors: ``(name, tensor)`` pairs; tensors are read as raw bytes.
        sample: None for every byte, else the sampled digest's sample (``digest``).

    """
    return TensorDigests(sample).add(named_tensors).hexdigest()


def tensor_sha256(t: torch.Tensor) -> str:
    """Hex SHA-256 of one tensor's raw bytes (how SGLang checks each adapter tensor it is sent)."""
    return hashlib.sha256(memoryview(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())).hexdigest()
