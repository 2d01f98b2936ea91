"""Shared helpers for benchmarks: print a table and write the JSON next to it."""

from __future__ import annotations

import json
import platform
from pathlib import Path


def emit(name: str, rows: list[dict], out_dir: str = "benchmarks/results") -> Path:
    """Print ``rows`` as an aligned table and write ``{out_dir}/{name}.json``."""
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols}
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    print("-+-".join("-" * widths[c] for c in cols))
    for r in rows:
        print(" | ".join(_fmt(r[c]).ljust(widths[c]) for c in cols))
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "rows": rows}, indent=2))
    print(f"wrote {path}")
    return path


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)
