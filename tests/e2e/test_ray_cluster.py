"""On a running Ray cluster (#22), as a user works with one: ``ray start --head``, the notebook run headless (nbclient)
against it, its detached stack attached from another driver, and the quick-start submitted with ``ray job submit``.

The cluster is a real ``ray start --head --block`` in a process group of its own (ended with the module), apart from
the session's one-node cluster; drivers that talk to it run as subprocesses (a process holds one Ray connection).
"""

import ast
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from ray.job_submission import JobStatus, JobSubmissionClient

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
NOTEBOOK_PARAMETERS = {"STEPS": 2, "NUM_RANKS": 1, "PROMPTS_PER_STEP": 2, "GROUP_SIZE": 4, "MAX_NEW_TOKENS": 8}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head(tmp_path_factory, smollm2_path):
    """``ray start --head`` with a dashboard (the Jobs API); yields (GCS address, dashboard URL)."""
    port, dashboard = _free_port(), _free_port()
    temp = tmp_path_factory.mktemp("ray_head")
    cmd = [RAY, "start", "--head", "--block", "--num-cpus", "8", "--port", str(port), "--disable-usage-stats"]
    cmd += ["--include-dashboard", "true", "--dashboard-port", str(dashboard), "--temp-dir", str(temp)]
    # ports Ray otherwise fixes (52365, 10001): the session's own cluster may hold them already, and a head whose
    # dashboard agent cannot listen accepts no job
    cmd += ["--dashboard-agent-listen-port", str(_free_port()), "--ray-client-server-port", str(_free_port())]
    log = open(temp / "ray_start.log", "w")  # noqa: SIM115 - open for the cluster's lifetime
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/version", timeout=2).read()
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    started = (temp / "ray_start.log").read_text()
                    raise RuntimeError(f"ray start --head did not come up: {started}") from None
                time.sleep(0.5)
        yield f"127.0.0.1:{port}", url
    finally:
        # SIGTERM to `ray start` alone: it drains the node through the GCS and stops its processes (~2 s); sent to
        # the whole group, the GCS died first and the drain waited 30 s for it
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=45)
        with contextlib.suppress(ProcessLookupError):  # whatever of this cluster is left, and only of it
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _env(address: str) -> dict:
    return {**os.environ, "RAY_ADDRESS": address, "PYTHONPATH": str(ROOT / "tests" / "e2e")}


@pytest.fixture(scope="module")
def notebook(head) -> nbformat.NotebookNode:
    """examples/notebook.ipynb executed headless on the cluster, with small parameters."""
    nb = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    [params] = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    params.source += "\n" + "\n".join(f"{k} = {v!r}" for k, v in NOTEBOOK_PARAMETERS.items())
    saved = dict(os.environ)
    os.environ.update(_env(head[0]))  # the kernel inherits it: ray.init(address="auto") finds this cluster
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return nb


def _outputs(cell, kind: str) -> str:
    return "".join(o.get("text", "") if kind == "stream" else str(o.get("data", {})) for o in cell.outputs)


def test_the_notebook_trains_on_the_cluster_and_plots_the_reward(notebook):
    loop = next(c for c in notebook.cells if "train_step" in c.source)
    lines = [line for line in _outputs(loop, "stream").splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2"]
    assert lines[-1].endswith("version 2")
    plot = next(c for c in notebook.cells if "plt.show()" in c.source)
    assert any("image/png" in o.get("data", {}) for o in plot.outputs)
    last = notebook.cells[-1]
    names = ast.literal_eval(_outputs(last, "stream").strip())  # the printed list of the stack's actor names
    assert "notebook/trainer" in names and "notebook/rollout_pool" in names and "notebook/health_monitor" in names


ATTACH = """
import json, ray
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.stack import attach_stack
ray.init(address="auto", namespace="miles_ray", log_to_driver=False)
stack = attach_stack("notebook")
out = {"version": ray.get(stack.trainer.weight_version.remote())}
out["engine_versions"] = [ray.get(e.health.remote())["version"] for e in stack.engines]
out["generated"] = ray.get(stack.router.generate.remote(GenerateRequest([1, 2, 3], SamplingParams()))).weight_version
out["monitor_rounds"] = ray.get(stack.monitor.stats.remote())["rounds"]
stack.shutdown()
try:
    ray.get_actor("notebook/trainer")
    out["gone"] = False
except ValueError:
    out["gone"] = True
print(json.dumps(out))
"""


def test_the_notebook_leaves_its_stack_running_and_another_driver_attaches(head, notebook):
    """The notebook has disconnected; a new driver finds its actors by name, where it left them, and ends them."""
    proc = subprocess.run(
        [sys.executable, "-c", ATTACH], capture_output=True, text=True, timeout=300, env=_env(head[0]), check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == 2 and out["engine_versions"] == [2]
    assert out["generated"] == 2 and out["monitor_rounds"] > 0 and out["gone"]  # served with the weights it left


def test_the_quickstart_runs_as_a_ray_job(head, tmp_path):
    """``ray job submit`` the README's quick-start (two short steps) and wait for it to succeed."""
    address, dashboard = head
    env_vars = {k: os.environ[k] for k in ("MILES_RAY_CACHE_DIR", "RAY_AUTH_MODE") if k in os.environ}
    script = ROOT / "examples" / "quickstart.py"
    args = ["--address", "auto", "--steps", "2", "--num-ranks", "1", "--prompts-per-step", "2", "--group-size", "4"]
    args += ["--max-new-tokens", "8", "--out", str(tmp_path / "run")]
    cmd = [RAY, "job", "submit", "--address", dashboard, "--submission-id", "quickstart-test"]
    cmd += ["--runtime-env-json", json.dumps({"env_vars": env_vars}), "--", sys.executable, str(script), *args]
    submit = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(address), check=False)
    assert submit.returncode == 0, (submit.stdout[-3000:], submit.stderr[-3000:])
    client = JobSubmissionClient(dashboard)  # the Jobs REST API: what the dashboard's Jobs tab shows
    status, logs = client.get_job_status("quickstart-test"), client.get_job_logs("quickstart-test")
    assert status == JobStatus.SUCCEEDED, (status, logs[-3000:])
    assert "reward_mean" in logs  # the quick-start's closing summary, printed by the job's driver
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and records[-1]["weight_version"] == 2
