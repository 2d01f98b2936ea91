"""Shared helpers for benchmarks: print a table and write the JSON next to it."""

from __future__ import annotations

import json
import platform
from pathlib import Path


def emit(name: str, rows: list[dict], out_dir: str = "benchmarks/results") -> Path:
    """Print ``rows`` as an aligned table and write ``{out_dir}/{name}.json``; a row may lack columns (shown ``-``)."""
    cols = list(dict.fromkeys(c for r in rows for c in r))  # every column, in order of first appearance
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    print("-+-".join("-" * widths[c] for c in cols))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in cols))
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "rows": rows}, indent=2))
    print(f"wrote {path}")
    return path


def arithmetic_prompts(tok, num: int) -> list[list[int]]:
    """Token ids of ``num`` short chat-formatted arithmetic questions (the numerics benchmarks' prompts)."""
    chats = [[{"role": "user", "content": f"What is {i} + {2 * i + 1}? Answer briefly."}] for i in range(num)]
    return [tok(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True))["input_ids"] for c in chats]


def mismatch_stats(train, rollout) -> dict:
    """Trainer vs rollout logprobs of the same tokens (1-D tensors): abs diff, k3 KL(rollout || train), TIS clips."""
    d, log_ratio = (train - rollout).abs(), rollout - train
    return {
        "tokens": d.numel(),
        "mean_abs_diff": d.mean().item(),
        "max_abs_diff": d.max().item(),
        "k3_kl": (log_ratio.exp() - 1 - log_ratio).mean().item(),
        "tis_clip_frac_cap2": ((train - rollout).exp() > 2).double().mean().item(),
    }


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)
