"""A GRPO step of the quick-start workload, phase by phase, and side by side with another commit.

Runs ``examples/quickstart.py`` (SmolLM2-135M, 8 prompts x 8 samples, <= 24 new tokens, 2 trainer ranks and 2
engines colocated) for ``--steps`` steps and reports the mean rollout / train / weight-sync seconds and samples/s
over the steps after the first ``--warmup`` (default 1: the first step pays warm-up), and beside them the mean step
over all steps but the first (``step_s_after_first``). A CPU trainer rank's heap grows over its first ~3 train steps
(optimizer state, DDP's rebuilt buckets, activations: page faults that later steps, reusing the memory, do not pay),
so ``--warmup 3`` gives the steady step, and the column beside it what a short run sees. With ``--compare REF`` the
same run is made on commit REF (a git worktree, with this environment) in the same invocation, one after the other,
and the table gains the ratios REF / this tree. Both runs sample with per-request seeds (a rollout function given by
import path, which both commits accept), so they train on near-identical batches: continuous batching makes a
rollout depend a little on which requests share a decode step, so the first step's loss and grad norm, printed for
both, agree closely but not exactly; ``tests/unit/backends/test_packing.py`` checks the exact equality on one batch.

With ``--also FLAGS`` this tree runs a second time with those quick-start flags added (e.g. the configuration
REF defaulted to), so the table separates what the code gained from what the new defaults gained.

    python benchmarks/grpo_step.py --steps 4 --compare b4aa437
    python benchmarks/grpo_step.py --steps 12 --warmup 3 --compare b4aa437    # steady steps, and all but the first
    python benchmarks/grpo_step.py --steps 6 --compare b4aa437 --also "--parallel fsdp2 --engine-dtype float32"
    python benchmarks/grpo_step.py --steps 4 -- --lora-rank 16     # extra quick-start flags (both runs) after --
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import emit

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout_s", "train_s", "sync_s", "step_s")


SEEDED = '''
from miles_ray.rollout import generate_groups


def seeded(router, task, params, num_prompts):
    """The default rollout, each step's requests seeded by the data position (the same in every run)."""
    return generate_groups(router, task, params.model_copy(update={"seed": 1000 + task.position}), num_prompts)
'''


def run(tree: Path, out: Path, args, extra: list[str]) -> list[dict]:
    """The quick-start of ``tree`` for ``args.steps`` steps; its per-step records."""
    out.mkdir(parents=True)
    (out / "grpo_step_seeded.py").write_text(SEEDED)
    cmd = [sys.executable, "examples/quickstart.py", "--model", args.model, "--steps", str(args.steps)]
    cmd += ["--prompts-per-step", str(args.prompts), "--group-size", str(args.group_size), "--out", str(out)]
    cmd += ["--rollout-fn", "grpo_step_seeded:seeded", *extra]
    paths = [str(tree / "src"), str(out), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"quick-start in {tree} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(name: str, records: list[dict], samples_per_step: int, warmup: int) -> dict:
    """Mean phases over the steps after the first ``warmup``, samples/s, the mean step after the first, first loss."""
    steady = records[warmup:]
    row = {"commit": name, "steps": len(steady)}
    row.update({p: sum(r[p] for r in steady) / len(steady) for p in PHASES})
    row["samples_per_s"] = samples_per_step / row["step_s"]
    row["step_s_after_first"] = sum(r["step_s"] for r in records[1:]) / (len(records) - 1)
    row["first_step_s"] = records[0]["step_s"]
    row["first_loss"] = records[0]["loss"]
    row["first_grad_norm"] = records[0]["grad_norm"]
    return row


def ratios(ref_name: str, ours: dict, ref: dict) -> dict:
    """REF's phase seconds over ours (above 1: we are faster), and our samples/s over REF's."""
    row = {"commit": f"{ref_name} / {ours['commit']}", "steps": ours["steps"]}
    row.update({p: ref[p] / ours[p] for p in PHASES})
    row["samples_per_s"] = ours["samples_per_s"] / ref["samples_per_s"]
    row["step_s_after_first"] = ref["step_s_after_first"] / ours["step_s_after_first"]
    row["first_step_s"] = row["first_loss"] = row["first_grad_norm"] = None
    return row


def worktree(ref: str) -> Path:
    """A detached worktree of ``ref`` (removed by the caller)."""
    path = Path(tempfile.mkdtemp(prefix="miles_ray_ref_"))
    subprocess.run(["git", "worktree", "add", "--detach", "--force", str(path), ref], cwd=ROOT, check=True)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=4, help="steps per run")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the means (>= 1)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--compare", default=None, help="another commit (or branch) to run the same workload on")
    p.add_argument("--also", default=None, help="quick-start flags of a second run of this tree")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--name", default="grpo_step", help="results: benchmarks/results/NAME.json")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if not 1 <= args.warmup < args.steps:
        p.error(f"--warmup must be at least 1 and below --steps ({args.steps}), got {args.warmup}")
    per_step = args.prompts * args.group_size
    ours = [("this tree", extra)] + ([(f"this tree {args.also}", extra + args.also.split())] if args.also else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, flags) in enumerate(ours):
            rows.append(summary(name, run(ROOT, Path(tmp) / f"this{i}", args, flags), per_step, args.warmup))
        if args.compare:
            tree = worktree(args.compare)
            try:
                ref = summary(args.compare, run(tree, Path(tmp) / "ref", args, extra), per_step, args.warmup)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
            rows += [ref] + [ratios(args.compare, row, ref) for row in list(rows)]
    emit(args.name, rows)


if __name__ == "__main__":
    main()
