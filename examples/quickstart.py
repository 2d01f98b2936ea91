"""Quick-start: GRPO on reasoning-gym arithmetic with SmolLM2-135M-Instruct, through the miles_ray actors.

Runs on a laptop CPU (2 cores: ~3 minutes where the CPU computes bf16 natively, several times that in fp32) and,
unchanged, on a GPU cluster (pass --address auto).

    python examples/quickstart.py --topology colocated --steps 25
    python examples/quickstart.py --mode async --topology disaggregated   # rollout and training overlap
    python examples/quickstart.py --checkpoint-every 5 --resume            # pick up where a stopped run left off
    python examples/quickstart.py --model smollm2-moe --backend megatron --ep 2 --routing-replay  # MoE, Megatron EP
    python examples/quickstart.py --data examples/data/aiw/train.jsonl --eval-data examples/data/aiw/test.jsonl \
        --eval-every 5 --max-new-tokens 128 --logger jsonl,tensorboard    # your data, held-out eval, trackers

Checkpoints (``--checkpoint-every``) hold the whole run: trainer weights, optimizer and RNG, the buffer, the data
position and the step; ``--resume`` continues from the latest one. ``--export-hf DIR`` writes the final policy as
an HF model directory. Metrics go to ``OUT/metrics.jsonl`` and to Prometheus through Ray (``--metrics-port``).
"""

import argparse
import time
import warnings
from pathlib import Path

import ray
from common import RunLog, add_logger_argument, gpus_per_bundle, init_ray, step_record
from tqdm import tqdm
from transformers import AutoTokenizer

