"""Megatron MoE layouts side by side: step time and peak RSS per rank, and the routing-replay mismatch table.

An embedded engine (bf16) samples ``--prompts x --group-size`` responses from an MoE and records every token's
experts. Then, one layout at a time (so they do not share the cores), a Megatron ``TrainerGroup`` (fp32) trains on
that same batch for ``--steps`` steps:

- ``EP=1``: one rank holds every expert; ``EP=2``: two ranks, each half of the experts of every MoE layer (and
  data-parallel peers for the rest); ``PP=2``: two pipeline stages, half of the layers each, micro-batches through
  megatron's 1F1B schedule.
- ``replay``: routing replay on (the engine's experts drive the trainer's routers) or off (compared only).

Columns: mean step seconds over the steps after the first (the first pays warm-up), and the step time relative to
EP=1 with the same replay setting; peak RSS of each rank (``ru_maxrss``: weights, grads, Adam state and the
largest activations); from the first step's forward (the engine's weights, before any update): the share of
(token, layer) top-k sets the trainer's routers choose unlike the engine's, mean/max |train - rollout| logprob and
k3 KL(rollout || trainer). A layout at 2 ranks does the work of one rank on two cores, so on the 2-core machine its
time ratio shows the parallel overheads (all-gathers, pipeline bubble) against the halved compute per rank.

The default model is SmolLM2-135M sparse-upcycled to 4 experts, top-2 (``models.hub.upcycled_moe_dir``);
``--model tiny-qwen3-moe`` is the random test model (4 layers: MoE 0, 2, 3).

    python benchmarks/moe_parallel.py
"""

import argparse
import resource
import time

import ray
import torch
from common import arithmetic_prompts, emit
from transformers import AutoTokenizer

from miles_ray import placement
from miles_ray.actors import TrainerGroup, TrainerGroupConfig
from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.models.hub import model_dir, tiny_qwen3_moe_dir
from miles_ray.types import GroupRef, Sample

LAYOUTS = {  # name -> (ranks, MegatronParallelConfig fields)
    "EP=1": (1, {}),
    "EP=2": (2, {"expert_model_parallel_size": 2}),
    "PP=2": (2, {"pipeline_model_parallel_size": 2}),
}

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", choices=["smollm2-moe", "tiny-qwen3-moe"], default="smollm2-moe")
p.add_argument("--prompts", type=int, default=4)
p.add_argument("--group-size", type=int, default=4)
p.add_argument("--new-tokens", type=int, default=32)
p.add_argument("--steps", type=int, default=3, help="train steps per layout (the first is not timed)")
p.add_argument("--micro-batch-size", type=int, default=4, help="samples per micro-batch (PP: several per step)")
p.add_argument("--layouts", default="EP=1,EP=2,PP=2", help=f"comma-separated, of {list(LAYOUTS)}")
args = p.parse_args()
torch.set_num_threads(1)


def rollout(path: str) -> list[GroupRef]:
    """One batch from a bf16 embedded engine, routes recorded; rewards rank the samples of each group."""
    tok = AutoTokenizer.from_pretrained(path)
    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=path, dtype="bfloat16", max_seq_len=512))
    params = SamplingParams(n=args.group_size, max_new_tokens=args.new_tokens, seed=0)
    prompts = arithmetic_prompts(tok, args.prompts)
    outs = engine.generate([GenerateRequest(ids, params) for ids in prompts])
    groups = []
    for g, (ids, out) in enumerate(zip(prompts, outs)):
        samples = [
            Sample(ids, c.token_ids, c.logprobs, reward=float(i), group_id=g, routes=c.routes)
            for i, c in enumerate(out.completions)
        ]
        groups.append(GroupRef(ray.put(samples), len(samples), 0, g))
    return groups


def peak_rss_gb(actor) -> float:
    """Peak resident memory of the worker process (Linux: ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def measure(path: str, layout: str, replay: bool, batch: list[GroupRef]) -> dict:
    """``args.steps`` steps of one layout on ``batch``: times, first-step mismatch, peak RSS per rank."""
    ranks, parallel = LAYOUTS[layout]
    backend = {"kind": "megatron", "parallel": parallel, "routing_replay": replay}
    backend["micro_batch_size"] = args.micro_batch_size
    config = TrainerGroupConfig(model_path=path, num_ranks=ranks, optimizer={"lr": 1e-6}, backend=backend)
    pl = placement.create(placement.colocated(ranks))
    try:
        group = TrainerGroup.remote(config, pl)
        times, first = [], None
        for _ in range(args.steps):
            t0 = time.perf_counter()
            metrics = ray.get(group.train_step.remote(batch))
            times.append(time.perf_counter() - t0)
            first = first or metrics
        workers = ray.get(group.workers.remote())
        rss = ray.get([w.__ray_call__.remote(peak_rss_gb) for w in workers])
    finally:
        ray.util.remove_placement_group(pl.pg)  # kills the group and its ranks
    timed = times[1:] or times
    return {
        "layout": layout,
        "replay": "on" if replay else "off",
        "ranks": ranks,
        "step_s": sum(timed) / len(timed),
        "peak_rss_gb_per_rank": [round(r, 2) for r in rss],
        "route_mismatch_frac": first["moe_route_mismatch_frac"],
        "lp_abs_diff_mean": first["train_rollout_logprob_abs_diff_mean"],
        "lp_abs_diff_max": first["train_rollout_logprob_abs_diff_max"],
        "k3_kl": first["train_rollout_k3_kl"],
    }


def main() -> None:
    path = str(model_dir(args.model) if args.model != "tiny-qwen3-moe" else tiny_qwen3_moe_dir(num_layers=4))
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    batch = rollout(path)
    runs = [("EP=1", False)] + [(name, True) for name in args.layouts.split(",")]
    rows = [measure(path, layout, replay, batch) for layout, replay in runs]
    base = {r["replay"]: r["step_s"] for r in rows if r["layout"] == "EP=1"}
    for r in rows:
        r["step_vs_ep1"] = r["step_s"] / base[r["replay"]] if r["replay"] in base else float("nan")
    print(f"model {args.model}: engine bf16 (routes recorded), Megatron trainer fp32, {args.prompts}x{args.group_size}")
    emit("moe_parallel", rows)


if __name__ == "__main__":
    main()
