"""miles_ray.report turns a run's JSONL log into a PNG (reward, response length, step-time phases)."""

import json

import pytest

from miles_ray.report import plot_run, read_jsonl


def test_plot_run_writes_a_png_beside_the_log(tmp_path):
    log = tmp_path / "metrics.jsonl"
    rows = [
        {"step": i, "reward_mean": i / 10, "response_len_mean": 5 + i, "rollout_s": 1.0, "train_s": 2.0, "sync_s": 0.1}
        for i in range(6)
    ]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_jsonl(log) == rows  # blank lines skipped
    png = plot_run(log)
    assert png == tmp_path / "reward_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_run_refuses_an_empty_log(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no records"):
        plot_run(tmp_path / "empty.jsonl")


def test_eval_scores_are_drawn_on_the_reward_panel(tmp_path):
    rows = [{"step": i, "reward_mean": i / 10, "response_len_mean": 5} for i in range(6)]
    (tmp_path / "plain.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows[2]["eval/pass@1"], rows[5]["eval/pass@1"] = 0.2, 0.6
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain, with_eval = (plot_run(tmp_path / f"{n}.jsonl", tmp_path / f"{n}.png") for n in ("plain", "eval"))
    assert plain.read_bytes() != with_eval.read_bytes()
