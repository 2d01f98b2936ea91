"""Shared-memory transport for colocated sync: persistent shared buffers on a node, the object store across.

Trainer rank 0 gathers each bucket straight into a shared-memory buffer it keeps from sync to sync
(``BucketBuffers(shared=True)``), and hands engines a ``SharedBucket``: a few bytes naming the buffer. An engine on
the same node maps it (once; later syncs reuse the mapping) and points its parameters at the bucket's views, so a
sync moves the weights once, trainer memory to shared memory, and the engine copies nothing. Two buffer sets
alternate: engines compute with set A while the next sync fills set B, and every engine moves to B before A is
written again. Where the trainer's bf16 weight copy itself lives in shared buffers (``TrainBackend.publish_in_place``),
a sync hands engines that memory (``handle_of``: a bucket at its offset in a buffer) and moves nothing at all.

On Linux a buffer is an anonymous memory file (``memfd_create``) that other processes open through
``/proc/<pid>/fd/<fd>``: the kernel frees it when the last process holding or mapping it is gone, so nothing is
left behind when actors are killed (named files in ``/dev/shm``, as torch's ``file_system`` sharing uses, outlive
a SIGKILLed owner, and a run's worth of buckets then stays in memory until reboot). Elsewhere it is a file in the
temporary directory, removed when the buffer is freed.

Engines on other nodes get the bucket through the Ray object store instead (``put_bucket``: ``ray.put`` of a NumPy
byte array, mapped without a copy by readers on the object's node; ``ray.put`` of a torch tensor would pickle it,
several times slower). bfloat16 has no NumPy dtype, so buckets travel as raw bytes and are viewed back as their dtype.

Usage (trainer rank 0, then an engine on the same node)::

    buffers = BucketBuffers(shared=True)
    flats = buffers.next(plan)                     # one uint8 buffer per bucket, filled by the gather
    handles = buffers.handles()                    # what engines receive (the same list for every engine)
    tensors = open_buckets(handles)                # in the engine: the same memory
"""

from __future__ import annotations

import dataclasses
import itertools
import mmap
import os
import tempfile
import uuid
import warnings
import weakref
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.multiprocessing

from miles_ray.sync.buckets import Bucket, SyncPlan, unpack_plan
from miles_ray.sync.digest import TensorDigests, bucket_digests, copy_with_digests

if TYPE_CHECKING:
    import ray


