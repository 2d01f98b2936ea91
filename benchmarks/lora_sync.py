"""LoRA adapter sync vs full weight sync: bytes and seconds per sync through the real actors, side by side.

For each trainer setting (all weights; LoRA rank R on the attention projections; LoRA rank R on every linear
layer) a fresh TrainerGroup (1 rank) and engine pool sync with each transport, verification on (the path a run
takes); the table gives the median sync of ``--repeats`` and the ratios to the full sync in the same run.

    python benchmarks/lora_sync.py --model smollm2-135m --rank 16
"""

import argparse
import os
import statistics

import ray
from common import emit

from miles_ray import placement
from miles_ray.actors import WeightBroadcaster, WeightBroadcasterConfig
from miles_ray.models.hub import MODELS, model_dir
from miles_ray.stack import StackConfig, build_stack

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
p.add_argument("--rank", type=int, default=16)
p.add_argument("--engines", type=int, default=1)
p.add_argument("--repeats", type=int, default=5)
args = p.parse_args()
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
path = str(model_dir(args.model))
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
SETTINGS = {
    "full weights": None,
    f"lora r{args.rank} attention": {"rank": args.rank, "alpha": 2 * args.rank, "target_modules": ATTENTION},
    f"lora r{args.rank} all linear": {"rank": args.rank, "alpha": 2 * args.rank, "target_modules": ALL_LINEAR},
}


def measure(lora: dict | None) -> list[dict]:
    """Median sync of each transport for one trainer setting, on fresh actors (an engine holds one adapter spec)."""
    engine = {"model_path": path, "kv_cache_memory_gb": 0.25, "max_seq_len": 256}
    config = StackConfig(
        trainer={"model_path": path, "backend": {"lora": lora}}, pool={"num_engines": args.engines, "engine": engine}
    )
    stack = build_stack(config, placement.create(placement.disaggregated(1, args.engines)))
    engines, workers = list(stack.engines), ray.get(stack.trainer.workers.remote())
    rows = []
    for transport in ["broadcast", "shared_memory"]:
        wb = WeightBroadcaster.remote(WeightBroadcasterConfig(transport=transport), workers, engines)
        ray.get(wb.sync.remote(0))  # warm-up: group setup, adapter install
        reports = [ray.get(wb.sync.remote(i + 1)) for i in range(args.repeats)]
        plan = ray.get(workers[0].sync_plan.remote("float32", 64 << 20))
        rows.append(
            {
                "transport": transport,
                "tensors": len(plan.names),
                "mb": reports[0]["bytes"] / 1e6,
                "seconds": statistics.median(r["seconds"] for r in reports),
                "transfer_s": statistics.median(r["transfer_seconds"] for r in reports),
            }
        )
        ray.kill(wb)
    stack.shutdown()
    return rows


results = {name: measure(lora) for name, lora in SETTINGS.items()}
full = {r["transport"]: r for r in results["full weights"]}
rows = []
for name, measured in results.items():
    for r in measured:
        base = full[r["transport"]]
        rows.append(
            {"setting": name, **r, "bytes_ratio": base["mb"] / r["mb"], "seconds_ratio": base["seconds"] / r["seconds"]}
        )
print(f"model {args.model}, {args.engines} engine(s), fp32 engines, verify on; ratio = full sync / this sync")
emit("lora_sync", rows)
