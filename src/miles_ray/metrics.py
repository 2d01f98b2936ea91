"""Prometheus metrics of a run, recorded through ``ray.util.metrics``.

Ray's metrics agent on every node serves them (with Ray's own) in Prometheus format, where the Ray
dashboard's Grafana/Prometheus setup picks them up.

Every actor records its own (names start with ``miles_ray_``; Ray adds its ``ray_`` prefix when exporting):

=================================  =========  ====================================================
metric                             kind       recorded by
=================================  =========  ====================================================
train_steps_total                  counter    TrainerGroup (``skipped`` tag: non-finite steps)
train_step_seconds                 histogram  TrainerGroup
train_samples_total                counter    TrainerGroup
trainer_weight_version             gauge      TrainerGroup
train_loss, train_grad_norm        gauge      TrainerGroup
reward_mean                        gauge      TrainerGroup (the batch's rewards, after shaping)
weight_sync_seconds                histogram  WeightBroadcaster
weight_sync_bytes_total            counter    WeightBroadcaster
engine_weight_version              gauge      WeightBroadcaster (``engine`` tag: the verified version it holds)
buffer_groups                      gauge      ReplayBuffer
buffer_staleness_mean/max          gauge      ReplayBuffer (of the last batch taken)
buffer_dropped_stale_total         counter    ReplayBuffer
router_outstanding                 gauge      Router (``engine`` tag: the engine queue depth)
router_retries_total               counter    Router
engine_generated_tokens_total      counter    EmbeddedEngineActor (``engine`` tag: rollout throughput)
rollout_samples_total              counter    AsyncRollout
actor_healthy                      gauge      HealthMonitor (``actor`` tag: 1 answers its health check, 0 not)
health_replacements_total          counter    HealthMonitor (``role`` tag: engines replaced)
health_rounds_total                counter    HealthMonitor
driver_phase_seconds               gauge      ``record_phases`` from a driver (``phase`` tag)
=================================  =========  ====================================================

Start Ray with ``ray.init(_metrics_export_port=PORT)`` (or ``ray start --metrics-export-port``) to choose the
port; ``scrape(url)`` reads the endpoint back with ``prometheus_client``'s parser.
"""

from __future__ import annotations

import functools

PREFIX = "miles_ray_"
_SECONDS_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600]


@functools.cache
def _metric(kind: str, name: str, description: str, tag_keys: tuple[str, ...] = ()):
    from ray.util import metrics

    full = PREFIX + name
    if kind == "counter":
        return metrics.Counter(full, description, tag_keys=tag_keys)
    if kind == "gauge":
        return metrics.Gauge(full, description, tag_keys=tag_keys)
    return metrics.Histogram(full, description, boundaries=_SECONDS_BUCKETS, tag_keys=tag_keys)


def counter(name: str, description: str, tag_keys: tuple[str, ...] = ()):
    """A ``ray.util.metrics.Counter`` named ``miles_ray_<name>`` (one object per process and name)."""
    return _metric("counter", name, description, tag_keys)


def gauge(name: str, description: str, tag_keys: tuple[str, ...] = ()):
    """A ``ray.util.metrics.Gauge`` named ``miles_ray_<name>``."""
    return _metric("gauge", name, description, tag_keys)


def seconds_histogram(name: str, description: str, tag_keys: tuple[str, ...] = ()):
    """A ``ray.util.metrics.Histogram`` of durations (0.01 s .. 10 min buckets) named ``miles_ray_<name>``."""
    return _metric("histogram", name, description, tag_keys)


def record_phases(phases: dict[str, float]) -> None:
    """From a driver: the last step's seconds by phase, e.g. ``{"rollout": 3.1, "train": 5.2, "sync": 0.4}``."""
    g = gauge("driver_phase_seconds", "Seconds of the driver's last step, by phase", ("phase",))
    for phase, seconds in phases.items():
        g.set(float(seconds), tags={"phase": phase})


def scrape(url: str, prefix: str = "ray_" + PREFIX, timeout_s: float = 10.0) -> dict[str, list[tuple[dict, float]]]:
    """Read a Prometheus endpoint with ``prometheus_client``'s parser.

    Returns:
        Sample name -> ``[(labels, value), ...]``, for names starting with ``prefix`` (by default this
        library's metrics as Ray exports them).

    """
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out
