"""Fully async vs synchronous GRPO: samples/s and reward at equal samples, same model, task and resources.

Both runs use one trainer rank and one embedded engine on bundles of their own (disaggregated, weights
broadcast over gloo), the same trainer config (PPO-clip against the engine's logprobs, i.e. the behaviour
policy), the same task, seeds and number of train steps x groups per step, so both train on the same number
of samples. Sync: rollout, then train, then sync, one after another. Async: a ``RolloutWorker`` generates
non-stop into the ``ReplayBuffer`` (at most ``--ahead`` batches in buffer + flight, groups older than
``--max-staleness`` versions dropped) while the trainer trains and weights are pushed mid-generation (``--in-flight``).

    python benchmarks/async_vs_sync.py --steps 8 --prompts-per-step 8 --group-size 8
    python benchmarks/async_vs_sync.py --think --max-new-tokens 96 --steps 4 --name async_vs_sync_think

The speed-up async can give is bounded by how the sync step splits: rollout and (train + sync) run side by
side, so at most sync step / max(rollout, train + sync) (the ``overlap_bound`` column, measured in the sync run).
"""

import argparse
import os
import time

import ray
from common import emit
from transformers import AutoTokenizer

from miles_ray import actors, placement
from miles_ray.engines import SamplingParams
from miles_ray.engines.embedded import EmbeddedEngineConfig
from miles_ray.models.hub import MODELS, model_dir
from miles_ray.rewards import ReasoningGymTask, one_digit_arithmetic
from miles_ray.rollout import generate_groups

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--prompts-per-step", type=int, default=8)
p.add_argument("--group-size", type=int, default=8)
p.add_argument("--max-new-tokens", type=int, default=24)
p.add_argument("--lr", type=float, default=1e-5)
p.add_argument("--max-staleness", type=int, default=2)
p.add_argument("--ahead", type=int, default=1, help="async: batches the worker may hold in buffer + flight")
p.add_argument("--in-flight", choices=["continue", "finish", "abort_resume"], default="continue")
p.add_argument("--think", action="store_true", help="ask for reasoning before the answer: longer responses")
p.add_argument("--name", default="async_vs_sync", help="results name: benchmarks/results/NAME.json and NAME.png")
args = p.parse_args()

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
model_path = str(model_dir(args.model))
tokenizer = AutoTokenizer.from_pretrained(model_path)
sampling = SamplingParams(n=args.group_size, max_new_tokens=args.max_new_tokens, temperature=1.0)


def stack():
    """A fresh run: placement, trainer, one engine, router, broadcaster, task (same seeds every time)."""
    pl = placement.create(placement.disaggregated(1, 1))
    cfg = actors.TrainerGroupConfig(
        model_path=model_path, optimizer={"lr": args.lr}, old_logprobs="rollout",
        backend={"micro_batch_size": 32, "autocast": "auto"},
    )  # fmt: skip
    trainer = actors.TrainerGroup.remote(cfg, pl)
    pool_cfg = actors.RolloutPoolConfig(engine=EmbeddedEngineConfig(model_path=model_path, max_seq_len=512))
    pool = actors.RolloutPool.remote(pool_cfg, pl)
    engines = ray.get(pool.engines.remote())
    router = actors.Router.remote(actors.RouterConfig(), engines)
    wb_cfg = actors.WeightBroadcasterConfig(in_flight=args.in_flight)
    wb = actors.WeightBroadcaster.remote(wb_cfg, ray.get(trainer.workers.remote()), engines)
    ray.get(wb.sync.remote(0))
    task = one_digit_arithmetic(seed=1)
    if args.think:  # responses of tens of tokens instead of a few: rollout takes a larger share of a step
        think = "Think step by step in a few sentences, then give the final number."
        task = task.model_copy(update={"system_prompt": "You are a careful math tutor.", "instruction": think})
    return pl, trainer, pool, router, wb, ReasoningGymTask(task, tokenizer)


def rewards_of(batch) -> float:
    samples = [s for g in ray.get([g.ref for g in batch]) for s in g]
    return sum(s.reward for s in samples) / len(samples)


