"""Each tracker is read back from its own files: TensorBoard event files, the wandb offline run, the MLflow store."""

import glob
import json
import struct

import pytest

from miles_ray.trackers import TRACKERS, open_trackers, parse_names

RECORDS = [
    {"reward_mean": 0.1 * s, "loss": 1.0 / (s + 1), "example": f"text {s}", "nan": float("nan")} for s in range(3)
]


def read_wandb_history(path: str) -> list[dict]:
    """History rows of an offline ``.wandb`` file (a LevelDB-style log of ``Record`` protos, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    rows, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left_in_block = 32768 - pos % 32768
        if left_in_block < 7:  # a block's tail too short for a header is padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zeroed padding
            pos += left_in_block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    trackers = open_trackers(",".join(TRACKERS), out, run_name="r1", config={"lr": 1e-5, "group_size": 8})
    for step, record in enumerate(RECORDS):
        trackers.log(record, step)
    trackers.close()
    return out


def test_jsonl_keeps_every_value(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["example"] for r in rows] == ["text 0", "text 1", "text 2"]


def test_tensorboard_event_files_hold_the_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "reward_mean"]  # text and NaN are not scalars
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("loss")] == [(0, 1.0), (1, 0.5), (2, 0.33333)]


def test_wandb_offline_run_holds_the_history(run_dir):
    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows = read_wandb_history(path)
    assert [(r["_step"], r["reward_mean"]) for r in rows] == [(s, pytest.approx(0.1 * s)) for s in range(3)]
    assert all("example" not in r for r in rows)


def test_mlflow_store_holds_metrics_and_params(run_dir):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("miles_ray").experiment_id])
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    assert run.data.params == {"lr": "1e-05", "group_size": "8"}
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, round(m.value, 5)) for m in history] == [(0, 0.0), (1, 0.1), (2, 0.2)]


def test_resumed_jsonl_keeps_the_steps_before_the_resume(tmp_path):
    first = open_trackers("jsonl", tmp_path)
    for step in range(4):
        first.log({"x": step}, step)
    resumed = open_trackers("jsonl", tmp_path, first_step=2)
    resumed.log({"x": 20}, 2)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in rows] == [(0, 0), (1, 1), (2, 20)]


@pytest.mark.parametrize("names", ["jsonl,tensorbord", "", "csv"])
def test_unknown_tracker_names_are_refused(names):
    with pytest.raises(ValueError, match="comma-separated list of"):
        parse_names(names)
