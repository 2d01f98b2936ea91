"""The examples run as users run them (a subprocess with its own Ray cluster), on the tiny model for one step."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run an example as a user would, from the repository root; it must succeed."""
    proc = subprocess.run(cmd, cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_tool_use_example_runs_one_step(tmp_path, tiny_model_path):
    cmd = [sys.executable, "examples/tool_use.py", "--model", "tiny", "--steps", "1", "--num-ranks", "1"]
    _run(cmd + ["--prompts-per-step", "2", "--group-size", "2", "--out", str(tmp_path)])
    [record] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 0 and record["policy_tokens_mean"] > 0 and 0.0 <= record["reward_mean"] <= 1.0


def test_quickstart_runs_checkpoints_and_resumes(tmp_path, tiny_model_path):
    """Two lockstep steps with a whole-run checkpoint after each (under the deprecated ``--mode sync``), then a
    resumed run that continues at step 2 from the checkpoint and keeps the log of the steps before it."""
    base = [sys.executable, "examples/quickstart.py", "--model", "tiny", "--num-ranks", "1", "--prompts-per-step", "2"]
    base += ["--group-size", "2", "--max-new-tokens", "8", "--out", str(tmp_path), "--checkpoint-every", "1"]
    first = _run(base + ["--steps", "2", "--mode", "sync"])
    assert "--mode sync is deprecated: use --mode lockstep" in first.stderr
    second = _run(base + ["--steps", "3", "--resume"])
    assert "at step 2" in second.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and [r["weight_version"] for r in records] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000003"]


def test_quickstart_trains_on_a_users_data_with_every_tracker(tmp_path, tiny_model_path):
    """One step on the generated GSM data (scored by math-verify), evaluated on the test split, logged to JSONL,
    TensorBoard, wandb and MLflow."""
    cmd = [sys.executable, "examples/quickstart.py", "--model", "tiny", "--num-ranks", "1", "--steps", "1"]
    cmd += ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--out", str(tmp_path)]
    data = "examples/data/gsm_symbolic"
    cmd += ["--data", f"{data}/train.jsonl", "--eval-data", f"{data}/test.jsonl", "--eval-every", "1"]
    proc = _run(cmd + ["--eval-n", "2", "--logger", "tensorboard,wandb,mlflow"])
    assert "'num_rows': 1000" in proc.stdout and "best eval/pass@1: " in proc.stdout
    [record] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 0 and record["weight_version"] == 1
    assert record["eval/num_prompts"] == 100 and 0 <= record["eval/pass@1"] <= record["eval/pass@2"] <= 1
    assert record["eval/gsm_symbolic/mean@2"] == record["eval/mean@2"]  # one source: the breakdown is the total
    assert [p.name for p in (tmp_path / "best").glob("step_*")] == ["step_00000001"]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("miles_ray").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0]
    assert run.data.params["data"] == "examples/data/gsm_symbolic/train.jsonl"


@pytest.mark.parametrize("task", ["gsm_symbolic", "aiw"])
def test_the_example_data_is_what_its_script_generates(tmp_path, task):
    _run([sys.executable, "examples/data/make_data.py", "--task", task, "--out", str(tmp_path)])
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_text() == (ROOT / "examples" / "data" / task / name).read_text()
    train = {json.loads(line)["prompt"] for line in (tmp_path / "train.jsonl").read_text().splitlines()}
    test = [json.loads(line)["prompt"] for line in (tmp_path / "test.jsonl").read_text().splitlines()]
    assert len(train) == 1000 and len(test) == 100 and not train & set(test)


def test_ppo_example_runs_two_steps_scored_by_a_reward_model(tmp_path, tiny_model_path):
    """Seven actors (critic and reference included) on one colocated bundle; the critic's metrics are logged;
    ``--reward-model``: a sequence classifier (the tiny model with a one-label head) scores the responses."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1).save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path / "rm")
    cmd = [sys.executable, "examples/ppo.py", "--model", "tiny", "--steps", "2", "--num-ranks", "1"]
    cmd += ["--prompts-per-step", "2", "--samples-per-prompt", "2", "--out", str(tmp_path / "run")]
    _run(cmd + ["--reward-model", str(tmp_path / "rm")])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in records] == [1, 2]
    assert records[0]["ref_kl"] == pytest.approx(0.0, abs=1e-6) and records[0]["value_loss"] >= 0
    assert (tmp_path / "run" / "reward_curve.png").exists()
    for record in records:  # the rule reward of 4 samples is a multiple of 1/4; the reward model's scores are not
        assert record["reward_mean"] * 4 != pytest.approx(round(record["reward_mean"] * 4), abs=1e-6)
