"""The GPU check (#20) on this CPU with ``--device cpu``: every row's code runs, with Ray unimportable, so the
script cannot rot between the rare GPU runs. Its figures are CPU figures; the test checks what they must agree on."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.megatron  # the Megatron row needs megatron-core
ROOT = Path(__file__).resolve().parents[2]


def _rows(tmp_path: Path) -> dict[str, list[dict]]:
    blocked = tmp_path / "blocked" / "ray"  # a `ray` package that fails to import, as on the GPU machine
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('ray is not installed on the GPU machine')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked.parent), str(ROOT)])}
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows: dict[str, list[dict]] = {}
    for row in json.loads((tmp_path / "gpu_check_cpu.json").read_text())["rows"]:
        rows.setdefault(row["check"], []).append(row)
    return rows


def test_every_row_runs_on_cpu_without_ray(tiny_model_path, tmp_path):
    """Engine vs HF generate (dense and MoE), engine/trainer logprobs, GRPO step in three layouts, colocated sync
    between two processes, a verified sync then generation, and the Megatron steps (dense, MoE): all rows, agreeing
    figures."""
    rows = _rows(tmp_path)
    assert set(rows) == {
        "engine decode", "engine MoE decode", "engine vs trainer logprobs", "grpo step", "colocated sync",
        "verified sync", "megatron step", "megatron MoE step",
    }  # fmt: skip
    for check in ("engine decode", "engine MoE decode", "colocated sync"):
        assert all(r["value"] > 0 and r["reference"] > 0 for r in rows[check]), rows[check]
    fp32, bf16 = rows["engine vs trainer logprobs"]
    assert fp32["value"] < 1e-5 and 0 < bf16["value"] < 0.05  # exact in fp32; bf16 rounding, bounded
    norms = [r["grad_norm"] for r in rows["grpo step"]]  # padded, packed, shared prefix: the same gradient
    assert norms[0] > 0 and norms == pytest.approx([norms[0]] * 3, rel=1e-4)
    [verified] = rows["verified sync"]  # the digest matched (else the script fails) and the new weights generate
    assert verified["value"] < 1e-5
    [megatron] = rows["megatron step"]
    assert megatron["ratio"] == pytest.approx(1.0, rel=1e-3)  # Megatron's gradient norm = the torch backend's
    [moe] = rows["megatron MoE step"]  # megatron-core's MoE layers: the HF Mixtral's gradient
    assert moe["value"] > 0 and moe["ratio"] == pytest.approx(1.0, rel=1e-3)
