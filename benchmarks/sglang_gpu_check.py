"""SGLang GPU check (issue #4): SGLang engines + Megatron trainer + NCCL weight sync, on a GPU machine with PyPI.

SGLang's CUDA build is installed there; it cannot be carried to the lent GPU machine (whose check is
``benchmarks/gpu_check.py``).

SmolLM2-135M: a Megatron-core trainer (TP=1, on its own GPU bundle) and one SGLang server (another GPU) as a
disaggregated pair; the WeightBroadcaster syncs over NCCL (trainer rank 0 and the server's TP rank in one group).
Prints sync seconds / GB/s (bf16 weights, every sync verified by the broadcaster's probe checksum) and SGLang
generation tokens/s, side by side with the same sync over gloo (ratio). Then a colocated round: the server
releases its memory (``enable_memory_saver``) around a Megatron train step, takes it back, gets the new weights
and generates again. Run by ``benchmarks/sglang_gpu_check.sh``; needs >= 2 GPUs (one with ``--single-gpu``).

``--device cpu`` runs the same script on this project's CPU machine (tiny Llama, SGLang's CPU path from
``.venv-sglang``, gloo only, no memory saver): it checks the script itself, and its figures are no GPU figures.
"""

from __future__ import annotations

import argparse
import os
import time

import ray

from benchmarks.common import emit


def _generate(router, params, num_prompts: int, what: str, rows: list[dict]):
    """``num_prompts`` requests through ``router``; appends their tokens/s to ``rows``; returns the outputs."""
    from miles_ray.engines.requests import GenerateRequest

    start = time.perf_counter()
    requests = [GenerateRequest([1] + [100 + i] * 16, params) for i in range(num_prompts)]
    outs = ray.get([router.generate.remote(r) for r in requests])
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
    rows.append({"what": what, "bytes": None, "seconds": seconds, "gb_per_s": None, "tokens_per_s": tokens / seconds})
    return outs


def _disaggregated(a, megatron, engine_kw: dict, params, rows: list[dict]):
    """Trainer and server on their own bundles: syncs over NCCL and gloo (ratio), then generation; its outputs."""
    from miles_ray import placement
    from miles_ray.actors import RolloutPoolConfig, WeightBroadcaster, WeightBroadcasterConfig
    from miles_ray.engines.sglang import SGLangEngineConfig
    from miles_ray.stack import StackConfig, build_stack

    gpu = a.device == "cuda"
    if a.single_gpu or not gpu:
        plan = placement.colocated(1, gpus_per_bundle=1 if gpu else 0)
    else:
        plan = placement.disaggregated(1, 1, gpus_per_trainer=1, gpus_per_engine=1)
    stack = build_stack(
        StackConfig(trainer=megatron, pool=RolloutPoolConfig(engine=SGLangEngineConfig(**engine_kw))),
        placement.create(plan),
    )
    workers, engines = ray.get(stack.trainer.workers.remote()), list(stack.engines)
    for collective in ("nccl", "gloo") if gpu else ("gloo",):
        config = WeightBroadcasterConfig(transport="broadcast", collective=collective, engine_dtype=engine_kw["dtype"])
        wb = WeightBroadcaster.remote(config, workers, engines)
        reports = [ray.get(wb.sync.remote(v)) for v in (1, 2, 3)]  # the first includes forming the group
        best = min(reports[1:], key=lambda r: r["transfer_seconds"])
        rows.append(
            {
                "what": f"sync broadcast {collective}",
                "bytes": best["bytes"],
                "seconds": best["transfer_seconds"],
                "gb_per_s": best["gb_per_s"],
                "tokens_per_s": None,
            }
        )
    if gpu:
        ratio = {
            "seconds": rows[0]["seconds"] / rows[1]["seconds"],
            "gb_per_s": rows[0]["gb_per_s"] / rows[1]["gb_per_s"],
        }
        rows.append({"what": "nccl / gloo (ratio)", "bytes": None, **ratio, "tokens_per_s": None})
    outs = _generate(stack.router, params, a.num_prompts, "sglang generate", rows)
    ray.get(engines[0].shutdown.remote())
    stack.shutdown()
    return outs


