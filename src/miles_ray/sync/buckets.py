"""Sync planning: which tensors go in which bucket. Pure functions returning frozen ``SyncPlan``s.

A bucket is a run of tensors of one dtype whose bytes sum to at most ``bucket_bytes`` (a tensor larger
than that gets a bucket of its own). Trainer and engines agree on the plan before any byte moves, so
each side can pack/unpack a flat buffer without per-tensor messages.

Usage::

    plan = plan_buckets([("a", (4, 4), torch.float32), ...], bucket_bytes=64 << 20)
    for bucket in plan.buckets: ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorMeta:
    """Name, shape and dtype of one tensor in a bucket, and its element offset in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Bucket:
    """Tensors packed into one flat buffer of ``numel`` elements of ``dtype``."""

    dtype: torch.dtype
    numel: int
    tensors: tuple[TensorMeta, ...]

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer in bytes."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class AdapterSpec:
    """The LoRA adapter a sync carries instead of full weights: engines add it to their model before loading.

    ``target_modules`` are the linear layers' own names (``q_proj``, ...); each gets ``<name>.lora_A.weight``
    ``[rank, in]`` and ``<name>.lora_B.weight`` ``[out, rank]`` and computes ``base(x) + scaling * B(A(x))``.
    """

    rank: int
    scaling: float
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class SyncPlan:
    """The buckets of one weight sync, in send order; ``adapter`` set when only LoRA tensors are sent."""

    buckets: tuple[Bucket, ...]
    adapter: AdapterSpec | None = None

    @property
    def names(self) -> list[str]:
        """Names of every tensor the sync sends."""
        return [m.name for b in self.buckets for m in b.tensors]

    @property
    def total_bytes(self) -> int:
        """Bytes moved by the sync."""
        return sum(b.nbytes for b in self.buckets)


def plan_buckets(
    specs: list[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int, adapter: AdapterSpec | None = None
) -> SyncPlan:
    """Group tensors into buckets of one dtype and at most ``bucket_bytes`` (order preserved per dtype).

    Raises:
        ValueError: if ``bucket_bytes`` is not positive or a name repeats.

    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    names = [s[0] for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("plan_buckets: tensor names must be unique")
    buckets: list[Bucket] = []
    open_: dict[torch.dtype, list[TensorMeta]] = {}
    sizes: dict[torch.dtype, int] = {}

    def close(dtype: torch.dtype) -> None:
        metas = open_.pop(dtype)
        buckets.append(Bucket(dtype, sizes.pop(dtype), tuple(metas)))

    for name, shape, dtype in specs:
        elem = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        if dtype in open_ and (sizes[dtype] + numel) * elem > bucket_bytes:
            close(dtype)
        metas = open_.setdefault(dtype, [])
        offset = sizes.get(dtype, 0)
        metas.append(TensorMeta(name, tuple(shape), dtype, offset))
        sizes[dtype] = offset + numel
    for dtype in list(open_):
        close(dtype)
    return SyncPlan(tuple(buckets), adapter)


def pack(bucket: Bucket, tensors: dict[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy a bucket's tensors into one flat buffer: ``out`` (``bucket.numel`` of ``bucket.dtype``) or a new one."""
    flat = torch.empty(bucket.numel, dtype=bucket.dtype) if out is None else out
    for m in bucket.tensors:
        flat[m.offset : m.offset + m.numel].copy_(tensors[m.name].reshape(-1))
    return flat


def unpack(bucket: Bucket, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of a flat buffer as the bucket's named tensors (no copy)."""
    return [(m.name, flat[m.offset : m.offset + m.numel].view(m.shape)) for m in bucket.tensors]


def unpack_plan(plan: SyncPlan, flats: list[torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    """Each bucket of ``plan`` as its named tensors (``unpack``), from its buffer in ``flats`` (any dtype: viewed)."""
    return [unpack(bucket, flat.view(bucket.dtype)) for bucket, flat in zip(plan.buckets, flats)]
