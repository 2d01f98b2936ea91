"""Evaluate an HF model directory (an exported checkpoint) on a dataset, as training evaluates between steps.

Starts a Ray cluster (or attaches to ``--address``), embedded engines on the model and a Router, then runs
``miles_ray.evaluation.Evaluator`` over a ``DatasetSource`` and prints the metrics as JSON (``--out`` writes them
too). Same prompts, template, reward and estimators as ``examples/quickstart.py --eval-data``.

Usage::

    python -m miles_ray.eval runs/quickstart/hf --data examples/data/aiw/test.jsonl --n 4 --k 1 4
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m miles_ray.eval", description=__doc__.split("\n")[0])
    p.add_argument("model", help="an HF model directory (export_hf output, or any causal LM with a tokenizer)")
    p.add_argument("--data", required=True, help=".jsonl/.json/.parquet file or a save_to_disk directory")
    p.add_argument("--prompt-column", default="prompt")
    p.add_argument("--answer-column", default="answer")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--reward", default="miles_ray.rewards.verifiers:math_reward", help="reward import path")
    p.add_argument("--n", type=int, default=4, help="sampled responses per prompt")
    p.add_argument("--k", type=int, nargs="+", default=[1], help="pass@k for each k")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy response")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--max-seq-len", type=int, default=1024, help="engine context (longer prompts are dropped)")
    p.add_argument("--num-engines", type=int, default=1)
    p.add_argument("--engine-dtype", default="auto", help="engine weights dtype (auto: bf16 where fast)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    p.add_argument("--out", default=None, help="also write the metrics here as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run one evaluation; returns (and prints) its metrics.

    Raises:
        ValueError: for a bad dataset, column, reward or evaluator setting, before any engine starts.

    """
    args = parse_args(argv)
    import ray
    from transformers import AutoTokenizer

    from miles_ray import placement
    from miles_ray.actors import RolloutPool, RolloutPoolConfig, Router, RouterConfig
    from miles_ray.data import DatasetSource, DatasetSourceConfig
    from miles_ray.evaluation import Evaluator, EvaluatorConfig

    source_config = DatasetSourceConfig(
        path=args.data,
        prompt_column=args.prompt_column,
        answer_column=args.answer_column,
        system_prompt=args.system_prompt,
        reward=args.reward,
        max_prompt_tokens=args.max_seq_len - args.max_new_tokens,
    )
    config = EvaluatorConfig(
        n=args.n,
        k=args.k,
        temperature=args.temperature,
        greedy=not args.no_greedy,
        max_new_tokens=args.max_new_tokens,
        max_prompts=args.max_prompts,
    )
    evaluator = Evaluator(config, DatasetSource(source_config, AutoTokenizer.from_pretrained(args.model)))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=args.address, **({} if args.address else {"num_cpus": max(8, os.cpu_count() or 1)}))
    engine = {"model_path": args.model, "max_seq_len": args.max_seq_len, "dtype": args.engine_dtype}
    gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= args.num_engines else 0.0
    pl = placement.create(placement.colocated(args.num_engines, gpus_per_bundle=gpus))  # engines only
    pool = RolloutPool.remote(RolloutPoolConfig(num_engines=args.num_engines, engine=engine), pl)
    router = Router.remote(RouterConfig(), ray.get(pool.engines.remote()))
    metrics = evaluator.evaluate(router)
    print(json.dumps(metrics, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


if __name__ == "__main__":
    main()
