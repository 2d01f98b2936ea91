"""Experiment trackers behind one small interface: JSONL (default), TensorBoard, wandb, MLflow.

A ``Tracker`` takes one record per step (``log(metrics, step)``) and is closed at the end of the run. Drivers
open the ones a user names (``--logger jsonl,tensorboard``) with ``open_trackers`` and log to all of them at
once; like verl's ``Tracking`` and TRL's ``report_to``. Every tracker writes local files only: TensorBoard event
files, a wandb run in offline mode (``wandb sync`` uploads it later; ``mode="online"`` where there is a
network), an MLflow file store (``mlruns/``) unless a tracking URI is given. Numbers go to every tracker;
other values (an example response) go to JSONL only.

Usage::

    trackers = open_trackers("jsonl,tensorboard", "runs/exp1", run_name="exp1", config=vars(args))
    trackers.log({"reward_mean": 0.4, "loss": 0.1}, step=3)
    trackers.close()
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from numbers import Real
from pathlib import Path
from typing import Any, Protocol

TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")


class Tracker(Protocol):
    """Where a run's per-step metrics go."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record ``metrics`` as step ``step``."""
        ...

    def close(self) -> None:
        """Flush and finish the run."""
        ...


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numeric entries of ``metrics`` (bools as 0/1), as floats."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, Real) and math.isfinite(float(v))}


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSONL log, one dict per line (blank lines skipped)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class JsonlTracker:
    """``metrics.jsonl``: one ``{"step", ...}`` line per step; resuming at ``first_step`` keeps the lines before it."""

    def __init__(self, out_dir: str | Path, first_step: int = 0, name: str = "metrics.jsonl"):
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / name
        kept = []
        if first_step and self.path.exists():
            kept = [r for r in read_jsonl(self.path) if r["step"] < first_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Append one line."""
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self) -> None:
        """Nothing to flush: every line is written when logged."""


class TensorBoardTracker:
    """TensorBoard event files under ``log_dir`` (``tensorboard --logdir`` reads them)."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """One scalar per numeric metric."""
        for key, value in numbers(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        """Flush the event file."""
        self.writer.close()


class WandbTracker:
    """A wandb run, offline by default: its files land under ``dir/wandb/`` until ``wandb sync`` uploads them."""

    def __init__(self, dir: str | Path, project: str, run_name: str | None, config: dict | None, mode: str):
        import wandb

        Path(dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=run_name,
            dir=str(dir),
            mode=mode,
            config=config or {},
            reinit="create_new",  # a notebook may run several experiments in one process
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """One history row per step."""
        self.run.log(numbers(metrics), step=step)

    def close(self) -> None:
        """Finish the run (writes its summary)."""
        self.run.finish()


class MLflowTracker:
    """An MLflow run in an experiment; a local file store (``dir/mlruns``) unless ``tracking_uri`` is given."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str | None, config: dict | None):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # a client of its own, not mlflow's global active run: two runs in one notebook stay apart
        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(_mlflow_key(k), str(v)[:6000]) for k, v in (config or {}).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """One batch of metrics at ``step``."""
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_mlflow_key(k), v, now, step) for k, v in numbers(metrics).items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        """Mark the run finished."""
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    return re.sub(r"[^\w\-./ ]", "_", key)  # MLflow keys allow letters, digits, _ - . / and spaces


class Trackers:
    """Several trackers as one: each record goes to all of them."""

    def __init__(self, trackers: Iterable[Tracker]):
        self.trackers = list(trackers)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Log to every tracker."""
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def close(self) -> None:
        """Close every tracker."""
        for tracker in self.trackers:
            tracker.close()


def parse_names(names: str | Iterable[str]) -> list[str]:
    """``"jsonl,tensorboard"`` or a list as a checked list of tracker names.

    Raises:
        ValueError: for an unknown name or none at all.

    """
    wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    unknown = [n for n in wanted if n not in TRACKERS]
    if unknown or not wanted:
        raise ValueError(f"logger must be a comma-separated list of {TRACKERS}, got {names!r}")
    return list(dict.fromkeys(wanted))


def open_trackers(
    names: str | Iterable[str],
    out_dir: str | Path,
    project: str = "miles_ray",
    run_name: str | None = None,
    config: dict | None = None,
    first_step: int = 0,
    wandb_mode: str = "offline",
    mlflow_uri: str | None = None,
) -> Trackers:
    """Open the named trackers, each writing under ``out_dir``.

    Args:
        names: tracker names (``TRACKERS``), as a list or comma-separated.
        out_dir: the run directory: ``metrics.jsonl``, ``tensorboard/``, ``wandb/``, ``mlruns/`` go there.
        project: the wandb project and MLflow experiment.
        run_name: the run's name in wandb and MLflow (default: theirs).
        config: the run's hyperparameters (wandb config, MLflow params).
        first_step: a resumed run's first step (JSONL keeps the lines before it).
        wandb_mode: ``offline`` (default, no network), ``online`` or ``disabled``.
        mlflow_uri: an MLflow tracking URI (default: a file store in ``out_dir/mlruns``).

    Raises:
        ValueError: for an unknown tracker name; ImportError (naming the package) for one not installed.

    """
    out_dir = Path(out_dir)
    opened: list[Tracker] = []
    for name in parse_names(names):
        if name == "jsonl":
            opened.append(JsonlTracker(out_dir, first_step))
        elif name == "tensorboard":
            opened.append(TensorBoardTracker(out_dir / "tensorboard"))
        elif name == "wandb":
            opened.append(WandbTracker(out_dir, project, run_name, config, wandb_mode))
        else:
            uri = mlflow_uri or f"sqlite:///{(out_dir / 'mlflow.db').resolve()}"
            opened.append(MLflowTracker(uri, project, run_name, config))
    return Trackers(opened)