from miles_ray import placement
from miles_ray.actors import AsyncRollout, AsyncRolloutConfig
from miles_ray.checkpoint import RunCheckpointer
from miles_ray.data import DatasetSource, DatasetSourceConfig
from miles_ray.engines import SamplingParams
from miles_ray.evaluation import BestMetric, Evaluator, EvaluatorConfig
from miles_ray.metrics import record_phases
from miles_ray.models.hub import MODELS, model_dir
from miles_ray.rewards import ReasoningGymTask, one_digit_arithmetic
from miles_ray.rollout import RolloutFunctionConfig
from miles_ray.stack import StackConfig, build_stack

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--topology", choices=["colocated", "disaggregated"], default="colocated")
p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
p.add_argument("--steps", type=int, default=25)
p.add_argument("--num-ranks", type=int, default=2, help="trainer ranks (and as many engines)")
p.add_argument("--prompts-per-step", type=int, default=8)
p.add_argument("--group-size", type=int, default=8)
p.add_argument("--max-new-tokens", type=int, default=24)
p.add_argument("--lr", type=float, default=1e-5)
p.add_argument("--micro-batch-size", type=int, default=32, help="samples per forward/backward (lower: less memory)")
p.add_argument("--rollout-fn", default="miles_ray.rollout:generate_groups", help="rollout function import path")
p.add_argument("--out", default="runs/quickstart")
add_logger_argument(p)
p.add_argument("--data", default=None, help="train on your dataset (.jsonl/.json/.parquet/HF dir; prompt+answer)")
p.add_argument("--reward", default="miles_ray.rewards.verifiers:math_reward", help="--data: reward import path")
p.add_argument("--system-prompt", default="Solve the problem. Put the final answer in \\boxed{}.", help="--data")
p.add_argument("--eval-data", default=None, help="--data: a held-out set, evaluated every --eval-every steps")
p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: never)")
p.add_argument("--eval-n", type=int, default=4, help="samples per eval prompt (mean@n, pass@1, pass@n; and greedy)")
p.add_argument("--eval-prompts", type=int, default=None, help="evaluate the first N held-out prompts (default: all)")
p.add_argument("--best-metric", default="eval/pass@1", help="the eval metric whose best step is saved in OUT/best")
p.add_argument(
    "--mode",
    choices=["lockstep", "async", "sync"],
    default="lockstep",
    help="lockstep: rollout, train, weight sync in turn; async: rollout goes on while the trainer trains "
    "('sync' is the deprecated name of lockstep)",
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
p.add_argument("--ep", type=int, default=1, help="megatron, MoE models: expert-parallel size (tp x ep divides ranks)")
p.add_argument("--routing-replay", action="store_true", help="MoE models (--model smollm2-moe): replay rollout routes")
p.add_argument(
    "--weight-format",
    choices=["fp8", "int4"],
    default=None,
    help="low-precision recipe for engines and trainer (emulated on CPU)",
)
p.add_argument(
    "--parallel",
    choices=["ddp", "fsdp2"],
    default="ddp",
    help="torch backend: ddp (whole replicas: fewest collectives, right for a model this small) or fsdp2 (sharded)",
)
p.add_argument(
    "--engine-dtype",
    choices=["auto", "float32", "bfloat16"],
    default="auto",
    help="engine weights: auto is bfloat16 where the device computes it natively (GPUs, AVX512-BF16 CPUs), as the "
    "trainer's autocast; the weight sync sends what the engines hold",
)
p.add_argument("--compile", action="store_true", help="torch backend: torch.compile the decoder layers")
p.add_argument(
    "--reserve-memory-gb", type=float, default=0.0, help="torch backend, CPU: GiB of heap each rank touches at start"
)
p.add_argument(
    "--tis-cap",
    type=float,
    default=2.0,
    help="truncated importance sampling: cap on the trainer/engine probability ratio (0: off)",
)
p.add_argument("--export-hf", default=None, help="write the final policy here as an HF model directory")
p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port of Ray's metrics agent (local Ray)")
p.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
args = p.parse_args()
eval_metrics = {f"eval/mean@{args.eval_n}", "eval/pass@1", f"eval/pass@{args.eval_n}", "eval/greedy"}
if (args.eval_data is None) != (args.eval_every == 0) or (args.eval_data and not args.data):
    p.error("--eval-data and --eval-every go together, with --data")
if args.eval_data and args.best_metric not in eval_metrics:
    p.error(f"--best-metric must be one of {sorted(eval_metrics)}")
if args.backend == "megatron" and (args.lora_rank or args.weight_format or args.compile or args.reserve_memory_gb):
    p.error("--backend megatron takes no --lora-rank, --weight-format, --compile or --reserve-memory-gb yet")
if args.mode == "sync":
    warnings.warn("--mode sync is deprecated: use --mode lockstep", DeprecationWarning, stacklevel=1)
    args.mode = "lockstep"

init_ray(args.address, args.metrics_port)
model_path, n, lockstep = str(model_dir(args.model)), args.num_ranks, args.mode == "lockstep"
gpus = gpus_per_bundle(n)

# --- the stack: trainer, engines, router, buffer, weight sync on one placement group -------------
if args.topology == "colocated":  # trainer rank i and engine i share bundle i; weights go through shared memory
    plan, transport = placement.colocated(n, gpus_per_bundle=gpus), "shared_memory"
else:  # trainers and engines on bundles of their own; weights are broadcast over gloo (NCCL on GPUs)
    plan, transport = placement.disaggregated(n, n, gpus_per_trainer=gpus, gpus_per_engine=gpus), "broadcast"
recipe = {"format": args.weight_format} if args.weight_format else None  # one recipe for rollout and training
if args.backend == "megatron":  # the n ranks form n / tp data-parallel groups of tp tensor-parallel ranks
    # an MoE layer's experts are spread over ep of them; MoE under TP needs sequence parallelism
    parallel = {"tensor_model_parallel_size": args.tp, "expert_model_parallel_size": args.ep}
    parallel["sequence_parallel"] = args.tp > 1 and args.model.endswith("moe")
    backend = {"kind": "megatron", "micro_batch_size": args.micro_batch_size, "parallel": parallel}
    backend["routing_replay"] = args.routing_replay
else:
    lora = {"rank": args.lora_rank, "alpha": 2 * args.lora_rank} if args.lora_rank else None
    backend = {"micro_batch_size": args.micro_batch_size, "autocast": "auto", "routing_replay": args.routing_replay}
    backend.update(weight_format=recipe, lora=lora, parallel=args.parallel, compile=args.compile)
    backend["reserve_memory_gb"] = args.reserve_memory_gb
trainer = {"model_path": model_path, "num_ranks": n, "optimizer": {"lr": args.lr}, "backend": backend}
# engines and trainer differ a little (bf16, low-precision recipes, kernels): TIS weighs tokens by their capped ratio
trainer["mismatch_correction"] = {"kind": "tis", "cap": args.tis_cap} if args.tis_cap else None
engine = {"model_path": model_path, "max_seq_len": 512, "weight_format": recipe, "dtype": args.engine_dtype}
stack = build_stack(
    StackConfig(
        trainer=trainer,  # temperature 1: the trainer divides its logits by the rollout temperature, as engines do
        pool={"num_engines": n, "engine": engine},
        buffer={"max_staleness": 0 if lockstep else args.max_staleness},
        broadcaster={"transport": transport, "in_flight": args.in_flight},
        name_prefix="miles_ray",  # ray.get_actor("miles_ray/trainer") from a notebook
    ),
    placement.create(plan),
)

# --- task: one-digit sums scored by reasoning-gym's score_answer, or --data scored by --reward ---------
tokenizer, evaluator = AutoTokenizer.from_pretrained(model_path), None
if args.data:  # your rows: checked and tokenised now; prompts too long for the engine are dropped and counted
    limit = engine["max_seq_len"] - args.max_new_tokens
    source = DatasetSourceConfig(
        path=args.data, reward=args.reward, system_prompt=args.system_prompt, max_prompt_tokens=limit
    )
    task = DatasetSource(source, tokenizer)
    print(f"data: {task.stats()}")
    if args.eval_data:  # held out: sampled on the same engines between steps, the best step kept in OUT/best
        held_out = DatasetSource(source.model_copy(update={"path": args.eval_data}), tokenizer)
        k = sorted({1, args.eval_n})
        cfg = EvaluatorConfig(n=args.eval_n, k=k, max_new_tokens=args.max_new_tokens, max_prompts=args.eval_prompts)
        evaluator = Evaluator(cfg, held_out)
        best, best_ckpt = BestMetric(args.best_metric), RunCheckpointer(Path(args.out) / "best", keep_last=1)
else:
    task = ReasoningGymTask(one_digit_arithmetic(seed=1), tokenizer)
sampling = SamplingParams(n=args.group_size, max_new_tokens=args.max_new_tokens)
rollout = RolloutFunctionConfig(fn=args.rollout_fn).resolve()  # (router, task, params, n) -> [GroupRef]
streamer = None
if not lockstep:  # streams groups into the buffer, one batch ahead of the trainer (one-step off-policy)
    cfg = AsyncRolloutConfig(
        sampling=sampling, prompts_in_flight=args.prompts_per_step, max_buffered_groups=args.prompts_per_step
    )
    streamer = AsyncRollout.options(name="miles_ray/async_rollout").remote(cfg, stack.router, stack.buffer, task)

# --- whole-run checkpoints: trainer, buffer, data position, step ----------------------------------
ckpt, first_step = RunCheckpointer(Path(args.out) / "checkpoints"), 0
data = {"data_source": task} if lockstep else {"async_rollout": streamer}
if args.resume and ckpt.latest() is not None:
    first_step = ckpt.load(None, stack.trainer, buffer=stack.buffer, **data)["step"]
    print(f"resumed from {ckpt.latest()} at step {first_step}")
log = RunLog(Path(args.out), first_step, logger=args.logger, config=vars(args))


def save(step: int, into: RunCheckpointer = ckpt) -> None:
    if streamer is not None:
        ray.get(streamer.stop.remote())  # land the prompts in flight, so the buffer and the position agree
    into.save(step, stack.trainer, buffer=stack.buffer, **data)
    if streamer is not None:
        ray.get(streamer.start.remote())


# --- the GRPO loop: rollout -> buffer -> train -> weight sync --------------------------------------
version = ray.get(stack.trainer.weight_version.remote())
ray.get(stack.broadcaster.sync.remote(version))
if streamer is not None:
    ray.get(streamer.start.remote())
for step in (bar := tqdm(range(first_step, args.steps), desc="GRPO")):
    t0 = time.perf_counter()
    if lockstep:
        ray.get(stack.buffer.add.remote(rollout(stack.router, task, sampling, args.prompts_per_step)))
    batch = ray.get(stack.buffer.get_batch.remote(args.prompts_per_step, current_version=version, timeout_s=3600))
    if batch is None:
        raise RuntimeError(f"no batch within an hour: {ray.get(streamer.stats.remote())}")
    samples = [s for g in ray.get([g.ref for g in batch]) for s in g]
    staleness = sum(version - g.weight_version for g in batch) / len(batch)  # versions behind when taken
    t1 = time.perf_counter()
    metrics = ray.get(stack.trainer.train_step.remote(batch))  # GRPO advantages + PPO-clip, one optimizer step
    t2 = time.perf_counter()
    version = metrics["weight_version"]
    sync = ray.get(stack.broadcaster.sync.remote(version))  # raises if an engine's version or checksum is off
    t3 = time.perf_counter()
    phases = {"rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2, "step_s": t3 - t0}
    record = step_record(
        step,
        samples,
        metrics,
        kl=metrics["train_rollout_k3_kl"],
        staleness_mean=staleness,
        sync_gb_per_s=sync["gb_per_s"],
        **phases,
    )
    if "moe_route_mismatch_frac" in metrics:  # MoE: expert sets the trainer's routers pick unlike the rollout
        record["moe_route_mismatch_frac"] = metrics["moe_route_mismatch_frac"]
    if evaluator is not None and (step + 1) % args.eval_every == 0:  # the weights just synced, on held-out data
        record |= evaluator.evaluate(stack.router)
        if best.update(record, step + 1):
            save(step + 1, into=best_ckpt)
    log.write(record)
    record_phases({"rollout": t1 - t0, "train": t2 - t1, "sync": t3 - t2})
    if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
        save(step + 1)
    bar.set_postfix(reward=f"{record['reward_mean']:.3f}", step_s=f"{record['step_s']:.1f}")

if streamer is not None:
    ray.get(streamer.stop.remote())
if args.export_hf:
    print(f"exported the policy to {ray.get(stack.trainer.export_hf.remote(args.export_hf))}")
log.summary()
if evaluator is not None:
    print(f"best {best.metric}: {best.value:.3f} at step {best.step} (checkpoint in {best_ckpt.root})")
