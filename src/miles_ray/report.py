"""Turn a run's JSONL metrics log into PNG plots (reward curve, response length, step-time breakdown).

Usage::

    python -m miles_ray.report runs/quickstart/metrics.jsonl          # writes reward_curve.png beside it
"""

from __future__ import annotations

import argparse
from pathlib import Path

from miles_ray.trackers import read_jsonl  # the log JsonlTracker writes


def plot_run(path: str | Path, out: str | Path | None = None) -> Path:
    """Plot reward mean (with a moving average), response length and step-time phases per step.

    Returns:
        The PNG path (``reward_curve.png`` beside the log unless ``out`` is given).

    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(path)
    if not rows:
        raise ValueError(f"{path} has no records")
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    reward = [r["reward_mean"] for r in rows]
    window = max(1, len(reward) // 10)
    smooth = [
        sum(reward[max(0, i - window + 1) : i + 1]) / len(reward[max(0, i - window + 1) : i + 1])
        for i in range(len(reward))
    ]
    axes[0].plot(steps, reward, "o-", alpha=0.4, label="reward mean")
    axes[0].plot(steps, smooth, "-", lw=2, label=f"moving avg ({window})")
    evals = [r for r in rows if "eval/pass@1" in r]  # held-out scores, on the steps that evaluated
    if evals:
        axes[0].plot([r["step"] for r in evals], [r["eval/pass@1"] for r in evals], "s--", label="eval pass@1")
    axes[0].set(xlabel="step", ylabel="reward", title="Reward")
    axes[0].legend()
    axes[1].plot(steps, [r["response_len_mean"] for r in rows])
    axes[1].set(xlabel="step", ylabel="tokens", title="Response length")
    phases = [k for k in ("rollout_s", "train_s", "sync_s") if k in rows[0]]
    bottom = [0.0] * len(rows)
    for k in phases:
        vals = [r[k] for r in rows]
        axes[2].bar(steps, vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[2].set(xlabel="step", ylabel="seconds", title="Step time by phase")
    axes[2].legend()
    fig.tight_layout()
    out = Path(out) if out else Path(path).with_name("reward_curve.png")
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main() -> None:
    """CLI entry: ``python -m miles_ray.report LOG.jsonl [--out PNG]``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("log")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    print(plot_run(args.log, args.out))


if __name__ == "__main__":
    main()