def run_sync() -> dict:
    pl, trainer, pool, router, wb, task = stack()
    curve, version, start, rollout_s = [], 0, time.perf_counter(), 0.0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = generate_groups(router, task, sampling, args.prompts_per_step)
        rollout_s += time.perf_counter() - t0
        curve.append(rewards_of(batch))
        version = ray.get(trainer.train_step.remote(batch))["weight_version"]
        ray.get(wb.sync.remote(version))
    seconds = time.perf_counter() - start
    ray.util.remove_placement_group(pl.pg)
    return {"seconds": seconds, "curve": curve, "staleness_mean": 0.0, "dropped_stale": 0, "rollout_s": rollout_s}


def run_async() -> dict:
    pl, trainer, pool, router, wb, task = stack()
    n = args.prompts_per_step
    buffer = actors.ReplayBuffer.remote(actors.ReplayBufferConfig(max_staleness=args.max_staleness))
    cfg = actors.RolloutWorkerConfig(sampling=sampling, prompts_in_flight=n, max_buffered_groups=args.ahead * n)
    worker = actors.RolloutWorker.remote(cfg, router, buffer, task)
    curve, ages, version, start = [], [], 0, time.perf_counter()
    ray.get(worker.start.remote())
    for _ in range(args.steps):
        batch = ray.get(buffer.get_batch.remote(n, current_version=version, timeout_s=1800))
        if batch is None:
            raise RuntimeError(f"no batch in time: {ray.get(worker.stats.remote())}")
        curve.append(rewards_of(batch))
        ages += [version - g.weight_version for g in batch]
        version = ray.get(trainer.train_step.remote(batch))["weight_version"]
        ray.get(wb.sync.remote(version))  # generation goes on meanwhile
    seconds = time.perf_counter() - start
    ray.get(worker.stop.remote())
    stats = ray.get(buffer.stats.remote())
    ray.util.remove_placement_group(pl.pg)
    return {"seconds": seconds, "curve": curve, "staleness_mean": sum(ages) / len(ages),
            "dropped_stale": stats["dropped_stale"]}  # fmt: skip


results = {"sync": run_sync(), "async": run_async()}
# what overlap can give at most: the sync step is rollout + (train + sync); async runs them side by side
rollout_s = results["sync"]["rollout_s"]
bound = results["sync"]["seconds"] / max(rollout_s, results["sync"]["seconds"] - rollout_s)
samples = args.steps * args.prompts_per_step * args.group_size
third = max(1, args.steps // 3)
rows = []
for mode, r in results.items():
    rows.append({
        "mode": mode, "train_steps": args.steps, "samples": samples, "seconds": r["seconds"],
        "samples_per_s": samples / r["seconds"],
        "speedup": results["sync"]["seconds"] / r["seconds"],
        "reward_first_third": sum(r["curve"][:third]) / third,
        "reward_last_third": sum(r["curve"][-third:]) / third,
        "reward_mean": sum(r["curve"]) / len(r["curve"]),
        "staleness_mean": r["staleness_mean"], "dropped_stale_groups": r["dropped_stale"],
        "rollout_share_of_sync": rollout_s / results["sync"]["seconds"], "overlap_bound": bound,
        "ahead_batches": args.ahead if mode == "async" else 0,
    })  # fmt: skip
emit(args.name, rows)
print(f"async / sync samples/s: {rows[1]['speedup']:.2f}x (perfect overlap of the sync run's phases: {bound:.2f}x)")
print(f"reward mean {rows[1]['reward_mean']:.3f} vs "
      f"{rows[0]['reward_mean']:.3f} (sync) at {samples} samples each")  # fmt: skip

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(1, 2, figsize=(11, 4))
for mode, r in results.items():
    per_step = r["seconds"] / args.steps
    xs = [(i + 1) * args.prompts_per_step * args.group_size for i in range(args.steps)]
    ax[0].plot(xs, r["curve"], "o-", label=mode)
    ax[1].plot([(i + 1) * per_step for i in range(args.steps)], r["curve"], "o-", label=mode)
ax[0].set(xlabel="samples trained", ylabel="batch reward", title="Reward at equal samples")
ax[1].set(xlabel="seconds (mean per step)", ylabel="batch reward", title="Reward over wall time")
for a in ax:
    a.legend()
fig.tight_layout()
plot = f"benchmarks/results/{args.name}.png"
fig.savefig(plot, dpi=90)
print(f"wrote {plot}")
