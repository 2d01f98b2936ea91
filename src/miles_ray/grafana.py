"""A Grafana dashboard for the miles_ray metrics, beside Ray's own dashboards.

Ray's metrics agents export every ``miles_ray_*`` metric (as ``ray_miles_ray_*``, ``miles_ray.metrics``); Ray's
Grafana set-up provisions the dashboards in ``<session>/metrics/grafana/dashboards``. ``install()`` writes this
dashboard there, so Grafana started the way Ray's docs say (``grafana-server --config
<session>/metrics/grafana/grafana.ini web``) shows it next to Ray's "Default" and "Serve" dashboards; the same
JSON ships as ``docs/grafana/miles_ray.json`` for importing by hand (Dashboards > Import).

    python -m miles_ray.grafana              # into Ray's dashboards folder: RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR,
                                             # else /tmp/ray/session_latest/metrics/grafana/dashboards
    python -m miles_ray.grafana --out DIR    # anywhere else (another Ray temp dir: <it>/session_latest/...)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

UID = "miles-ray-rl"
# where Ray's Grafana provisioning reads dashboards (Ray's own variable first, as Ray does)
RAY_DASHBOARDS = os.environ.get(
    "RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", "/tmp/ray/session_latest/metrics/grafana/dashboards"
)
FILE_NAME = "miles_ray.json"
_RATE = "[$__rate_interval]"

# (row title, [(panel title, unit, [(PromQL, legend)])]): every metric of miles_ray.metrics, by the actor recording it
ROWS = [
    ("Trainer", [
        ("Weight version", "none", [("max(ray_miles_ray_trainer_weight_version)", "trainer")]),
        ("Reward mean", "none", [("max(ray_miles_ray_reward_mean)", "reward")]),
        ("Loss and grad norm", "none", [("max(ray_miles_ray_train_loss)", "loss"),
                                         ("max(ray_miles_ray_train_grad_norm)", "grad norm")]),
        ("Train step seconds (p50, p90)", "s", [
            (f"histogram_quantile(0.5, sum by (le) (rate(ray_miles_ray_train_step_seconds_bucket{_RATE})))", "p50"),
            (f"histogram_quantile(0.9, sum by (le) (rate(ray_miles_ray_train_step_seconds_bucket{_RATE})))", "p90"),
        ]),
        ("Steps and samples per second", "none", [
            (f"sum by (skipped) (rate(ray_miles_ray_train_steps_total{_RATE}))", "steps (skipped={{skipped}})"),
            (f"sum(rate(ray_miles_ray_train_samples_total{_RATE}))", "samples"),
        ]),
    ]),
    ("Weight sync", [
        ("Weight version per engine", "none", [("max by (engine) (ray_miles_ray_engine_weight_version)",
                                                 "engine {{engine}}")]),
        ("Sync seconds (p50)", "s", [
            (f"histogram_quantile(0.5, sum by (le) (rate(ray_miles_ray_weight_sync_seconds_bucket{_RATE})))", "p50"),
        ]),
        ("Sync bytes per second", "Bps", [(f"sum(rate(ray_miles_ray_weight_sync_bytes_total{_RATE}))", "bytes")]),
    ]),
    ("Rollout", [
        ("Tokens per second per engine", "none", [
            (f"sum by (engine) (rate(ray_miles_ray_engine_generated_tokens_total{_RATE}))", "engine {{engine}}"),
        ]),
        ("Router queue per engine", "none", [("max by (engine) (ray_miles_ray_router_outstanding)",
                                               "engine {{engine}}")]),
        ("Retries and async samples per second", "none", [
            (f"sum(rate(ray_miles_ray_router_retries_total{_RATE}))", "retries"),
            (f"sum(rate(ray_miles_ray_rollout_samples_total{_RATE}))", "async rollout samples"),
        ]),
    ]),
    ("Replay buffer and driver", [
        ("Buffer groups", "none", [("max(ray_miles_ray_buffer_groups)", "groups")]),
        ("Staleness (versions)", "none", [("max(ray_miles_ray_buffer_staleness_mean)", "mean"),
                                          ("max(ray_miles_ray_buffer_staleness_max)", "max"),
                                          (f"sum(rate(ray_miles_ray_buffer_dropped_stale_total{_RATE}))",
                                           "dropped per second")]),
        ("Driver step phases", "s", [("max by (phase) (ray_miles_ray_driver_phase_seconds)", "{{phase}}")]),
    ]),
    ("Health", [
        ("Healthy actors (1 = answers)", "none", [("min by (actor) (ray_miles_ray_actor_healthy)", "{{actor}}")]),
        ("Replacements and check rounds", "none", [
            ("sum by (role) (ray_miles_ray_health_replacements_total)", "{{role}} replaced"),
            (f"sum(rate(ray_miles_ray_health_rounds_total{_RATE}))", "rounds per second"),
        ]),
    ]),
]  # fmt: skip


def dashboard() -> dict:
    """The dashboard as Grafana's JSON model (a ``datasource`` variable picks the Prometheus source)."""
    panels, y = [], 0
    for row, row_panels in ROWS:
        panels.append({"type": "row", "title": row, "collapsed": False, "id": len(panels) + 1,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})  # fmt: skip
        y += 1
        for i, (title, unit, queries) in enumerate(row_panels):
            panels.append(_panel(len(panels) + 1, title, unit, queries, x=(i % 3) * 8, y=y + (i // 3) * 8))
        y += 8 * ((len(row_panels) + 2) // 3)
    source = {"type": "datasource", "query": "prometheus", "name": "datasource", "label": "Data source"}
    return {
        "uid": UID,
        "title": "miles_ray RL",
        "tags": ["miles_ray", "ray"],
        "timezone": "browser",
        "schemaVersion": 39,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [source]},
        "panels": panels,
    }


def _panel(panel_id: int, title: str, unit: str, queries: list[tuple[str, str]], x: int, y: int) -> dict:
    source = {"type": "prometheus", "uid": "${datasource}"}
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "datasource": source,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + k), "expr": expr, "legendFormat": legend, "datasource": source}
            for k, (expr, legend) in enumerate(queries)
        ],
    }


def install(out_dir: str | Path = RAY_DASHBOARDS) -> Path:
    """Write the dashboard JSON into ``out_dir`` (Ray's provisioned dashboards folder by default)."""
    path = Path(out_dir) / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dashboard(), indent=2) + "\n")
    return path


def main() -> None:
    """``python -m miles_ray.grafana [--out DIR]``: install the dashboard and print where."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=RAY_DASHBOARDS, help="Directory to write miles_ray.json into.")
    print(install(p.parse_args().out))


if __name__ == "__main__":
    main()
