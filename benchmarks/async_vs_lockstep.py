"""Fully async vs lockstep GRPO: samples/s and reward at equal samples, same model, task and resources.

Both runs use one trainer rank and one embedded engine on bundles of their own (disaggregated, weights
broadcast over gloo), the same trainer config (PPO-clip against the engine's logprobs, i.e. the behaviour
policy), the same task, seeds and number of train steps x groups per step, so both train on the same number
of samples. Lockstep: rollout, then train, then weight sync, one after another. Async: an ``AsyncRollout``
generates non-stop into the ``ReplayBuffer`` (at most ``--ahead`` batches in buffer + flight, groups older than
``--max-staleness`` versions dropped) while the trainer trains and weights are pushed mid-generation (``--in-flight``).

    python benchmarks/async_vs_lockstep.py --steps 8 --prompts-per-step 8 --group-size 8
    python benchmarks/async_vs_lockstep.py --seeds 1 2 3     # the reward gap against the spread over seeds
    python benchmarks/async_vs_lockstep.py --think --max-new-tokens 96 --steps 4 --name async_vs_lockstep_think

The speed-up async can give is bounded by how the lockstep step splits: rollout and (train + weight sync) run side
by side, so at most step / max(rollout, train + sync) (the ``overlap_bound`` column, measured in the lockstep run).
With several ``--seeds`` (the task's data order and the trainer's seed) each seed runs both modes; the last rows
give each mode's mean reward with its spread over the seeds (min to max).

Two rewards at equal samples: ``reward_mean``, the mean reward of the batches each mode trained on (async's were
sampled one version behind, so its curve lags lockstep's by about one step by construction), and
``final_reward``, the reward of the final weights, the same in both modes' engines, on ``--eval-prompts`` held-out
prompts (one data seed for every run) x group size, sampled as in training: the policy each mode made from the
same number of samples.
"""

import argparse
import json
import os
import time
from pathlib import Path

import ray
from common import emit
from transformers import AutoTokenizer

