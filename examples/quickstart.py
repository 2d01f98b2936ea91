"""Quick-start: GRPO on reasoning-gym arithmetic with SmolLM2-135M-Instruct, through the five miles_ray actors.

Runs on a laptop CPU (2 cores: ~15 minutes) and, unchanged, on a GPU cluster (pass --address auto).

    python examples/quickstart.py --topology colocated --steps 25
    python examples/quickstart.py --mode async --topology disaggregated   # rollout and training overlap
    python examples/quickstart.py --checkpoint-every 5 --resume            # pick up where a stopped run left off

Checkpoints (``--checkpoint-every``) hold the whole run: trainer weights, optimizer and RNG, the buffer, the data
position and the step; ``--resume`` continues from the latest one. ``--export-hf DIR`` writes the final policy as
an HF model directory. Metrics go to ``OUT/metrics.jsonl`` and to Prometheus through Ray (``--metrics-port``).
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
from miles_ray.checkpoint import RunCheckpointer
from miles_ray.engines import SamplingParams
from miles_ray.engines.embedded import EmbeddedEngineConfig
from miles_ray.metrics import record_phases
from miles_ray.models.hub import MODELS, model_dir
from miles_ray.report import plot_run, read_jsonl
from miles_ray.rewards import ReasoningGymTask, one_digit_arithmetic
from miles_ray.rollout import RolloutFunctionConfig

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--topology", choices=["colocated", "disaggregated"], default="colocated")
p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
p.add_argument("--steps", type=int, default=25)
p.add_argument("--num-ranks", type=int, default=2, help="trainer ranks (and as many engines)")
p.add_argument("--prompts-per-step", type=int, default=8)
p.add_argument("--group-size", type=int, default=8)
p.add_argument("--max-new-tokens", type=int, default=24)
p.add_argument("--lr", type=float, default=1e-5)
p.add_argument("--rollout-fn", default="miles_ray.rollout:generate_groups", help="rollout function import path")
p.add_argument("--out", default="runs/quickstart")
p.add_argument(
    "--mode",
    choices=["sync", "async"],
    default="sync",
    help="sync: rollout, train, sync in turn; async: a RolloutWorker generates while the trainer trains",
)
p.add_argument("--max-staleness", type=int, default=1, help="async: drop groups this many versions old")
p.add_argument(
    "--in-flight",
    choices=["continue", "finish", "abort_resume"],
    default="continue",
    help="requests generating while weights are pushed (async mode)",
)
p.add_argument("--checkpoint-every", type=int, default=0, help="save a whole-run checkpoint every N steps (0: never)")
p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT/checkpoints")
p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: train all weights); try --lr 2e-4")
p.add_argument("--backend", choices=["torch", "megatron"], default="torch", help="trainer backend")
p.add_argument("--tp", type=int, default=1, help="megatron: tensor-parallel size (divides --num-ranks)")
p.add_argument("--routing-replay", action="store_true", help="MoE models (--model smollm2-moe): replay rollout routes")
p.add_argument("--weight-format", choices=["fp8", "int4"], default=None,
               help="low-precision recipe for engines and trainer (emulated on CPU), with TIS")  # fmt: skip
p.add_argument("--export-hf", default=None, help="write the final policy here as an HF model directory")
p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port of Ray's metrics agent (local Ray)")
p.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
args = p.parse_args()
if args.backend == "megatron" and (args.lora_rank or args.weight_format or args.routing_replay):
    p.error("--backend megatron takes no --lora-rank, --weight-format or --routing-replay yet")

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
local = {} if args.address else {"num_cpus": max(8, os.cpu_count() or 1)}
if args.metrics_port and not args.address:
    local["_metrics_export_port"] = args.metrics_port
ray.init(address=args.address, **local)
model_path, out_dir, n = str(model_dir(args.model)), Path(args.out), args.num_ranks
out_dir.mkdir(parents=True, exist_ok=True)
gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= n else 0.0  # one GPU per bundle when there are GPUs

# --- topology: one placement group, five actors -------------------------------------------------
if args.topology == "colocated":  # trainer rank i and engine i share bundle i; weights go through shared memory
    plan, transport = placement.colocated(n, gpus_per_bundle=gpus), "shared_memory"
else:  # trainers and engines on bundles of their own; weights are broadcast over gloo (NCCL on GPUs)
    plan, transport = placement.disaggregated(n, n, gpus_per_trainer=gpus, gpus_per_engine=gpus), "broadcast"
pl = placement.create(plan)
temperature = 1.0  # the trainer divides its logits by the rollout temperature, as the engine did
recipe = {"format": args.weight_format} if args.weight_format else None  # one recipe for rollout and training
if args.backend == "megatron":  # the n ranks form n / tp data-parallel groups of tp tensor-parallel ranks
    backend = {"kind": "megatron", "micro_batch_size": 32, "parallel": {"tensor_model_parallel_size": args.tp}}
else:
    backend = {"micro_batch_size": 32, "autocast": "auto", "routing_replay": args.routing_replay,
               "weight_format": recipe,
               "lora": {"rank": args.lora_rank, "alpha": 2 * args.lora_rank} if args.lora_rank else None}  # fmt: skip
trainer_cfg = actors.TrainerGroupConfig(
    model_path=model_path, num_ranks=n, temperature=temperature, optimizer={"lr": args.lr}, backend=backend,
    mismatch_correction={"kind": "tis", "cap": 2.0} if recipe else None,
)  # fmt: skip
trainer = actors.TrainerGroup.options(name="miles_ray/trainer").remote(trainer_cfg, pl)
# ~100-token prompts + 24 new tokens
engine_cfg = EmbeddedEngineConfig(model_path=model_path, max_seq_len=512, weight_format=recipe)
pool_cfg = actors.RolloutPoolConfig(num_engines=n, engine=engine_cfg)
pool = actors.RolloutPool.options(name="miles_ray/rollout_pool").remote(pool_cfg, pl)
engines = ray.get(pool.engines.remote())
router = actors.Router.options(name="miles_ray/router").remote(actors.RouterConfig(), engines)
staleness = 0 if args.mode == "sync" else args.max_staleness
buffer = actors.ReplayBuffer.options(name="miles_ray/replay_buffer").remote(
    actors.ReplayBufferConfig(max_staleness=staleness)
)
broadcaster = actors.WeightBroadcaster.options(name="miles_ray/weight_broadcaster").remote(
    actors.WeightBroadcasterConfig(transport=transport, in_flight=args.in_flight),
    ray.get(trainer.workers.remote()),
    engines,
)

# --- task: one-digit sums and differences, scored by reasoning-gym's own score_answer -------------
task = ReasoningGymTask(one_digit_arithmetic(seed=1), AutoTokenizer.from_pretrained(model_path))
sampling = SamplingParams(n=args.group_size, max_new_tokens=args.max_new_tokens, temperature=temperature)
rollout = RolloutFunctionConfig(fn=args.rollout_fn).resolve()  # (router, task, params, n) -> [GroupRef]
worker = None
if args.mode == "async":  # streams groups into the buffer, one batch ahead of the trainer (one-step off-policy)
    worker_cfg = actors.RolloutWorkerConfig(
        sampling=sampling, prompts_in_flight=args.prompts_per_step, max_buffered_groups=args.prompts_per_step
    )
    worker = actors.RolloutWorker.options(name="miles_ray/rollout_worker").remote(worker_cfg, router, buffer, task)

# --- whole-run checkpoints: trainer, buffer, data position, step ----------------------------------
ckpt, first_step = RunCheckpointer(out_dir / "checkpoints"), 0
data = {"rollout_worker": worker} if worker is not None else {"data_source": task}
if args.resume and ckpt.latest() is not None:
    first_step = ckpt.load(None, trainer, buffer=buffer, **data)["step"]
    print(f"resumed from {ckpt.latest()} at step {first_step}")


def save(step: int) -> None:
    if worker is not None:
        ray.get(worker.stop.remote())  # land the prompts in flight, so the buffer and position agree
    ckpt.save(step, trainer, buffer=buffer, **data)
    if worker is not None:
        ray.get(worker.start.remote())


# --- the GRPO loop: rollout -> buffer -> train -> sync -------------------------------------------
log_path = out_dir / "metrics.jsonl"
if first_step and log_path.exists():  # keep the log of the steps the checkpoint holds, drop the ones it lost
    kept = [r for r in read_jsonl(log_path) if r["step"] < first_step]
    log_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
version = ray.get(trainer.weight_version.remote())
ray.get(broadcaster.sync.remote(version))
if worker is not None:
    ray.get(worker.start.remote())
with open(log_path, "a" if first_step else "w") as log, tqdm(range(first_step, args.steps), desc="GRPO") as bar:
    for step in bar:
        t0 = time.perf_counter()
        if worker is None:
            ray.get(buffer.add.remote(rollout(router, task, sampling, args.prompts_per_step)))
            batch = ray.get(buffer.get_batch.remote(args.prompts_per_step, current_version=version))
        else:  # wait for the worker's groups
            batch = ray.get(buffer.get_batch.remote(args.prompts_per_step, current_version=version, timeout_s=3600))
            if batch is None:
                raise RuntimeError(f"no batch within an hour: {ray.get(worker.stats.remote())}")
        samples = [s for g in ray.get([g.ref for g in batch]) for s in g]
        staleness = sum(version - g.weight_version for g in batch) / len(batch)  # versions behind when taken
        t1 = time.perf_counter()
        metrics = ray.get(trainer.train_step.remote(batch))  # GRPO advantages + PPO-clip, one optimizer step
        t2 = time.perf_counter()
        version = metrics["weight_version"]
        sync = ray.get(broadcaster.sync.remote(version))  # raises if an engine's version or checksum is off
        t3 = time.perf_counter()
        record = {
            "step": step, "weight_version": version,
            "reward_mean": sum(s.reward for s in samples) / len(samples),
            "response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
            "kl": metrics["train_rollout_k3_kl"], "clipfrac": metrics["clipfrac"], "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"], "logprob_diff_max": metrics["train_rollout_logprob_abs_diff_max"],
            "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2, "step_s": t3 - t0,
            "sync_gb_per_s": sync["gb_per_s"], "example": samples[0].response_text[:80],
            "staleness_mean": staleness,
            "step_skipped": metrics["step_skipped"],
        }  # fmt: skip
        if "moe_route_mismatch_frac" in metrics:  # MoE: expert sets the trainer's routers pick unlike the rollout
            record["moe_route_mismatch_frac"] = metrics["moe_route_mismatch_frac"]
        log.write(json.dumps(record) + "\n")
        log.flush()
        record_phases({"rollout": record["rollout_s"], "train": record["train_s"], "sync": record["sync_s"]})
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save(step + 1)
        bar.set_postfix(reward=f"{record['reward_mean']:.3f}", len=f"{record['response_len_mean']:.1f}",
                        step_s=f"{record['step_s']:.1f}", sync_s=f"{record['sync_s']:.2f}")  # fmt: skip

if worker is not None:
    ray.get(worker.stop.remote())
if args.export_hf:
    print(f"exported the policy to {ray.get(trainer.export_hf.remote(args.export_hf))}")
rows = read_jsonl(log_path)
head, tail = rows[: max(1, len(rows) // 5)], rows[-max(1, len(rows) // 5) :]
mean = lambda rs: sum(r["reward_mean"] for r in rs) / len(rs)  # noqa: E731
print(f"reward curve: {plot_run(log_path)}")
print(f"mean reward, first {len(head)} steps: {mean(head):.3f}; last {len(tail)} steps: {mean(tail):.3f}")
