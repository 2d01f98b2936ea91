"""GPU check (issue #4): SGLang engines + Megatron trainer + NCCL weight sync on one lent GPU machine.

SmolLM2-135M: a Megatron-core trainer (TP=1, on its own GPU bundle) and one SGLang server (another GPU) as a
disaggregated pair; the WeightBroadcaster syncs over NCCL (trainer rank 0 and the server's TP rank in one group).
Prints sync seconds / GB/s (bf16 weights, every sync verified by the broadcaster's probe checksum) and SGLang
generation tokens/s, side by side with the same sync over gloo (ratio). Run by
``benchmarks/gpu_check.sh``; needs >= 2 GPUs (one with ``--single-gpu``: trainer and server share it).
"""

from __future__ import annotations

import argparse
import os
import time

import ray

from benchmarks.common import emit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sglang-python", default=os.environ.get("MILES_RAY_SGLANG_PYTHON", "python"))
    p.add_argument("--single-gpu", action="store_true", help="Trainer and server share one GPU (colocated bundle).")
    p.add_argument("--num-prompts", type=int, default=64)
    a = p.parse_args()

    from miles_ray import placement
    from miles_ray.actors import (
        RolloutPool,
        RolloutPoolConfig,
        Router,
        RouterConfig,
        TrainerGroup,
        TrainerGroupConfig,
        WeightBroadcaster,
        WeightBroadcasterConfig,
    )
    from miles_ray.engines.base import GenerateRequest, SamplingParams
    from miles_ray.engines.sglang import SGLangEngineConfig
    from miles_ray.models.hub import smollm2_135m_dir

    ray.init()
    model = str(smollm2_135m_dir())
    if a.single_gpu:
        plan = placement.colocated(1, gpus_per_bundle=1)
    else:
        plan = placement.disaggregated(1, 1, gpus_per_trainer=1, gpus_per_engine=1)
    pl = placement.create(plan)
    engine = SGLangEngineConfig(model_path=model, python=a.sglang_python, device="cuda", dtype="bfloat16",
                                max_total_tokens=None, mem_fraction_static=0.3 if a.single_gpu else 0.7)  # fmt: skip
    pool = RolloutPool.remote(RolloutPoolConfig(engine=engine), pl)
    engines = ray.get(pool.engines.remote())
    trainer = TrainerGroup.remote(TrainerGroupConfig(model_path=model, backend={"kind": "megatron"}), pl)
    workers = ray.get(trainer.workers.remote())
    rows = []
    for backend in ("nccl", "gloo"):
        wb = WeightBroadcaster.remote(
            WeightBroadcasterConfig(transport="broadcast", backend=backend, engine_dtype="bfloat16"), workers, engines
        )
        reports = [ray.get(wb.sync.remote(v)) for v in (1, 2, 3)]  # the first includes forming the group
        best = min(reports[1:], key=lambda r: r["transfer_seconds"])
        rows.append({"what": f"sync {backend}", "bytes": best["bytes"], "seconds": best["transfer_seconds"],
                     "gb_per_s": best["gb_per_s"]})  # fmt: skip
    rows.append({"what": "nccl/gloo", "bytes": rows[0]["bytes"], "seconds": rows[0]["seconds"] / rows[1]["seconds"],
                 "gb_per_s": rows[0]["gb_per_s"] / rows[1]["gb_per_s"]})  # fmt: skip
    router = Router.remote(RouterConfig(), engines)
    params = SamplingParams(n=8, max_new_tokens=256, ignore_eos=True)
    start = time.perf_counter()
    requests = [GenerateRequest([1] + [100 + i] * 16, params) for i in range(a.num_prompts)]
    outs = ray.get([router.generate.remote(r) for r in requests])
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
    rows.append({"what": "sglang generate", "bytes": tokens, "seconds": seconds, "gb_per_s": tokens / seconds})
    emit("gpu_check", rows)
    print("(generate row: bytes = tokens, gb_per_s = tokens/s)")


if __name__ == "__main__":
    main()