def _colocated(a, megatron, engine_kw: dict, params, outs, rows: list[dict]) -> None:
    """The server frees its memory around a train step, takes it back and the new weights, and generates again."""
    from miles_ray import placement
    from miles_ray.actors import RolloutPoolConfig, WeightBroadcasterConfig
    from miles_ray.engines.sglang import SGLangEngineConfig
    from miles_ray.stack import StackConfig, build_stack
    from miles_ray.types import GroupRef, Sample

    gpu = a.device == "cuda"
    config = SGLangEngineConfig(**{**engine_kw, "enable_memory_saver": gpu})
    if gpu:
        config = config.model_copy(update={"mem_fraction_static": 0.3})
    stack = build_stack(
        StackConfig(
            trainer=megatron,
            pool=RolloutPoolConfig(engine=config),
            broadcaster=WeightBroadcasterConfig(transport="shared_memory", engine_dtype=engine_kw["dtype"]),
        ),
        placement.create(placement.colocated(1, gpus_per_bundle=1 if gpu else 0)),
    )
    pool, trainer, wb, engines = stack.pool, stack.trainer, stack.broadcaster, stack.engines
    ray.get(wb.sync.remote(0))
    samples = [
        Sample([1] + [100 + j] * 16, c.token_ids, c.logprobs, reward=float(i % 2))
        for j, o in enumerate(outs[:2])
        for i, c in enumerate(o.completions)
    ]
    start = time.perf_counter()
    ray.get(pool.release_memory.remote())
    released = time.perf_counter()
    metrics = ray.get(trainer.train_step.remote([GroupRef(ray.put(samples), len(samples), 0, 0)]))
    trained = time.perf_counter()
    ray.get(pool.resume_memory.remote("weights"))
    report = ray.get(wb.sync.remote(metrics["weight_version"]))  # verified: raises on a probe mismatch
    ray.get(pool.resume_memory.remote("kv_cache"))
    seconds = (released - start) + (time.perf_counter() - trained)
    rows.append(
        {
            "what": "colocated release+resume+sync",
            "bytes": report["bytes"],
            "seconds": seconds,
            "gb_per_s": report["gb_per_s"],
            "tokens_per_s": None,
        }
    )
    after = _generate(stack.router, params, a.num_prompts, "sglang generate after resume", rows)
    assert all(o.weight_version == metrics["weight_version"] for o in after)
    ray.get(engines[0].shutdown.remote())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sglang-python", default=os.environ.get("MILES_RAY_SGLANG_PYTHON", "python"))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--single-gpu", action="store_true", help="Trainer and server share one GPU (colocated bundle).")
    p.add_argument("--num-prompts", type=int, default=64)
    a = p.parse_args()

    from miles_ray.actors import TrainerGroupConfig
    from miles_ray.engines.requests import SamplingParams
    from miles_ray.models.hub import smollm2_135m_dir, tiny_llama_dir

    gpu = a.device == "cuda"
    ray.init(**({} if gpu else {"num_cpus": 8}))
    model = str(smollm2_135m_dir() if gpu else tiny_llama_dir())
    dtype = "bfloat16" if gpu else "float32"
    engine_kw = dict(model_path=model, python=a.sglang_python, device=a.device, dtype=dtype)
    if gpu:
        engine_kw.update(max_total_tokens=None, mem_fraction_static=0.3 if a.single_gpu else 0.7)
    megatron = TrainerGroupConfig(model_path=model, optimizer={"lr": 1e-4}, backend={"kind": "megatron"})
    params = SamplingParams(n=8, max_new_tokens=256 if gpu else 32, ignore_eos=True)
    rows: list[dict] = []
    outs = _disaggregated(a, megatron, engine_kw, params, rows)
    _colocated(a, megatron, engine_kw, params, outs, rows)
    emit(f"sglang_gpu_check_{a.device}", rows)
    if not gpu:
        print("(device cpu: a check of this script on the CPU machine; no GPU figures)")


if __name__ == "__main__":
    main()
