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
