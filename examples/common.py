"""Plumbing the example drivers share (starting Ray, the run log, the closing summary), so each reads as its loop."""

from __future__ import annotations

import os
from pathlib import Path

import ray

from miles_ray.report import plot_run
from miles_ray.trackers import TRACKERS, open_trackers, parse_names, read_jsonl


def init_ray(address: str | None = None, metrics_port: int | None = None) -> None:
    """Attach to the cluster at ``address``, or start a local one with at least 8 logical CPUs.

    Fractional actors (a trainer rank and an engine sharing a bundle) then schedule on a 2-core laptop.
    """
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    local = {} if address else {"num_cpus": max(8, os.cpu_count() or 1)}
    if metrics_port and not address:
        local["_metrics_export_port"] = metrics_port
    ray.init(address=address, **local)


def gpus_per_bundle(num_bundles: int) -> float:
    """One GPU per bundle when the cluster has a GPU for each, else none (the CPU run)."""
    return 1.0 if ray.cluster_resources().get("GPU", 0) >= num_bundles else 0.0


def step_record(step: int, samples: list, metrics: dict, **more) -> dict:
    """What every example logs per step: the batch's reward and length, the trainer's main metrics, then ``more``."""
    return {
        "step": step,
        "weight_version": metrics["weight_version"],
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
        "loss": metrics["loss"],
        "clipfrac": metrics["clipfrac"],
        "grad_norm": metrics["grad_norm"],
        "logprob_diff_max": metrics["train_rollout_logprob_abs_diff_max"],  # engine vs trainer, same tokens
        "step_skipped": metrics["step_skipped"],
        "example": samples[0].response_text[:80],
        **more,
    }


def add_logger_argument(parser) -> None:
    """``--logger``: the experiment trackers a run writes to (``miles_ray.trackers``)."""
    parser.add_argument(
        "--logger",
        default="jsonl",
        help=f"comma-separated trackers from {','.join(TRACKERS)}; all write under --out (wandb offline)",
    )


class RunLog:
    """The run's trackers (``metrics.jsonl`` always, for the plot), one record per step.

    Resuming at ``first_step`` keeps the JSONL records before it.
    """

    def __init__(self, out_dir: Path, first_step: int = 0, logger: str = "jsonl", config: dict | None = None):
        names = parse_names(logger)
        names = names if "jsonl" in names else ["jsonl", *names]  # the summary plots the JSONL log
        self.path = out_dir / "metrics.jsonl"
        self.trackers = open_trackers(names, out_dir, run_name=out_dir.name, config=config, first_step=first_step)

    def write(self, record: dict) -> None:
        """Log one step's record to every tracker."""
        self.trackers.log({k: v for k, v in record.items() if k != "step"}, record["step"])

    def close(self) -> None:
        """Flush and finish every tracker."""
        self.trackers.close()

    def summary(self, keys: tuple[str, ...] = ("reward_mean",)) -> None:
        """Close the trackers, plot the run and print each key's mean over the first and the last fifth of the steps."""
        self.close()
        rows = read_jsonl(self.path)
        k = max(1, len(rows) // 5)
        print(f"reward curve: {plot_run(self.path)}")
        for key in keys:
            first, last = (sum(r[key] for r in part) / len(part) for part in (rows[:k], rows[-k:]))
            print(f"{key}, first {k} steps: {first:.3f}; last {k} steps: {last:.3f}")