def shared_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised ``uint8`` buffer in torch's shared memory, for a torch process that unpickles tensors.

    ``share_memory_`` of a tensor would copy it. Sync buffers use ``shared_buffer`` instead.
    """
    # by a file name in /dev/shm: the default strategy (fd passing) only works between related processes
    torch.multiprocessing.set_sharing_strategy("file_system")
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))


@dataclass(frozen=True)
class SharedBucket:
    """A shared-memory bucket buffer, as the path a process on the same node opens and maps.

    ``offset``: where the bucket's ``nbytes`` start in the buffer (a bucket of a larger buffer, ``handle_of``).
    """

    path: str
    nbytes: int
    token: str  # unique per buffer: a later buffer may get the same descriptor number, never the same token
    offset: int = 0

    def open(self) -> torch.Tensor:
        """A new mapping of the bucket as a ``uint8`` tensor (``open_buckets`` keeps mappings from sync to sync)."""
        try:
            with open(self.path, "r+b") as f:
                mapped = mmap.mmap(f.fileno(), self.offset + self.nbytes)  # from 0: an offset must be page-aligned
                return torch.frombuffer(mapped, dtype=torch.uint8, count=self.nbytes, offset=self.offset)
        except OSError as e:
            raise RuntimeError(
                f"cannot map the trainer's shared bucket {self.path}: {e}. Shared-memory sync needs the engine on the "
                "trainer's node as the same user; use WeightBroadcasterConfig(transport='broadcast') otherwise"
            ) from e


def shared_buffer(nbytes: int) -> tuple[torch.Tensor, SharedBucket]:
    """An uninitialised ``uint8`` buffer in shared memory and the handle other processes open it by."""
    token = uuid.uuid4().hex
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(f"miles_ray_bucket_{token[:8]}", os.MFD_CLOEXEC)
        path, release = f"/proc/{os.getpid()}/fd/{fd}", (os.close, fd)
    else:
        fd, path = tempfile.mkstemp(prefix="miles_ray_bucket_")
        release = (_close_and_remove, fd, path)
    os.ftruncate(fd, nbytes)
    mapped = mmap.mmap(fd, nbytes)
    tensor = torch.frombuffer(mapped, dtype=torch.uint8)
    # the mapping lives while any tensor views it (not only this one); the engines' mappings outlive the descriptor
    weakref.finalize(mapped, *release)
    handle = SharedBucket(path, nbytes, token)
    _made[tensor.data_ptr()] = (weakref.ref(mapped), handle)
    return tensor, handle


_made: dict[int, tuple[weakref.ref, SharedBucket]] = {}  # address -> (its mapping, the handle) of our shared_buffers


def handle_of(view: torch.Tensor) -> SharedBucket | None:
    """The handle of the bytes ``view`` (contiguous, on CPU) occupies, if a live ``shared_buffer`` of ours holds them.

    A trainer whose weight copy lies in shared memory hands engines its buckets so. None elsewhere.
    """
    start, nbytes = view.data_ptr(), view.numel() * view.element_size()
    for address, (ref, handle) in list(_made.items()):
        if ref() is None:  # freed: its address may be reused
            del _made[address]
        elif address <= start and start + nbytes <= address + handle.nbytes:
            return dataclasses.replace(handle, offset=start - address, nbytes=nbytes)
    return None


def _close_and_remove(fd: int, path: str) -> None:
    os.close(fd)
    os.unlink(path)


_recent: deque[dict[tuple[str, int], torch.Tensor]] = deque(maxlen=3)  # (token, offset) -> mapping, last 3 syncs


def open_buckets(handles: list[SharedBucket]) -> list[torch.Tensor]:
    """Map a sync's buckets, reusing the mappings of the last three syncs (the sets a sender rotates through).

    Older mappings leave the cache; their memory stays while a parameter still views it.
    """
    known = {key: t for opened in _recent for key, t in opened.items()}
    keys = [(h.token, h.offset) for h in handles]
    current = {key: known[key] if key in known else h.open() for key, h in zip(keys, handles)}
    _recent.append(current)
    return [current[key] for key in keys]


class BucketBuffers:
    """Two sets of persistent bucket buffers alternating from sync to sync (``shared``: in shared memory).

    A sender fills one set while engines may still compute with the other (their parameters view it); a receiver
    takes a broadcast into one set while its parameters view the other. Allocated on first use (and again if the
    plan's buckets change), so a sync writes into memory that is already mapped. ``alternate=False``: one set,
    for a sender whose buffers nobody views after the sync (a broadcast's).
    """

    def __init__(self, shared: bool, alternate: bool = True):
        self.shared = shared
        self._sets: list[list[torch.Tensor]] = [[], []] if alternate else [[]]
        self._handles: list[list[SharedBucket]] = [[] for _ in self._sets]
        self._unpacked: list[tuple[SyncPlan, list] | None] = [None for _ in self._sets]  # ``unpacked``, per set
        self._turn = 0
        self._last = 0

    def next(self, plan: SyncPlan) -> list[torch.Tensor]:
        """The buffer set this sync fills: one ``uint8`` buffer of ``bucket.nbytes`` per bucket of ``plan``."""
        turn, buffers = self._turn, self._sets[self._turn]
        if [b.numel() for b in buffers] != [bucket.nbytes for bucket in plan.buckets]:  # first use, or another plan
            if self.shared:
                made = [shared_buffer(bucket.nbytes) for bucket in plan.buckets]
                buffers[:], self._handles[turn][:] = [t for t, _ in made], [h for _, h in made]
            else:
                buffers[:] = [torch.empty(bucket.nbytes, dtype=torch.uint8) for bucket in plan.buckets]
            self._unpacked[turn] = None
        self._last, self._turn = turn, (turn + 1) % len(self._sets)
        return buffers

    def unpacked(self, plan: SyncPlan) -> list[list[tuple[str, torch.Tensor]]]:
        """The set ``next`` returned last as each bucket's named tensors (``unpack``), made once per set and plan.

        A receiver makes a view per tensor of every sync (hundreds; ~1 ms on a 2-core VM, after the last byte): the
        set's memory stays the same from sync to sync, so the views do too.
        """
        made = self._unpacked[self._last]
        if made is None or made[0] != plan:  # another plan of the same sizes: other names, shapes or offsets
            made = self._unpacked[self._last] = (plan, unpack_plan(plan, self._sets[self._last]))
        return made[1]

    def handles(self) -> list[SharedBucket]:
        """The handles of the set ``next`` returned last (shared buffers only), for every engine on this node."""
        if not self.shared:
            raise ValueError("handles() of private buffers: only BucketBuffers(shared=True) can be opened elsewhere")
        return list(self._handles[self._last])


def fill_buckets(
    copies: list[tuple[Bucket, torch.Tensor, torch.Tensor]], digests: TensorDigests | None, helper: Executor
) -> None:
    """Copy ``(bucket, source, buffer)`` triples, half the bytes on this thread and half on ``helper``.

    ``source`` is the bucket's tensors' memory in its layout (``bucket_in_place``), ``buffer`` the bucket's buffer
    (in its dtype). With ``digests`` of every byte, each tensor is hashed as it is copied, chunk by chunk while the
    chunk is in cache (``copy_with_digests``): two passes over the bytes instead of three. Otherwise each thread
    copies its half of each bucket in one call (few calls: the two threads seldom wait for each other's turn with
    the interpreter), and a sampled digest (``digests.sample``) reads its 1/64 of the buffers afterwards, on both
    threads (``hash_buckets``).
    """
    if digests is not None and digests.sample is None:
        _fill_hashing(copies, digests, helper)
        return

    def half(second: bool) -> None:
        for _, source, buffer in copies:
            cut = source.numel() // 2
            part = slice(cut, None) if second else slice(0, cut)
            buffer[part].copy_(source[part])

    rest = helper.submit(half, True)
    half(False)
    rest.result()
    if digests is not None:
        hash_buckets([(bucket, buffer) for bucket, _, buffer in copies], digests, helper)


def _fill_hashing(
    copies: list[tuple[Bucket, torch.Tensor, torch.Tensor]], digests: TensorDigests, helper: Executor
) -> None:
    """``fill_buckets`` with a digest of every byte: the tensors holding the first half of the bytes on this thread."""

    def run(part: list) -> list[tuple[str, tuple[int, int], bytes]]:
        taken = []
        for i, group in itertools.groupby(part, key=lambda x: x[0]):  # a bucket's tensors lie back to back
            bucket, source, buffer = copies[i]
            metas, size, base = [m for _, m in group], buffer.element_size(), buffer.data_ptr()
            spans = [(m.name, bucket.dtype, m.shape, m.offset * size, (m.offset + m.numel) * size) for m in metas]
            got = copy_with_digests(spans, buffer.view(torch.uint8), source.view(torch.uint8))
            taken += [(m.name, (base + span[3], m.numel), d) for m, span, d in zip(metas, spans, got)]
        return taken

    _halves([(b, buffer) for b, _, buffer in copies], run, digests, helper)


def hash_buckets(buckets: list[tuple[Bucket, torch.Tensor]], digests: TensorDigests, helper: Executor) -> None:
    """Add the digests of ``(bucket, buffer)`` pairs (CPU, in the bucket's dtype), half the bytes on ``helper``."""

    def run(part: list) -> list[tuple[str, tuple[int, int], bytes]]:
        taken = []
        for i, group in itertools.groupby(part, key=lambda x: x[0]):
            taken += bucket_digests([m for _, m in group], buckets[i][1], digests.sample)
        return taken

    _halves(buckets, run, digests, helper)


def _halves(buckets: list[tuple[Bucket, torch.Tensor]], run, digests: TensorDigests, helper: Executor) -> None:
    """``run`` the ``(bucket index, tensor)`` pairs holding the first half of the bytes here, the rest on ``helper``.

    The digests both return are added here: ``TensorDigests`` is not thread-safe.
    """
    tensors = [(i, m) for i, (bucket, _) in enumerate(buckets) for m in bucket.tensors]
    sizes = [m.numel * buckets[i][1].element_size() for i, m in tensors]
    cut, done, total = len(tensors), 0, sum(sizes)
    for k, n in enumerate(sizes):
        if 2 * done >= total:
            cut = k
            break
        done += n
    rest = helper.submit(run, tensors[cut:])
    for name, memory, d in run(tensors[:cut]) + rest.result():
        digests.put(name, memory, d)


def put_bucket(flat: torch.Tensor) -> ray.ObjectRef:
    """Put a flat CPU tensor into the object store as a zero-copy NumPy byte array."""
    import ray  # here only: shared-memory sync between processes on one node needs no Ray

    return ray.put(flat.contiguous().view(torch.uint8).numpy())


def as_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """View an object-store byte array (read-only) as a tensor of ``dtype`` without copying."""
    with warnings.catch_warnings():  # the array is read-only; we only read from it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array).view(dtype)
