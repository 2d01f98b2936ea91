"""Broadcast transport for disaggregated sync: one process group of the sending trainer rank and every engine.

The group is formed the way SGLang's ``/init_weights_update_group`` forms its side (a ``tcp://`` rendezvous,
a ``PrefixStore`` named after the group, ``torch.distributed``'s own group constructor), so embedded engine
actors and SGLang scheduler ranks join the same group as peers. It lives beside the trainer's data-parallel
group. ``collective="gloo"`` moves CPU tensors; on GPUs the same code path uses NCCL with CUDA buffers.
Buckets travel as bytes (``uint8``), SGLang's ``flattened_bucket`` layout: a one-dtype bucket's flat buffer
viewed as bytes is exactly that layout.

Usage (rank 0 is the sender and hosts the rendezvous store)::

    store = open_store(host, world_size)                                    # rank 0; the others get store.port
    group = BroadcastGroup.create(host, store.port, 0, world_size, store=store)
    group = BroadcastGroup.create(host, port, rank, world_size)            # ranks 1..: clients of that store
    group.broadcast(flat.view(torch.uint8))        # in place on receivers
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

GROUP_NAME = "miles_ray_weight_sync"


def open_store(host: str, world_size: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """Rank 0's rendezvous store, bound to a port the OS picks as it binds (``.port``; tell the other ranks).

    A port found free and bound later can be taken in between: the group then failed with EADDRINUSE on
    rank 0 while the other ranks waited for it. Binding port 0 leaves no gap.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)


def group_name(port: int) -> str:
    """The group's name: one per rendezvous port, since torch refuses a name twice in one process (re-formed groups)."""
    return f"{GROUP_NAME}_{port}"


class BroadcastGroup:
    """A standalone collective group used only for weight broadcast."""

    def __init__(self, pg: dist.ProcessGroup, store: dist.Store, rank: int, world_size: int):
        self.pg = pg
        self._store = store
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def create(
        cls,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        collective: str = "gloo",
        timeout_s: float = 300.0,
        store: dist.Store | None = None,
    ) -> BroadcastGroup:
        """Join the group; rank 0 hosts the rendezvous store. Blocks until all ranks joined.

        ``store``: rank 0's own, from ``open_store`` (``port`` is then its port). Without one, rank 0 binds
        ``port`` only as it joins, and a port chosen earlier can be taken meanwhile. Other ranks connect to ``port``.

        Raises:
            ValueError: for a collective other than gloo/nccl.

        """
        from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world, rendezvous

        if collective not in ("gloo", "nccl"):
            raise ValueError(f"collective must be 'gloo' or 'nccl', got {collective!r}")
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store, _, _ = next(rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        name = group_name(port)
        store = dist.PrefixStore(name, store)
        pg, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend(collective),
            store,
            group_name=name,
            backend_options=None,
            timeout=timeout,
            device_id=None,
        )
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        return cls(pg, store, rank, world_size)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """Broadcast ``tensor`` from ``src`` in place; ``async_op``: return the work handle (``.wait()`` it)."""
        work = dist.broadcast(tensor, src=src, group=self.pg, async_op=async_op)
        return work if async_op else tensor

    def barrier(self) -> None:
        """Wait for every rank."""
        self.broadcast(torch.zeros(1))

    def close(self) -> None:
        """Leave the group now: its threads and sockets end (idempotent).

        Call it before joining a re-formed group (the old one otherwise stays registered with torch, its threads and
        sockets alive), and before a process exits: a group first freed during interpreter shutdown can abort the
        process (SIGABRT, "terminate called without an active exception"), as gloo's threads then cannot take the GIL.
        """
        if self.pg is not None:
            dist.destroy_process_group(self.pg)
            self.pg = self._store = None
