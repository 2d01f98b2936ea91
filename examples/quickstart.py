"""Quick-start: GRPO on reasoning-gym arithmetic with SmolLM2-135M-Instruct, through the five miles_ray actors.

Runs on a laptop CPU (2 cores: ~15 minutes) and, unchanged, on a GPU cluster (pass --address auto).

    python examples/quickstart.py --topology colocated --steps 30
"""

import argparse
import json
import os
import time
from pathlib import Path

import ray
from tqdm import tqdm
from transformers import AutoTokenizer

from miles_ray import placement
from miles_ray.actors import (
    ReplayBuffer,
    ReplayBufferConfig,
    RolloutPool,
    RolloutPoolConfig,
    Router,
    RouterConfig,
    TrainerGroup,
    TrainerGroupConfig,
    WeightBroadcaster,
    WeightBroadcasterConfig,
)
from miles_ray.engines.base import SamplingParams
from miles_ray.engines.embedded import EmbeddedEngineConfig
from miles_ray.models.hub import smollm2_135m_dir, tiny_llama_dir
from miles_ray.report import plot_run
from miles_ray.rewards import ReasoningGymTask, ReasoningGymTaskConfig
from miles_ray.rollout import generate_groups

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--topology", choices=["colocated", "disaggregated"], default="colocated")
p.add_argument("--model", choices=["smollm2-135m", "tiny"], default="smollm2-135m")
p.add_argument("--steps", type=int, default=25)
p.add_argument("--num-ranks", type=int, default=2, help="trainer ranks (and engines)")
p.add_argument("--prompts-per-step", type=int, default=8)
p.add_argument("--group-size", type=int, default=8)
p.add_argument("--max-new-tokens", type=int, default=24)
p.add_argument("--lr", type=float, default=1e-5)
p.add_argument("--out", default="runs/quickstart")
p.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
args = p.parse_args()

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray.init(address=args.address, num_cpus=None if args.address else max(8, os.cpu_count() or 1))
model_path = str(smollm2_135m_dir() if args.model == "smollm2-135m" else tiny_llama_dir())
out_dir = Path(args.out)
out_dir.mkdir(parents=True, exist_ok=True)
n = args.num_ranks
gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= n else 0.0

# --- topology: one placement group, five actors -----------------------------------------------
if args.topology == "colocated":
    plan, transport = placement.colocated(n, cpus_per_bundle=1, gpus_per_bundle=gpus), "shared_memory"
else:
    plan, transport = placement.disaggregated(n, n, gpus_per_trainer=gpus, gpus_per_engine=gpus), "broadcast"
pl = placement.create(plan)
temperature = 1.0
trainer = TrainerGroup.options(name="miles_ray/trainer").remote(
    TrainerGroupConfig(
        model_path=model_path,
        num_ranks=n,
        temperature=temperature,
        optimizer={"lr": args.lr},
        backend={"micro_batch_size": 32, "autocast": "bfloat16"},
    ),
    pl,
)
pool = RolloutPool.options(name="miles_ray/rollout_pool").remote(
    RolloutPoolConfig(num_engines=n, engine=EmbeddedEngineConfig(model_path=model_path)), pl
)
engines = ray.get(pool.engines.remote())
router = Router.options(name="miles_ray/router").remote(RouterConfig(), engines)
buffer = ReplayBuffer.options(name="miles_ray/replay_buffer").remote(ReplayBufferConfig(max_staleness=0))
broadcaster = WeightBroadcaster.options(name="miles_ray/weight_broadcaster").remote(
    WeightBroadcasterConfig(transport=transport), ray.get(trainer.workers.remote()), engines
)

task = ReasoningGymTask(
    ReasoningGymTaskConfig(
        dataset="basic_arithmetic",
        seed=1,
        instruction="Answer with the final number only.",
        dataset_kwargs={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]},
    ),
    AutoTokenizer.from_pretrained(model_path),
)
sampling = SamplingParams(n=args.group_size, max_new_tokens=args.max_new_tokens, temperature=temperature)

# --- the GRPO loop: rollout -> buffer -> train -> sync ---------------------------------------
log = open(out_dir / "metrics.jsonl", "w")
version = ray.get(trainer.weight_version.remote())
ray.get(broadcaster.sync.remote(version))
bar = tqdm(range(args.steps), desc="GRPO")
for step in bar:
    t0 = time.perf_counter()
    groups = generate_groups(router, task, sampling, args.prompts_per_step)
    ray.get(buffer.add.remote(groups))
    batch = ray.get(buffer.get_batch.remote(args.prompts_per_step, current_version=version))
    samples = [s for g in ray.get([g.ref for g in batch]) for s in g]
    t1 = time.perf_counter()
    metrics = ray.get(trainer.train_step.remote(batch))
    t2 = time.perf_counter()
    version = metrics["weight_version"]
    sync = ray.get(broadcaster.sync.remote(version))
    t3 = time.perf_counter()
    record = {
        "step": step,
        "weight_version": version,
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
        "kl": metrics["train_rollout_k3_kl"],
        "clipfrac": metrics["clipfrac"],
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "logprob_diff_max": metrics["train_rollout_logprob_abs_diff_max"],
        "rollout_s": t1 - t0,
        "train_s": t2 - t1,
        "sync_s": t3 - t2,
        "step_s": t3 - t0,
        "sync_gb_per_s": sync["gb_per_s"],
        "example": samples[0].response_text[:80],
    }
    log.write(json.dumps(record) + "\n")
    log.flush()
    bar.set_postfix(
        reward=f"{record['reward_mean']:.3f}",
        len=f"{record['response_len_mean']:.1f}",
        step_s=f"{record['step_s']:.1f}",
        sync_s=f"{record['sync_s']:.2f}",
    )
log.close()
print("reward curve:", plot_run(out_dir / "metrics.jsonl"))
first, last = (
    [json.loads(x) for x in open(out_dir / "metrics.jsonl")][:5],
    [json.loads(x) for x in open(out_dir / "metrics.jsonl")][-5:],
)
print(
    f"mean reward, first 5 steps: {sum(r['reward_mean'] for r in first) / len(first):.3f}; "
    f"last 5 steps: {sum(r['reward_mean'] for r in last) / len(last):.3f}"
)
