"""Workers: the rank actors of the trainer, critic and reference, and their plumbing (spawn, rendezvous, gather).

A group actor (``TrainerGroup``, ``CriticGroup``, ``ReferenceGroup``) starts one ``Worker`` subclass per slot of
its placement role with ``start_workers``; the workers form one ``torch.distributed`` group (gloo on CPU, NCCL on
GPU) hosted by rank 0, and each builds its backend in ``setup``. Every worker gets the whole list of sample groups
and works on its backend's data shard; per-token results travel back as one list of floats per sample, holding
the values on that sample's trained tokens.
"""

from __future__ import annotations

import os

import ray
import torch

from miles_ray.types import RolloutBatch, Sample


def fetch_samples(group_refs: list) -> list[Sample]:
    """The samples of ``group_refs`` (``GroupRef`` list), in order."""
    return [s for group in ray.get([g.ref for g in group_refs]) for s in group]


def masked_lists(full: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """Per sample, the entries of ``full`` ``[B, T]`` where ``mask`` ``[B, T]`` is set."""
    return [full[i][mask[i] > 0].tolist() for i in range(full.shape[0])]


def from_masked_lists(lists: list[list[float]], mask: torch.Tensor, field: str) -> torch.Tensor:
    """Inverse of ``masked_lists``: a ``[B, T]`` tensor, 0 off the mask.

    Raises:
        ValueError: if the lists do not match the mask (``field`` names the argument).

    """
    if len(lists) != mask.shape[0]:
        raise ValueError(f"{field}: {len(lists)} samples given, the batch has {mask.shape[0]}")
    out = torch.zeros(mask.shape, dtype=torch.float32)
    for i, values in enumerate(lists):
        where = mask[i] > 0
        if len(values) != int(where.sum()):
            raise ValueError(f"{field}[{i}]: {len(values)} values for {int(where.sum())} trained tokens")
        out[i][where] = torch.tensor(values, dtype=torch.float32)
    return out


class Worker:
    """One rank of a group; subclasses build ``self.backend`` in ``setup`` (apply ``ray.remote`` via ``start_workers``).

    The backend says which data shard the rank works on (``dp_rank``, ``dp_size``) and gathers the shards back;
    model-parallel peers (Megatron's TP ranks) share a shard.
    """

    def __init__(self, rank: int, world_size: int, config):
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.backend = None
        self._store = None  # rank 0: the process group's rendezvous store (host_rendezvous)

    def __repr__(self) -> str:
        # the dashboard's Actors tab and log prefixes show it (Ray takes it once, after __init__)
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    def host_rendezvous(self) -> tuple[str, int]:
        """Rank 0: open the process group's rendezvous store (``open_store``: no port race); its host and port."""
        from miles_ray.sync.broadcast import open_store

        host = ray.util.get_node_ip_address()
        self._store = open_store(host, self.world_size)
        return host, self._store.port

    def node_id(self) -> str:
        """The Ray node this rank runs on (two Ray nodes may share one host and IP)."""
        return ray.get_runtime_context().get_node_id()

    def init(self, master_addr: str, master_port: int) -> None:
        """Join the group's process group, seed torch, build the backend."""
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        collective = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        store = self._store
        if store is None:  # not rank 0: a client of rank 0's
            store = dist.TCPStore(master_addr, master_port, self.world_size, is_master=False)
        dist.init_process_group(collective, store=store, rank=self.rank, world_size=self.world_size)
        torch.manual_seed(self.config.seed)
        self.setup()

    def setup(self) -> None:
        """Build the backend (called once the process group exists)."""
        raise NotImplementedError

    @property
    def data_shard(self) -> tuple[int, int]:
        """``(data-parallel rank, size)``: which samples this rank works on (``RolloutBatch.shard``)."""
        return self.backend.dp_rank, self.backend.dp_size

    def batch(self, group_refs: list) -> tuple[RolloutBatch, list[Sample]]:
        """The whole padded batch of ``group_refs`` and its samples (every rank builds the same one)."""
        samples = fetch_samples(group_refs)
        return RolloutBatch.from_samples(samples, 0), samples

    def gather_masked(self, batch: RolloutBatch, local: torch.Tensor) -> list[list[float]] | None:
        """Collective: rank 0 returns every sample's trained-token entries of the ranks' ``local`` shards."""
        full = self.backend.gather_shards(local)[: batch.num_samples]  # filler rows (``RolloutBatch.shard``) last
        return masked_lists(full, batch.response_mask) if self.rank == 0 else None


def start_workers(placement, cls: type, role: str, count_field: str, config, *args) -> list:
    """Start ``config.num_ranks`` ``cls(rank, num_ranks, config, *args)`` workers on the ``role`` slots.

    Returns once their process group is up and every rank has run ``setup``.
    """
    n = config.num_ranks
    workers = placement.spawn(cls, role, count_field, n, lambda rank: (rank, n, config, *args))
    addr, port = ray.get(workers[0].host_rendezvous.remote())
    ray.get([w.init.remote(addr, port) for w in workers])
    return workers
