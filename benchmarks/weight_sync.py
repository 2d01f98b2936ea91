"""Weight-sync bandwidth through the real actors, against two references measured in the same run.

Runs a TrainerGroup (1 rank) and engines on a local Ray cluster (disaggregated bundles; one node) and syncs the
model with each transport, verification off (the transfer itself), on (every byte hashed on both sides, what a
run does by default) and ``sampled`` (1/64 of the bytes hashed: ``WeightBroadcasterConfig.verify``). The whole sync,
``seconds``, is compared with

- ``torch.Tensor.copy_`` of the same bytes into a buffer that already exists (memcpy, one thread: every actor here
  computes on one), for ``shared_memory``;
- a raw gloo broadcast of the same bytes between two actors of the same cluster, in the same bucket sizes, all
  queued at once as the sync queues them, for ``broadcast`` (what the transport could reach if gathering, loading
  and hashing cost nothing).

Each sync is timed right after one run of its reference, so both sample the same moments of a machine whose memory
speed drifts (on a 2-core VM the same copy took 19-50 ms within a minute); a row's ``fraction`` is the best
reference over the best sync of those pairs.

    python benchmarks/weight_sync.py --model smollm2-135m --engines 1
    python benchmarks/weight_sync.py --dtype bfloat16      # bf16 engines: the sync sends bf16 (half the bytes)
    python benchmarks/weight_sync.py --dtype bfloat16 --no-weight-copy   # ... cast from the fp32 weights each sync

The trainer runs the quick-start's precision (``autocast="auto"``): where that is bf16 a DDP rank keeps a bf16
copy of its weights (``backends.weight_copy``), written after each optimizer step, and a bf16 sync sends it.
"""

import argparse
import os
import time

import ray
import torch
from common import emit

from miles_ray import placement
from miles_ray.actors import WeightBroadcaster, WeightBroadcasterConfig
from miles_ray.models.hub import MODELS, model_dir
from miles_ray.stack import StackConfig, build_stack

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
p.add_argument("--engines", type=int, default=1)
p.add_argument("--repeats", type=int, default=10, help="syncs per transport, each after a reference run")
p.add_argument("--bucket-mb", type=int, default=64)
p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="what the engines hold and get")
p.add_argument(
    "--parallel",
    choices=["ddp", "fsdp2"],
    default="ddp",
    help="the trainer's wrapping: DDP (the quick-start's; a sync in the parameters' dtype sends them in place), FSDP2",
)
p.add_argument(
    "--no-weight-copy",
    action="store_true",
    help="no bf16 weight copy on the trainer: a bf16 sync casts the fp32 weights (the behaviour before it)",
)
p.add_argument(
    "--verify",
    nargs="+",
    choices=["off", "full", "sampled"],
    default=["off", "full", "sampled"],
    help="verification modes to run (WeightBroadcasterConfig.verify False / True / 'sampled')",
)
args = p.parse_args()
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
path = str(model_dir(args.model))


@ray.remote(num_cpus=0)
class Peer:
    """One end of a raw gloo broadcast (the reference for the broadcast transport)."""

    def __init__(self):
        self.store = None  # rank 0: the rendezvous store it opened (host)
        self.buffers = None  # the buckets, made on the first run

    def host(self) -> tuple[str, int]:
        """Rank 0: open the group's rendezvous store; its host and port."""
        from miles_ray.sync.broadcast import open_store

        self.store = open_store(ray.util.get_node_ip_address(), 2)
        return self.store.host, self.store.port

    def join(self, host: str, port: int, rank: int) -> None:
        """Join the two-rank gloo group (rank 0 on the store it opened)."""
        from miles_ray.sync.broadcast import BroadcastGroup

        self.group = BroadcastGroup.create(host, port, rank, 2, "gloo", store=self.store)

    def run(self, bucket_sizes: list[int]) -> float:
        """Seconds of one broadcast of every bucket, all queued at once (rank 0 sends, rank 1 receives)."""
        if self.buffers is None:
            self.buffers = [torch.ones(n, dtype=torch.uint8) for n in bucket_sizes]
        start = time.perf_counter()
        for work in [self.group.broadcast(b, async_op=True) for b in self.buffers]:
            work.wait()
        return time.perf_counter() - start


class Memcpy:
    """``copy_`` of the bytes into a buffer that exists, on one thread as every actor here computes."""

    def __init__(self, nbytes: int):
        torch.set_num_threads(1)
        self.src, self.dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        self()  # the destination's pages exist

    def __call__(self) -> float:
        """Seconds of one copy."""
        start = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - start


