"""The Grafana dashboard (#22): every query names a metric miles_ray records, every metric has a panel, and the
JSON shipped in docs/grafana is what ``python -m miles_ray.grafana`` writes."""

import json
import re
from pathlib import Path

import miles_ray
from miles_ray import grafana

SRC = Path(miles_ray.__file__).resolve().parent
SHIPPED = SRC.parents[1] / "docs" / "grafana" / grafana.FILE_NAME


def _recorded() -> set[str]:
    """Names passed to metrics.counter/gauge/seconds_histogram anywhere in the package (the gauges of the trainer's
    step metrics are named in a loop: their names are the first items of its tuples)."""
    text = "\n".join(p.read_text() for p in SRC.rglob("*.py"))
    names = set(re.findall(r"\b(?:counter|gauge|seconds_histogram)\(\s*\"([a-z_]+)\"", text))
    return names | set(re.findall(r"\(\"(train_loss|train_grad_norm|reward_mean)\", \"", text))


def test_every_query_names_a_recorded_metric_and_every_metric_has_a_panel():
    exprs = [t["expr"] for p in grafana.dashboard()["panels"] for t in p.get("targets", [])]
    used = {m.removesuffix("_bucket") for e in exprs for m in re.findall(r"ray_miles_ray_([a-z_]+)", e)}
    recorded = _recorded()
    assert len(recorded) >= 18 and used <= recorded, sorted(used - recorded)
    assert recorded <= used, f"metrics without a panel: {sorted(recorded - used)}"


def test_the_shipped_json_is_the_generated_one_and_installs(tmp_path):
    assert json.loads(SHIPPED.read_text()) == grafana.dashboard()  # regenerate: python -m miles_ray.grafana --out
    path = grafana.install(tmp_path / "dashboards")
    model = json.loads(path.read_text())
    assert model["uid"] == grafana.UID and [v["name"] for v in model["templating"]["list"]] == ["datasource"]
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))  # Grafana keys panels by id
