"""Broadcast transport for disaggregated sync: one process group of the sending trainer rank and every engine.

The group is made from its own ``TCPStore`` (not ``init_process_group``), so it lives beside the
trainer's data-parallel group. ``backend="gloo"`` moves CPU tensors; on GPUs the same code path uses
``ProcessGroupNCCL`` with CUDA buffers.

Usage (rank 0 is the sender)::

    group = BroadcastGroup.create("127.0.0.1", port, rank, world_size)
    group.broadcast(flat)        # in place on receivers
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class BroadcastGroup:
    """A standalone collective group used only for weight broadcast."""

    def __init__(self, pg: dist.ProcessGroup, store: dist.Store, rank: int, world_size: int):
        self.pg, self._store, self.rank, self.world_size = pg, store, rank, world_size

    @classmethod
    def create(
        cls, host: str, port: int, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 300.0
    ) -> BroadcastGroup:
        """Join the group; rank 0 hosts the rendezvous store. Blocks until all ranks joined.

        Raises:
            ValueError: for a backend other than gloo/nccl.

        """
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore("miles_ray_weight_sync", store)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        elif backend == "nccl":
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        else:
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        return cls(pg, store, rank, world_size)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast ``tensor`` from ``src`` in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()
        return tensor

    def barrier(self) -> None:
        """Wait for every rank."""
        self.broadcast(torch.zeros(1))
