"""Weight-sync bandwidth through real actors vs a plain in-process memcpy of the same bytes.

Runs a TrainerGroup (1 rank) and engines on a local Ray cluster, syncs the model with each transport
(verification off, so the figure is the transfer itself, then on), and compares GB/s with
``torch.Tensor.copy_`` of a buffer the size of the model.

    python benchmarks/weight_sync.py --model smollm2-135m --engines 1
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
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--bucket-mb", type=int, default=64)
args = p.parse_args()
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
path = str(model_dir(args.model))

config = StackConfig(trainer={"model_path": path}, pool={"num_engines": args.engines, "engine": {"model_path": path}})
stack = build_stack(config, placement.create(placement.disaggregated(1, args.engines)))
engines, workers = list(stack.engines), ray.get(stack.trainer.workers.remote())


def best(transport: str, verify: bool) -> dict:
    config = WeightBroadcasterConfig(transport=transport, verify=verify, bucket_bytes=args.bucket_mb << 20)
    wb = WeightBroadcaster.remote(config, workers, engines)
    ray.get(wb.sync.remote(0))  # warm-up (and group setup for broadcast)
    reports = [ray.get(wb.sync.remote(i + 1)) for i in range(args.repeats)]
    return min(reports, key=lambda r: r["seconds"])


nbytes = ray.get(workers[0].sync_plan.remote("float32", args.bucket_mb << 20)).total_bytes
src, dst = torch.empty(nbytes // 4), torch.empty(nbytes // 4)
dst.copy_(src)
start = time.perf_counter()
for _ in range(args.repeats):
    dst.copy_(src)
memcpy_gbs = nbytes * args.repeats / (time.perf_counter() - start) / 1e9

rows = [
    {
        "transport": "memcpy (in process)",
        "verify": False,
        "seconds": nbytes / memcpy_gbs / 1e9,
        "gb_per_s": memcpy_gbs,
        "fraction_of_memcpy": 1.0,
    }
]
for transport in ["broadcast", "shared_memory"]:
    for verify in [False, True]:
        r = best(transport, verify)
        rows.append(
            {
                "transport": transport,
                "verify": verify,
                "seconds": r["seconds"],
                "gb_per_s": r["bytes"] / r["seconds"] / 1e9,
                "fraction_of_memcpy": r["bytes"] / r["seconds"] / 1e9 / memcpy_gbs,
            }
        )
print(f"model {args.model}: {nbytes / 1e6:.0f} MB fp32, {args.engines} engine(s)")
emit("weight_sync", rows)