from miles_ray import placement
from miles_ray.actors import AsyncRollout, AsyncRolloutConfig
from miles_ray.engines import SamplingParams
from miles_ray.models.hub import MODELS, model_dir
from miles_ray.rewards import ReasoningGymTask, one_digit_arithmetic
from miles_ray.rollout import generate_groups
from miles_ray.stack import StackConfig, build_stack

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--prompts-per-step", type=int, default=8)
p.add_argument("--group-size", type=int, default=8)
p.add_argument("--max-new-tokens", type=int, default=24)
p.add_argument("--lr", type=float, default=1e-5)
p.add_argument("--max-staleness", type=int, default=2)
p.add_argument("--ahead", type=int, default=1, help="async: batches the rollout may hold in buffer + flight")
p.add_argument("--in-flight", choices=["continue", "finish", "abort_resume"], default="continue")
p.add_argument("--think", action="store_true", help="ask for reasoning before the answer: longer responses")
p.add_argument("--seeds", type=int, nargs="+", default=[1], help="task data order and trainer seed, one run pair each")
p.add_argument("--engine-dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="as the quick-start")
p.add_argument("--eval-prompts", type=int, default=32, help="final weights' reward on this many prompts (0: skip)")
p.add_argument("--name", default="async_vs_lockstep", help="results: benchmarks/results/NAME.json and NAME.png")
args = p.parse_args()

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
model_path = str(model_dir(args.model))
tokenizer = AutoTokenizer.from_pretrained(model_path)
sampling = SamplingParams(n=args.group_size, max_new_tokens=args.max_new_tokens, temperature=1.0)
EVAL_SEED = 10_007  # the held-out prompts' data order: one for every run, none of the training seeds


def stack(seed: int, max_staleness: int | None = None):
    """A fresh run: one trainer rank and one engine, disaggregated (broadcast), and the task (``seed``: data order)."""
    trainer = {"model_path": model_path, "optimizer": {"lr": args.lr}, "old_logprobs": "rollout", "seed": seed}
    trainer["backend"] = {"micro_batch_size": 32, "autocast": "auto"}
    config = StackConfig(
        trainer=trainer,
        pool={"engine": {"model_path": model_path, "max_seq_len": 512, "dtype": args.engine_dtype}},
        buffer={"max_staleness": max_staleness},
        broadcaster={"in_flight": args.in_flight},
    )
    built = build_stack(config, placement.create(placement.disaggregated(1, 1)))
    ray.get(built.broadcaster.sync.remote(0))
    return built, task_of(seed)


def task_of(seed: int) -> ReasoningGymTask:
    """The task with data order ``seed``."""
    task = one_digit_arithmetic(seed=seed)
    if args.think:  # responses of tens of tokens instead of a few: rollout takes a larger share of a step
        think = "Think step by step in a few sentences, then give the final number."
        task = task.model_copy(update={"system_prompt": "You are a careful math tutor.", "instruction": think})
    return ReasoningGymTask(task, tokenizer)


def final_reward(run) -> float | None:
    """The engine's weights' (the trainer's last) mean reward on the held-out prompts; None with no eval prompts."""
    if not args.eval_prompts:
        return None
    return rewards_of(generate_groups(run.router, task_of(EVAL_SEED), sampling, args.eval_prompts))


def rewards_of(batch) -> float:
    samples = [s for g in ray.get([g.ref for g in batch]) for s in g]
    return sum(s.reward for s in samples) / len(samples)


def run_lockstep(seed: int) -> dict:
    run, task = stack(seed)
    curve, version, start, rollout_s = [], 0, time.perf_counter(), 0.0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = generate_groups(run.router, task, sampling, args.prompts_per_step)
        rollout_s += time.perf_counter() - t0
        curve.append(rewards_of(batch))
        version = ray.get(run.trainer.train_step.remote(batch))["weight_version"]
        ray.get(run.broadcaster.sync.remote(version))
    seconds = time.perf_counter() - start
    final = final_reward(run)
    run.shutdown()
    result = {"seconds": seconds, "curve": curve, "staleness_mean": 0.0, "dropped_stale": 0, "rollout_s": rollout_s}
    return result | {"final_reward": final}


def run_async(seed: int) -> dict:
    run, task = stack(seed, args.max_staleness)
    n = args.prompts_per_step
    cfg = AsyncRolloutConfig(sampling=sampling, prompts_in_flight=n, max_buffered_groups=args.ahead * n)
    streamer = AsyncRollout.remote(cfg, run.router, run.buffer, task)
    curve, ages, version, start = [], [], 0, time.perf_counter()
    ray.get(streamer.start.remote())
    for _ in range(args.steps):
        batch = ray.get(run.buffer.get_batch.remote(n, current_version=version, timeout_s=1800))
        if batch is None:
            raise RuntimeError(f"no batch in time: {ray.get(streamer.stats.remote())}")
        curve.append(rewards_of(batch))
        ages += [version - g.weight_version for g in batch]
        version = ray.get(run.trainer.train_step.remote(batch))["weight_version"]
        ray.get(run.broadcaster.sync.remote(version))  # generation goes on meanwhile
    seconds = time.perf_counter() - start
    ray.get(streamer.stop.remote())
    stats = ray.get(run.buffer.stats.remote())
    final = final_reward(run)  # the rollout has stopped: the eval has the engine to itself, as in lockstep
    run.shutdown()
    staleness = sum(ages) / len(ages)
    result = {"seconds": seconds, "curve": curve, "staleness_mean": staleness, "dropped_stale": stats["dropped_stale"]}
    return result | {"final_reward": final}


samples = args.steps * args.prompts_per_step * args.group_size
third = max(1, args.steps // 3)


def rows_of(seed: int, results: dict) -> list[dict]:
    """One row per mode of one seed's pair of runs."""
    # what overlap can give at most: a lockstep step is rollout + (train + sync); async runs them side by side
    rollout_s = results["lockstep"]["rollout_s"]
    bound = results["lockstep"]["seconds"] / max(rollout_s, results["lockstep"]["seconds"] - rollout_s)
    rows = []
    for mode, r in results.items():
        speedup = results["lockstep"]["seconds"] / r["seconds"]
        rows.append(
            {
                "seed": seed,
                "mode": mode,
                "train_steps": args.steps,
                "samples": samples,
                "seconds": r["seconds"],
                "samples_per_s": samples / r["seconds"],
                "speedup": speedup,
                "overlap_bound": bound,
                "of_bound": speedup / bound if mode == "async" else None,
                "rollout_share_of_lockstep": rollout_s / results["lockstep"]["seconds"],
                "reward_first_third": sum(r["curve"][:third]) / third,
                "reward_last_third": sum(r["curve"][-third:]) / third,
                "reward_mean": sum(r["curve"]) / len(r["curve"]),
                "final_reward": r["final_reward"],
                "staleness_mean": r["staleness_mean"],
                "dropped_stale_groups": r["dropped_stale"],
                "ahead_batches": args.ahead if mode == "async" else 0,
            }
        )
    return rows


runs = {}
partial = Path(f"benchmarks/results/{args.name}_runs.json")
partial.parent.mkdir(parents=True, exist_ok=True)  # absent in a fresh clone until emit makes it
for seed in args.seeds:  # each pair written as it completes: a late failure loses no run
    runs[seed] = {"lockstep": run_lockstep(seed), "async": run_async(seed)}
    partial.write_text(json.dumps(runs, indent=1))
rows = [row for seed, results in runs.items() for row in rows_of(seed, results)]
for mode in ("lockstep", "async"):  # the spread over seeds
    mine = [r for r in rows if r["mode"] == mode and r["seed"] != "all"]
    rewards = [r["reward_mean"] for r in mine]
    summary = {"seed": "all", "mode": mode, "samples": samples, "reward_mean": sum(rewards) / len(rewards)}
    summary |= {"reward_min": min(rewards), "reward_max": max(rewards)}
    if args.eval_prompts:
        finals = [r["final_reward"] for r in mine]
        summary |= {"final_reward": sum(finals) / len(finals), "final_min": min(finals), "final_max": max(finals)}
    summary["samples_per_s"] = sum(r["samples_per_s"] for r in mine) / len(mine)
    if mode == "async":
        summary["of_bound"] = sum(r["of_bound"] for r in mine) / len(mine)
    rows.append(summary)
emit(args.name, rows)
lock, asy = rows[-2], rows[-1]
print(f"async reached {asy['of_bound']:.0%} of what overlap allows (mean over {len(args.seeds)} seed(s))")
print(
    f"reward mean over seeds: lockstep {lock['reward_mean']:.3f} [{lock['reward_min']:.3f}, {lock['reward_max']:.3f}], "
    f"async {asy['reward_mean']:.3f} [{asy['reward_min']:.3f}, {asy['reward_max']:.3f}] at {samples} samples each"
)
if args.eval_prompts:
    print(
        f"final weights' reward ({args.eval_prompts} held-out prompts x {args.group_size}): lockstep "
        f"{lock['final_reward']:.3f} [{lock['final_min']:.3f}, {lock['final_max']:.3f}], "
        f"async {asy['final_reward']:.3f} [{asy['final_min']:.3f}, {asy['final_max']:.3f}]"
    )

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(1, 2, figsize=(11, 4))
for seed, results in runs.items():
    for mode, r in results.items():
        per_step = r["seconds"] / args.steps
        xs = [(i + 1) * args.prompts_per_step * args.group_size for i in range(args.steps)]
        style = {"color": "C0" if mode == "lockstep" else "C1", "label": f"{mode}, seed {seed}", "alpha": 0.8}
        ax[0].plot(xs, r["curve"], "o-", **style)
        ax[1].plot([(i + 1) * per_step for i in range(args.steps)], r["curve"], "o-", **style)
ax[0].set(xlabel="samples trained", ylabel="batch reward", title="Reward at equal samples")
ax[1].set(xlabel="seconds (mean per step)", ylabel="batch reward", title="Reward over wall time")
for a in ax:
    a.legend()
fig.tight_layout()
plot = f"benchmarks/results/{args.name}.png"
fig.savefig(plot, dpi=90)
print(f"wrote {plot}")
