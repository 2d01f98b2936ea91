"""The evaluator on a real Router and embedded engine: every held-out prompt sampled, scored and summarised."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from helpers import engines_and_router
from transformers import AutoTokenizer

from miles_ray import placement
from miles_ray.data import DatasetSource, DatasetSourceConfig
from miles_ray.evaluation import Evaluator, EvaluatorConfig

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"prompt": f"Question {i}?", "answer": str(i), "data_source": "abbc"[i % 4]} for i in range(8)]


def test_eval_metrics_overall_and_per_source(make_placement, tiny_model_path):
    _pool, _engines, router = engines_and_router(make_placement(placement.colocated(1)), tiny_model_path, 1)
    config = DatasetSourceConfig(reward="helpers:reward_by_source")
    source = DatasetSource(config, AutoTokenizer.from_pretrained(tiny_model_path), ROWS)
    evaluator = Evaluator(EvaluatorConfig(n=3, k=[1, 3], max_new_tokens=4), source)
    metrics = evaluator.evaluate(router)
    assert metrics["eval/num_prompts"] == 8 and metrics["eval/reward_failures"] == 2 * (3 + 1)  # 2 rows of c
    assert metrics["eval/a/mean@3"] == metrics["eval/a/pass@3"] == metrics["eval/a/greedy"] == 1.0
    assert metrics["eval/b/pass@1"] == 0.0 and metrics["eval/c/mean@3"] == 0.0  # a failed reward scores 0
    assert metrics["eval/mean@3"] == metrics["eval/pass@1"] == metrics["eval/greedy"] == pytest.approx(2 / 8)
    assert ray.get(router.stats.remote())["served"] == {0: 16}  # 8 sampled + 8 greedy requests
    partial = Evaluator(EvaluatorConfig(n=1, greedy=False, max_prompts=3, max_new_tokens=2), source)
    assert partial.evaluate(router)["eval/num_prompts"] == 3 and source.stats()["uid"] == 0  # training order untouched


def test_the_eval_command_scores_an_hf_directory(tmp_path, tiny_model_path):
    """``python -m miles_ray.eval`` as a user runs it (its own Ray cluster), on the tiny model and the test split."""
    out = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "miles_ray.eval", tiny_model_path, "--data", "examples/data/gsm_symbolic/test.jsonl"]
    cmd += ["--n", "2", "--k", "1", "2", "--max-new-tokens", "4", "--max-prompts", "5", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads(out.read_text())
    assert metrics == json.loads(proc.stdout[proc.stdout.index("{") :])
    assert metrics["eval/num_prompts"] == 5 and 0 <= metrics["eval/pass@1"] <= metrics["eval/pass@2"] <= 1
    assert {"eval/mean@2", "eval/greedy", "eval/gsm_symbolic/pass@2"} <= set(metrics)


def test_the_eval_command_refuses_bad_input_before_starting_engines(tmp_path, tiny_model_path):
    cmd = [sys.executable, "-m", "miles_ray.eval", tiny_model_path, "--data", "examples/data/gsm_symbolic/test.jsonl"]
    proc = subprocess.run(cmd + ["--n", "2", "--k", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "k values [4] must be between 1 and n=2" in proc.stderr
    assert "ray.init" not in proc.stderr and "Started a local Ray instance" not in proc.stderr
    proc = subprocess.run(cmd + ["--answer-column", "solution"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "has no column 'solution' (DatasetSourceConfig.answer_column)" in proc.stderr