class Gloo:
    """A raw gloo broadcast of the plan's buckets between two actors."""

    def __init__(self, bucket_sizes: list[int]):
        self.sizes, self.peers = bucket_sizes, [Peer.remote(), Peer.remote()]
        host, port = ray.get(self.peers[0].host.remote())
        ray.get([peer.join.remote(host, port, rank) for rank, peer in enumerate(self.peers)])
        self()  # the connection is up

    def __call__(self) -> float:
        """Seconds of one broadcast of every bucket (the slower of sender and receiver)."""
        return max(ray.get([peer.run.remote(self.sizes) for peer in self.peers]))


def best_sync(transport: str, verify: bool | str, reference) -> tuple[dict, float]:
    """The fastest of ``--repeats`` syncs, and the fastest of the reference runs, one right before each sync."""
    config = WeightBroadcasterConfig(transport=transport, verify=verify, bucket_bytes=args.bucket_mb << 20)
    wb = WeightBroadcaster.remote(config, workers, engines)
    ray.get(wb.sync.remote(0))  # warm-up: group setup, buffers allocated and mapped
    pairs = [(reference(), ray.get(wb.sync.remote(i + 1))) for i in range(args.repeats)]
    ray.kill(wb)
    return min((r for _, r in pairs), key=lambda r: r["seconds"]), min(s for s, _ in pairs)


def copy_write_seconds(worker, repeats: int) -> float | None:
    """Run in the trainer rank: its best ``WeightCopy.refresh`` (what each optimizer step adds), None without a copy."""
    copy = worker.backend.weight_copy
    if copy is None:
        return None
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copy.refresh(force=True)
        best = min(best, time.perf_counter() - start)
    return best


engine = {"model_path": path, "dtype": args.dtype}
backend = {"parallel": args.parallel, "autocast": "auto", "weight_copy": not args.no_weight_copy}
trainer = {"model_path": path, "backend": backend}
config = StackConfig(trainer=trainer, pool={"num_engines": args.engines, "engine": engine})
stack = build_stack(config, placement.create(placement.disaggregated(1, args.engines)))
engines, workers = list(stack.engines), ray.get(stack.trainer.workers.remote())
plan = ray.get(workers[0].sync_plan.remote(args.dtype, args.bucket_mb << 20))
nbytes = plan.total_bytes
references = {"shared_memory": Memcpy(nbytes), "broadcast": Gloo([b.nbytes for b in plan.buckets])}
labels = {"shared_memory": "memcpy (reference)", "broadcast": "raw gloo broadcast (reference)"}
best_reference, rows = {}, []
for transport in ["broadcast", "shared_memory"]:
    for verify in [{"off": False, "full": True, "sampled": "sampled"}[v] for v in args.verify]:
        r, reference_s = best_sync(transport, verify, references[transport])
        best_reference[transport] = min(best_reference.get(transport, reference_s), reference_s)
        row = {"transport": transport, "verify": verify, "seconds": r["seconds"], "reference_seconds": reference_s}
        rows.append(row | {"fraction": reference_s / r["seconds"]})  # of the reference's speed on the same bytes
rows[:0] = [{"transport": labels[t], "verify": None, "seconds": best_reference[t], "fraction": 1.0} for t in references]
# the trainer keeps a copy where its autocast "auto" is bf16 (this CPU computes bf16 natively), with DDP
seconds = ray.get(workers[0].__ray_call__.remote(copy_write_seconds, args.repeats))
copy = seconds is not None
if copy and args.dtype == "bfloat16":  # not in the sync: in the optimizer step, whose forwards read the copy too
    label = "copy written by the step (not in the sync)"
    rows.append(
        {"transport": label, "verify": None, "seconds": seconds, "fraction": best_reference["shared_memory"] / seconds}
    )
for row in rows:
    row["gb_per_s"] = nbytes / row["seconds"] / 1e9
print(
    f"model {args.model}: {nbytes / 1e6:.0f} MB {args.dtype}, {args.engines} engine(s), one node, "
    f"trainer {args.parallel}, bf16 weight copy {copy}; "
    "fraction = reference / sync, each sync paired with a reference run just before it"
)
name = [a for a in (args.dtype, args.parallel) if a not in ("float32", "ddp")]
emit("_".join(["weight_sync", *name] + (["no_copy"] if args.no_weight_copy else [])), rows)
