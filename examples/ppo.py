"""PPO with a critic and a frozen reference, on the quick-start task (one-digit arithmetic, SmolLM2-135M).

Seven actors: the five of the quick-start plus a ``CriticGroup`` (value head on the policy's transformer,
trained on GAE returns) and a ``ReferenceGroup`` (the initial weights, serving logprobs for the KL loss).
All share one colocated placement: bundle i holds trainer rank i, engine i, critic rank i, reference rank i.

    python examples/ppo.py --steps 20
    python examples/ppo.py --reward-model DIR      # classic RLHF: a learned reward model scores the responses
"""

import argparse
import time
from pathlib import Path

import ray
from common import RunLog, add_logger_argument, gpus_per_bundle, init_ray, step_record
from tqdm import tqdm
from transformers import AutoTokenizer

from miles_ray import placement
from miles_ray.actors import ModelReward, RewardModelConfig, RewardModelGroup
from miles_ray.engines import SamplingParams
from miles_ray.models.hub import MODELS, model_dir
from miles_ray.rewards import ReasoningGymTask, one_digit_arithmetic
from miles_ray.rewards.safe import SafeGroupReward
from miles_ray.rollout import generate_groups
from miles_ray.stack import StackConfig, build_stack

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
add_logger_argument(p)
p.add_argument("--reward-model", default=None, help="score with this HF reward model (sequence classifier, 1 label)")
args = p.parse_args()

init_ray()
model_path, n = str(model_dir(args.model)), args.num_ranks
pl = placement.create(placement.colocated(n, gpus_per_bundle=gpus_per_bundle(n), critic=True, reference=True))

# --- the stack: policy, critic and reference models, engines, router, buffer, weight sync -------------
backend = {"micro_batch_size": 16, "autocast": "auto"}  # the reference computes like the policy: KL 0 at step 0
stack = build_stack(
    StackConfig(
        trainer={
            "model_path": model_path,
            "num_ranks": n,
            "backend": backend,
            "optimizer": {"lr": args.lr},
            "advantage": {"kind": "gae", "gamma": 1.0, "lam": 0.95},
            "kl": {"coef": args.kl_coef, "estimator": "k3"},
        },
        critic={
            "model_path": model_path,
            "num_ranks": n,
            "backend": backend,
            "optimizer": {"lr": args.critic_lr},
            "head_lr": args.value_head_lr,
        },
        reference={"model_path": model_path, "num_ranks": n, "backend": backend},
        pool={"num_engines": n, "engine": {"model_path": model_path, "max_seq_len": 256, "max_batch_size": 32}},
        buffer={"max_staleness": 0},
    ),
    pl,
)
task = ReasoningGymTask(one_digit_arithmetic(seed=1), AutoTokenizer.from_pretrained(model_path))
sampling = SamplingParams(n=args.samples_per_prompt, max_new_tokens=args.max_new_tokens)
reward = None  # the task's own rule (reasoning-gym's score_answer), or a learned reward model's scores:
if args.reward_model:
    rm = RewardModelGroup.remote(RewardModelConfig(model_path=args.reward_model))
    reward = SafeGroupReward(ModelReward(rm, prompt_key="question"))

# --- the PPO loop: rollout -> values + reference logprobs -> GAE -> policy and critic steps -> sync ------
log = RunLog(Path(args.out), logger=args.logger, config=vars(args))
version = ray.get(stack.trainer.weight_version.remote())
ray.get(stack.broadcaster.sync.remote(version))
for step in (bar := tqdm(range(args.steps), desc="PPO")):
    t0 = time.perf_counter()
    ray.get(stack.buffer.add.remote(generate_groups(stack.router, task, sampling, args.prompts_per_step, reward)))
    batch = ray.get(stack.buffer.get_batch.remote(args.prompts_per_step, current_version=version))
    samples = [s for g in ray.get([g.ref for g in batch]) for s in g]
    t1 = time.perf_counter()
    m = ray.get(stack.trainer.train_step.remote(batch))  # critic values -> GAE -> policy step -> critic step
    t2 = time.perf_counter()
    version = m["weight_version"]
    ray.get(stack.broadcaster.sync.remote(version))
    record = step_record(
        step,
        samples,
        m,
        ref_kl=m["ref_kl"],
        value_loss=m["critic/value_loss"],
        explained_variance=m["critic/explained_variance"],
        value_clipfrac=m["critic/value_clipfrac"],
        rollout_s=t1 - t0,
        train_s=t2 - t1,
        sync_s=time.perf_counter() - t2,
        step_s=time.perf_counter() - t0,
    )
    log.write(record)
    bar.set_postfix(reward=f"{record['reward_mean']:.3f}", ev=f"{record['explained_variance']:.2f}")

log.summary(("reward_mean", "explained_variance"))
