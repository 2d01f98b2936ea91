"""The examples run as users run them (a subprocess with its own Ray cluster), on the tiny model for one step."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_tool_use_example_runs_one_step(tmp_path, tiny_model_path):
    cmd = [sys.executable, "examples/tool_use.py", "--model", "tiny", "--steps", "1", "--num-ranks", "1"]
    cmd += ["--prompts-per-step", "2", "--group-size", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [record] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 0 and record["policy_tokens_mean"] > 0 and 0.0 <= record["reward_mean"] <= 1.0


def test_ppo_example_runs_two_steps(tmp_path, tiny_model_path):
    """Seven actors (critic and reference included) on one colocated bundle; the critic's metrics are logged."""
    cmd = [sys.executable, "examples/ppo.py", "--model", "tiny", "--steps", "2", "--num-ranks", "1"]
    cmd += ["--prompts-per-step", "2", "--samples-per-prompt", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in records] == [1, 2]
    assert records[0]["ref_kl"] == pytest.approx(0.0, abs=1e-6) and records[0]["value_loss"] >= 0
    assert (tmp_path / "reward_curve.png").exists()
