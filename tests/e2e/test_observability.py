"""Observability for real: the actors' Prometheus metrics scraped from Ray's metrics endpoint (and by a real
Prometheus server), torch profiler traces of chosen steps, and the report plots of a run log."""

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import ray
from helpers import ShortResponseTask, tiny_stack
from installs import missing
from transformers import AutoTokenizer

from miles_ray import metrics, placement
from miles_ray.engines.requests import SamplingParams
from miles_ray.rollout import generate_groups

pytestmark = pytest.mark.e2e


def test_metrics_reach_the_prometheus_endpoint_and_profiler_writes_traces(
    ray_cluster, make_placement, tiny_model_path, tmp_path
):
    pl = make_placement(placement.disaggregated(1, 1))
    profile = {"steps": [1], "out_dir": str(tmp_path / "traces")}
    stack = tiny_stack(pl, tiny_model_path, trainer={"profile": profile}, buffer={"max_staleness": 4})
    trainer, engines, router, buffer, wb = stack.trainer, stack.engines, stack.router, stack.buffer, stack.broadcaster
    task = ShortResponseTask(AutoTokenizer.from_pretrained(tiny_model_path))
    params = SamplingParams(n=2, max_new_tokens=8, ignore_eos=True)
    for step in range(2):
        ray.get(buffer.add.remote(generate_groups(router, task, params, 2)))
        batch = ray.get(buffer.get_batch.remote(2, current_version=step))
        version = ray.get(trainer.train_step.remote(batch))["weight_version"]
        ray.get(wb.sync.remote(version))
    metrics.record_phases({"rollout": 1.5, "train": 2.5})

    want = {
        f"ray_miles_ray_{name}"
        for name in (
            "train_steps_total",
            "train_step_seconds_count",
            "train_samples_total",
            "trainer_weight_version",
            "train_loss",
            "reward_mean",
            "weight_sync_seconds_count",
            "weight_sync_bytes_total",
            "buffer_groups",
            "buffer_staleness_mean",
            "router_outstanding",
            "engine_generated_tokens_total",
            "engine_weight_version",
            "driver_phase_seconds",
        )
    }

    # the cluster is shared by the whole test session: count only what this test's actors recorded
    def worker_id(actor):
        return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_worker_id()))

    ours = {worker_id(a) for a in (trainer, engines[0], wb)}

    def ours_only(rows):
        return sum(v for labels, v in rows if labels["WorkerId"] in ours)

    deadline, seen = time.time() + 60, {}
    while time.time() < deadline:  # Ray's agents export every second here (metrics_report_interval_ms)
        seen = metrics.scrape(ray.miles_ray_metrics_url)
        done = {"trainer_weight_version": 2, "train_samples_total": 8, "engine_generated_tokens_total": 64}
        done["engine_weight_version"] = 2  # the one engine, after the second sync
        if want <= set(seen) and all(ours_only(seen[f"ray_miles_ray_{k}"]) == v for k, v in done.items()):
            break
        time.sleep(1)
    assert want <= set(seen), sorted(want - set(seen))
    value = {name: ours_only(rows) for name, rows in seen.items()}
    assert value["ray_miles_ray_trainer_weight_version"] == 2
    assert value["ray_miles_ray_train_samples_total"] == 8  # 2 steps x 2 groups x 2 samples
    assert value["ray_miles_ray_engine_generated_tokens_total"] == 64  # 2 steps x 4 samples x 8 tokens
    assert value["ray_miles_ray_weight_sync_bytes_total"] > 0
    versions = seen["ray_miles_ray_engine_weight_version"]
    assert [(labels["engine"], v) for labels, v in versions if labels["WorkerId"] in ours] == [("0", 2)]
    phases = {labels["phase"]: v for labels, v in seen["ray_miles_ray_driver_phase_seconds"]}
    assert phases == {"rollout": 1.5, "train": 2.5}

    traces = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert traces == ["trace_step1_rank0.json"]  # only the chosen step
    events = json.loads((tmp_path / "traces" / traces[0]).read_text())["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events)  # real operator events


def test_a_prometheus_server_scrapes_the_metrics_and_answers_queries(ray_cluster, tmp_path):
    """A real Prometheus (Debian's package; scripts/setup_prometheus.sh) scrapes Ray's metrics endpoint, as a
    user's would, and its HTTP query API returns a miles_ray metric the driver recorded."""
    binary = shutil.which("prometheus")
    if binary is None:
        missing("prometheus", "no prometheus binary (scripts/setup_prometheus.sh installs Debian's package)")
    target = urllib.parse.urlparse(ray.miles_ray_metrics_url).netloc
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs: [{{job_name: ray, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    port = _free_port()
    cmd = [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        metrics.record_phases({"prometheus_check": 7.0})
        query = urllib.parse.quote('ray_miles_ray_driver_phase_seconds{phase="prometheus_check"}')
        deadline, result = time.time() + 90, []
        while time.time() < deadline and not result:
            assert server.poll() is None, server.stderr.read()[-2000:]
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?query={query}", timeout=5) as r:
                    result = json.loads(r.read())["data"]["result"]
            time.sleep(1)
        assert [float(row["value"][1]) for row in result] == [7.0]
    finally:
        server.terminate()
        server.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
