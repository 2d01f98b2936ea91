"""PPO with a critic and a frozen reference, on the quick-start task (one-digit arithmetic, SmolLM2-135M).

Seven actors: the five of the quick-start plus a ``CriticGroup`` (value head on the policy's transformer,
trained on GAE returns) and a ``ReferenceGroup`` (the initial weights, serving logprobs for the KL loss).
All share one colocated placement: bundle i holds trainer rank i, engine i, critic rank i, reference rank i.

    python examples/ppo.py --steps 20
"""

import argparse
import json
import os
import time
from pathlib import Path

import ray
from tqdm import tqdm
from transformers import AutoTokenizer

from miles_ray import actors, placement
from miles_ray.engines import SamplingParams
from miles_ray.engines.embedded import EmbeddedEngineConfig
from miles_ray.models.hub import MODELS, model_dir
from miles_ray.report import plot_run, read_jsonl
from miles_ray.rewards import ReasoningGymTask, one_digit_arithmetic
from miles_ray.rollout import generate_groups

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--num-ranks", type=int, default=1, help="ranks per model, as many engines (2 needs > 24 GB RAM)")
p.add_argument("--prompts-per-step", type=int, default=16)
p.add_argument("--samples-per-prompt", type=int, default=4, help="PPO needs no groups; >1 shares prefills")
p.add_argument("--max-new-tokens", type=int, default=24)
p.add_argument("--lr", type=float, default=1e-5)
p.add_argument("--critic-lr", type=float, default=1e-5)
p.add_argument("--value-head-lr", type=float, default=1e-3, help="the zero-initialised head learns from scratch")
p.add_argument("--kl-coef", type=float, default=0.01, help="k3 KL to the reference, in the loss")
p.add_argument("--out", default="runs/ppo")
args = p.parse_args()

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray.init(num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False)
model_path, out_dir, n = str(model_dir(args.model)), Path(args.out), args.num_ranks
out_dir.mkdir(parents=True, exist_ok=True)
gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= n else 0.0
pl = placement.create(placement.colocated(n, gpus_per_bundle=gpus, critic=True, reference=True))

# --- the models: policy, critic, reference ----------------------------------------------------------
backend = {"micro_batch_size": 16, "autocast": "auto"}
critic_cfg = actors.CriticGroupConfig(
    model_path=model_path, num_ranks=n, backend=backend, optimizer={"lr": args.critic_lr}, head_lr=args.value_head_lr
)
critic = actors.CriticGroup.remote(critic_cfg, pl)
reference = actors.ReferenceGroup.remote(  # same numerics as the policy (autocast), so KL is 0 at step 0
    actors.ReferenceGroupConfig(model_path=model_path, num_ranks=n, backend=backend), pl
)
trainer_cfg = actors.TrainerGroupConfig(
    model_path=model_path, num_ranks=n, backend=backend, optimizer={"lr": args.lr},
    advantage={"kind": "gae", "gamma": 1.0, "lam": 0.95}, kl={"coef": args.kl_coef, "estimator": "k3"},
)  # fmt: skip
trainer = actors.TrainerGroup.remote(trainer_cfg, pl, critic=critic, reference=reference)

# --- rollout side: engines, router, buffer, weight sync ---------------------------------------------
engine_cfg = EmbeddedEngineConfig(model_path=model_path, max_seq_len=256, max_batch_size=32)  # KV for 32 x 256
pool = actors.RolloutPool.remote(actors.RolloutPoolConfig(num_engines=n, engine=engine_cfg), pl)
engines = ray.get(pool.engines.remote())
router = actors.Router.remote(actors.RouterConfig(), engines)
buffer = actors.ReplayBuffer.remote(actors.ReplayBufferConfig(max_staleness=0))
broadcaster = actors.WeightBroadcaster.remote(
    actors.WeightBroadcasterConfig(transport="shared_memory"), ray.get(trainer.workers.remote()), engines
)

task = ReasoningGymTask(one_digit_arithmetic(seed=1), AutoTokenizer.from_pretrained(model_path))
sampling = SamplingParams(n=args.samples_per_prompt, max_new_tokens=args.max_new_tokens)

# --- the PPO loop: rollout -> values + reference logprobs -> GAE -> policy and critic steps -> sync ------
version = ray.get(trainer.weight_version.remote())
ray.get(broadcaster.sync.remote(version))
with open(out_dir / "metrics.jsonl", "w") as log, tqdm(range(args.steps), desc="PPO") as bar:
    for step in bar:
        t0 = time.perf_counter()
        ray.get(buffer.add.remote(generate_groups(router, task, sampling, args.prompts_per_step)))
        batch = ray.get(buffer.get_batch.remote(args.prompts_per_step, current_version=version))
        samples = [s for g in ray.get([g.ref for g in batch]) for s in g]
        t1 = time.perf_counter()
        m = ray.get(trainer.train_step.remote(batch))  # critic values -> GAE -> policy step -> critic step
        t2 = time.perf_counter()
        version = m["weight_version"]
        ray.get(broadcaster.sync.remote(version))
        record = {
            "step": step, "weight_version": version,
            "reward_mean": sum(s.reward for s in samples) / len(samples),
            "response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
            "loss": m["loss"], "clipfrac": m["clipfrac"], "ref_kl": m["ref_kl"], "grad_norm": m["grad_norm"],
            "value_loss": m["critic/value_loss"], "explained_variance": m["critic/explained_variance"],
            "value_clipfrac": m["critic/value_clipfrac"], "logprob_diff_max": m["train_rollout_logprob_abs_diff_max"],
            "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": time.perf_counter() - t2,
            "step_s": time.perf_counter() - t0, "example": samples[0].response_text[:80],
        }  # fmt: skip
        log.write(json.dumps(record) + "\n")
        log.flush()
        bar.set_postfix(reward=f"{record['reward_mean']:.3f}", ev=f"{record['explained_variance']:.2f}",
                        step_s=f"{record['step_s']:.1f}")  # fmt: skip

rows = read_jsonl(out_dir / "metrics.jsonl")
head, tail = rows[: max(1, len(rows) // 5)], rows[-max(1, len(rows) // 5) :]
mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
print(f"reward curve: {plot_run(out_dir / 'metrics.jsonl')}")
for key in ("reward_mean", "explained_variance"):
    print(f"{key}, first {len(head)} steps: {mean(head, key):.3f}; last {len(tail)} steps: {mean(tail, key):.3f}")
