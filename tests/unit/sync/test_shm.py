"""Shared bucket buffers: another process maps the same memory through the handle; the two sets alternate; the
memory goes when its last holder does, even one killed with SIGKILL."""

import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from miles_ray.sync import shm
from miles_ray.sync.buckets import plan_buckets
from miles_ray.sync.shm import BucketBuffers, SharedBucket, open_buckets

PLAN = plan_buckets([("w", (4,), torch.float32)], 1 << 20)
READ_AND_WRITE = (
    "import json, sys, torch\n"
    "from miles_ray.sync.shm import SharedBucket\n"
    "t = SharedBucket(**json.loads(sys.argv[1])).open().view(torch.float32)\n"
    "print(t.tolist()); t[0] = 42.0\n"
)


def _as_json(handle: SharedBucket) -> str:
    return json.dumps({"path": handle.path, "nbytes": handle.nbytes, "token": handle.token})


def test_another_process_sees_and_writes_the_same_memory():
    buffers = BucketBuffers(shared=True)
    buffer = buffers.next(PLAN)[0]
    buffer.view(torch.float32).copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    handle = buffers.handles()[0]
    out = subprocess.run([sys.executable, "-c", READ_AND_WRITE, _as_json(handle)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1.0, 2.0, 3.0, 4.0]"  # what the sender wrote
    assert buffer.view(torch.float32)[0].item() == 42.0  # and its write is the sender's memory: no copy


def _shmem_mb() -> float:
    """The node's shared memory in use (/proc/meminfo Shmem: memory files and /dev/shm alike)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Shmem:")) / 1024


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memory files are Linux's")
def test_a_killed_owner_leaves_no_memory_behind():
    """The owner of a 256 MB buffer is SIGKILLed (as Ray kills actors): a process that mapped it keeps the bytes
    until it lets go, then the node's shared memory is back where it was (torch's file_system buffers stayed)."""
    code = (
        "import json, time, torch\n"
        "from miles_ray.sync.shm import BucketBuffers\n"
        "from miles_ray.sync.buckets import plan_buckets\n"
        "b = BucketBuffers(shared=True)\n"
        "b.next(plan_buckets([('w', (64 << 20,), torch.float32)], 1 << 30))[0].view(torch.float32).fill_(7.0)\n"
        "h = b.handles()[0]\n"
        "print(json.dumps({'path': h.path, 'nbytes': h.nbytes, 'token': h.token}), flush=True)\n"
        "time.sleep(600)\n"
    )
    before = _shmem_mb()
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        handle = SharedBucket(**json.loads(owner.stdout.readline()))
        mapped = handle.open().view(torch.float32)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=60)
    assert _shmem_mb() - before > 200  # held by our mapping alone now
    assert mapped[-1].item() == 7.0  # the mapping outlives its owner
    with pytest.raises(RuntimeError, match="cannot map the trainer's shared bucket"):
        handle.open()  # nobody can open it again
    del mapped
    assert _shmem_mb() - before < 50


def test_engines_reuse_the_mappings_of_the_last_three_sets():
    buffers = BucketBuffers(shared=True)
    buffers.next(PLAN)
    first = buffers.handles()
    buffers.next(PLAN)
    second = buffers.handles()
    third_buffer, third = shm.shared_buffer(PLAN.total_bytes)  # a third set (a weight copy rotates through three)
    assert first != second
    mapped = [open_buckets(h)[0] for h in (first, second, [third])]
    assert all(open_buckets(h)[0] is m for h, m in zip((first, second, [third]), mapped))  # mapped once each
    assert len(shm._recent) == 3
    open_buckets(second)
    open_buckets([third])
    assert open_buckets(first)[0] is not mapped[0]  # three syncs later: mapped again


def test_a_view_inside_a_shared_buffer_has_a_handle_to_its_bytes_alone():
    buffer, whole = shm.shared_buffer(64)
    buffer.copy_(torch.arange(64, dtype=torch.uint8))
    handle = shm.handle_of(buffer[24:40].view(torch.float32))
    assert (handle.path, handle.token, handle.offset, handle.nbytes) == (whole.path, whole.token, 24, 16)
    mapped = handle.open()
    assert mapped.tolist() == list(range(24, 40))
    mapped[0] = 200
    assert buffer[24].item() == 200  # the same memory
    assert shm.handle_of(torch.zeros(4)) is None  # not shared memory of ours
    assert shm.handle_of(buffer[60:]) is not None and shm.handle_of(torch.cat([buffer, buffer])) is None
    before = buffer[24:40].view(torch.float32).tolist()
    out = subprocess.run(
        [sys.executable, "-c", READ_AND_WRITE, json.dumps(dataclasses.asdict(handle))], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr  # another process maps the bucket at its offset: reads and writes it
    assert out.stdout.strip() == str(before) and buffer[24:28].view(torch.float32).item() == 42.0


def test_two_sets_alternate_and_are_kept():
    plan = plan_buckets([("a", (8,), torch.float32), ("b", (4,), torch.bfloat16)], 16)
    buffers = BucketBuffers(shared=False)
    first, second, third = buffers.next(plan), buffers.next(plan), buffers.next(plan)
    assert [b.numel() for b in first] == [bucket.nbytes for bucket in plan.buckets]
    assert first[0].data_ptr() != second[0].data_ptr() and third[0].data_ptr() == first[0].data_ptr()
    single = BucketBuffers(shared=False, alternate=False)
    assert single.next(plan)[0].data_ptr() == single.next(plan)[0].data_ptr()
    with pytest.raises(ValueError, match="only BucketBuffers\\(shared=True\\)"):
        buffers.handles()


@pytest.mark.parametrize("sample", [None, 3])
def test_fill_buckets_copies_on_two_threads_and_digests_what_each_buffer_holds(sample):
    from concurrent.futures import ThreadPoolExecutor

    from miles_ray.sync.buckets import unpack
    from miles_ray.sync.digest import TensorDigests

    specs = [("embed", (300, 64), torch.float32), ("a", (64, 64), torch.float32), ("b", (7,), torch.float32)]
    plan = plan_buckets(specs, 40 << 10)  # the embedding alone in the first bucket: the halves are uneven
    sources = [torch.randn(b.numel) for b in plan.buckets]
    copies = [(b, src, torch.empty(b.numel)) for b, src in zip(plan.buckets, sources)]
    digests = TensorDigests(sample)
    with ThreadPoolExecutor(1) as helper:
        shm.fill_buckets(copies, digests, helper)
        shm.fill_buckets(copies, None, helper)  # unverified: copies only
    assert all(torch.equal(buffer, src) for _, src, buffer in copies)
    held = TensorDigests(sample).add(t for b, _, buffer in copies for t in unpack(b, buffer))
    assert digests.by_name() == held.by_name() and len(held.by_name()) == 3


def test_a_set_s_unpacked_views_are_made_once_per_plan_and_read_its_memory():
    """``unpacked``: the same views each time a set comes round with the same plan; new ones for another plan of the
    same sizes (other names and shapes) and for a plan that needs other buffers."""
    plan = plan_buckets([("a", (2, 3), torch.float32), ("b", (2,), torch.float32)], 1 << 20)
    buffers = BucketBuffers(shared=False)
    flats = [buffers.next(plan) for _ in range(3)]  # sets 0, 1, 0
    views = buffers.unpacked(plan)
    assert flats[2] is flats[0] and [n for n, _ in views[0]] == ["a", "b"]
    flats[2][0].view(torch.float32).copy_(torch.arange(8.0))
    assert torch.equal(views[0][0][1], torch.arange(6.0).view(2, 3)) and torch.equal(
        views[0][1][1], torch.tensor([6.0, 7.0])
    )
    buffers.next(plan)  # set 1
    assert buffers.unpacked(plan)[0][0][1].data_ptr() == flats[1][0].data_ptr()
    buffers.next(plan)  # set 0 again: the views made for it
    assert buffers.unpacked(plan)[0][0][1] is views[0][0][1]
    renamed = plan_buckets([("c", (4, 2), torch.float32)], 1 << 20)  # 32 bytes as well: the same buffers
    buffers.next(renamed)
    buffers.next(renamed)
    other = buffers.unpacked(renamed)[0]
    assert [n for n, _ in other] == ["c"] and other[0][1].shape == (4, 2)
    assert other[0][1].data_ptr() == flats[0][0].data_ptr()
    bigger = plan_buckets([("d", (16,), torch.float32)], 1 << 20)
    buffers.next(bigger)
    assert buffers.unpacked(bigger)[0][0][1].numel() == 16  # new buffers, their own views
