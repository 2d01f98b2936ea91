"""SGLang engines for real: one SGLang 0.5.23 server (on this CPU, see ``miles_ray.engines.sglang``) for this
module, behind the Router and the WeightBroadcaster, with a real trainer on a tiny Llama.

Weights reach the server both ways SGLang offers: the server's rank joins the trainer's gloo broadcast group
(``/init_weights_update_group`` + ``/update_weights_from_distributed``, disaggregated) and, colocated, tensors by
shared-memory handle (``/update_weights_from_tensor``). The server's interpreter comes from
``MILES_RAY_SGLANG_PYTHON`` or ``.venv-sglang`` (``scripts/setup_sglang.sh``); without one these tests skip (and
fail where ``MILES_RAY_REQUIRE`` names sglang, as in scripts/test.sh).
"""

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import ray
from helpers import SGLANG_PROMPT as PROMPT
from helpers import (
    abort_running_request,
    check_a_stop_string_stays_in_the_text,
    check_a_weight_load_keeps_a_pause,
    check_in_place_pause_holds_requests,
    grpo_in_step,
    server_auth_probe,
    server_python,
    sglang_stack,
    sglang_train_and_sync,
    wait_outstanding,
)
from helpers import sglang_diff_to_trainer as _max_diff_to_trainer
from helpers import sglang_generate as _generate
from helpers import sglang_train_step as _train_step
from server_commands import unstarted

from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.engines.sglang import SITE_DIR, SGLangEngineConfig, SGLangServer
from miles_ray.keys import new_key
from miles_ray.sync.checksum import probe_checksum, probe_rows

pytestmark = [pytest.mark.e2e, pytest.mark.sglang]


@pytest.fixture(scope="module")
def stack(ray_cluster):
    """One SGLang engine, router, trainer (1 rank) and two broadcasters (broadcast, shared memory)."""
    with sglang_stack() as stack:
        yield stack


def test_generate_through_the_router_matches_the_trainer(stack):
    out = _generate(stack)
    assert out.engine_id == 0 and len(out.completions) == 4
    assert all(len(c.token_ids) == len(c.logprobs) == 10 and c.finish_reason == "length" for c in out.completions)
    assert _max_diff_to_trainer(stack, out) < 1e-4  # fp32 on both sides: SGLang's logprobs are the trainer's


def test_a_stop_string_stays_in_the_text_as_the_embedded_engine_keeps_it(stack):
    from transformers import AutoTokenizer

    check_a_stop_string_stays_in_the_text(stack["router"], AutoTokenizer.from_pretrained(stack["model_path"]))


def test_stop_token_ids_with_ignore_eos_are_refused(stack):
    """SGLang's ignore_eos turns off stop_token_ids too (the other engines stop at them): a clear 'no', not another
    response; the engine serves on."""
    request = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True, stop_token_ids=[5]))
    with pytest.raises(ValueError, match="stop_token_ids cannot be combined with ignore_eos on SGLang"):
        ray.get(stack["router"].generate.remote(request), timeout=60)
    assert len(_generate(stack).completions) == 4


def test_grpo_steps_with_sglang_engines(stack):
    # runs before any test that trains, on the checkpoint's weights: after the lr 1e-2 steps below the tiny policy
    # can be peaked enough that a group's 4 samples all get one reward (zero advantages, zero gradient)
    version = ray.get(stack["trainer"].weight_version.remote())
    ray.get(stack["broadcast"].sync.remote(version))
    checksums = grpo_in_step(stack["trainer"], stack["router"], stack["broadcast"], stack["model_path"], steps=2)
    assert len(set(checksums)) == 2  # each step's weights reached the server, verified


@pytest.mark.parametrize("transport", ["broadcast", "shared_memory"])
def test_sync_after_a_train_step_reaches_the_server(stack, transport):
    report = sglang_train_and_sync(stack, transport)  # raises unless the server's probe checksum matches
    engine = stack["engines"][0]
    assert ray.get(engine.weight_version.remote()) == report["version"]
    assert ray.get(engine.server_weight_version.remote()) == str(report["version"])  # SGLang's own record


def test_probe_checksum_tells_other_weights_apart(stack):
    """The probe the broadcaster compares changes when the server's weights change, and equals the trainer's."""
    from safetensors.torch import load_file

    engine = stack["engines"][0]
    server = ray.get(engine.weights_checksum.remote())
    assert server is not None  # set by the syncs above
    original = load_file(str(Path(stack["model_path"]) / "model.safetensors"))
    plan_names = ray.get(ray.get(stack["trainer"].workers.remote())[0].sync_plan.remote("float32", 1 << 30)).names
    assert probe_checksum(probe_rows((n, original[n]) for n in plan_names)) != server  # the checkpoint was trained


def test_a_weight_load_keeps_the_engine_paused(stack):
    version = ray.get(stack["trainer"].weight_version.remote())
    check_a_weight_load_keeps_a_pause(stack["engines"][0], stack["router"], stack["broadcast"], version)


def test_pause_keeps_requests_and_abort_ends_them(stack):
    engine = stack["engines"][0]
    check_in_place_pause_holds_requests(engine, stack["router"])
    [completion] = abort_running_request(engine, max_new_tokens=500).completions
    assert completion.finish_reason == "abort" and len(completion.token_ids) == len(completion.logprobs) < 500
    # sent to the paused server, the request is held there: its abort ends it with no output, as vLLM's does
    # (SGLang itself loses that abort and runs the request to its end once the server continues)
    assert abort_running_request(engine, max_new_tokens=500, pause_first=True).completions == []
    deadline = time.time() + 30
    while (queued := ray.get(engine.__ray_call__.remote(_server_queue))) > 0:  # dropped once SGLang sees it gone
        assert time.time() < deadline, f"the server still runs or queues {queued} request(s) 30 s after the abort"
        time.sleep(0.5)
    with pytest.raises(ValueError, match="pause mode"):
        ray.get(engine.pause.remote("later"))


def _server_queue(actor) -> int:
    """Run in the engine actor: requests its SGLang server runs or queues (``/v1/loads``, with the server's key)."""
    server = actor.server
    headers = {"Authorization": f"Bearer {server.api_key}"}
    request = urllib.request.Request(f"{server.url}/v1/loads?include=core", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as r:
        loads = json.load(r)["loads"]
    assert loads and all("num_running_reqs" in d and "num_waiting_reqs" in d for d in loads), loads
    return sum(d["num_running_reqs"] + d["num_waiting_reqs"] for d in loads)


def test_memory_release_around_a_train_step(stack):
    """The colocated protocol against the real server: release, train, resume weights, sync, resume KV cache.

    On this CPU the server has no memory saver (it needs CUDA), so nothing is freed and the engine says so
    (False); what runs for real is the route sequence, SGLang's idle check and the weights it keeps across it.
    """
    engine, pool = stack["engines"][0], stack["pool"]
    long = GenerateRequest(list(PROMPT), SamplingParams(max_new_tokens=400, ignore_eos=True), request_id="busy")
    future = engine.generate.remote(long)
    wait_outstanding(engine, 1, future)
    with pytest.raises(ray.exceptions.RayTaskError, match="release_memory with 1 requests in flight"):
        ray.get(pool.release_memory.remote())
    ray.get(engine.abort.remote("busy"))
    ray.get(future, timeout=60)
    before = _generate(stack)
    assert ray.get(pool.release_memory.remote()) == [False]
    metrics = _train_step(stack, before)
    assert ray.get(pool.resume_memory.remote("weights")) == [False]
    ray.get(stack["shared_memory"].sync.remote(metrics["weight_version"]))  # verified
    ray.get(pool.resume_memory.remote("kv_cache"))
    after = _generate(stack)
    assert after.weight_version == metrics["weight_version"] and _max_diff_to_trainer(stack, after) < 1e-4


def test_the_server_needs_its_key_and_no_command_line_shows_it(stack):
    """Regression (#23): the SGLang server listened on 127.0.0.1 without a key, and /update_weights_from_tensor
    unpickles its payload: any local user could run code as the training user. Each server now has a random key,
    handed over in a private --config file."""
    routes = [("POST", "/update_weights_from_tensor"), ("POST", "/generate"), ("GET", "/get_model_info")]
    probe = ray.get(stack["engines"][0].__ray_call__.remote(server_auth_probe, routes, ("GET", "/get_model_info")))
    assert probe["without_key"] == probe["wrong_key"] == {route: 401 for _, route in routes}, probe
    assert probe["health"] == 200 and probe["safe_with_key"] == 200 and not probe["key_in_argv"]
    assert _generate(stack).completions


PARSE_KEY = """
import sys
from sglang.srt.server_args import prepare_server_args
for argv in (sys.argv[2:], ["--model-path", "/m", "--config", sys.argv[1]]):
    try:
        print("key", prepare_server_args(argv).api_key)
    except SystemExit as e:
        print("exit", e.code)
"""


@pytest.mark.timeout(300)
def test_sglang_reads_the_key_the_engine_writes_and_a_leading_dash_would_stop_it(tmp_path):
    """Regression: a CI run lost this whole module when a random key (``token_urlsafe``) began with ``-``: SGLang
    turns the --config YAML into ``--api-key <key>``, argparse took the key for a flag and the server never started.
    SGLang's own parser reads the file that ``SGLangServer.command`` writes; the same file with a dashed key fails."""
    shim = {"PYTHONPATH": str(SITE_DIR), "SGLANG_USE_CPU_ENGINE": "1"}
    python = server_python("MILES_RAY_SGLANG_PYTHON", ".venv-sglang", "sglang.srt.server_args", shim)
    if python is None:
        from installs import missing

        missing("sglang", "no SGLang environment: run scripts/setup_sglang.sh or set MILES_RAY_SGLANG_PYTHON")
    server = unstarted(SGLangServer, SGLangEngineConfig(model_path="/m"), "cpu", new_key(), str(tmp_path))
    argv = server.command()[3:]  # after `python -m sglang.launch_server`
    dashed = tmp_path / "dash.yaml"
    dashed.write_text(f"api-key: '-{server.api_key}'\n")
    env = {**os.environ, **shim}
    run = subprocess.run(
        [python, "-c", PARSE_KEY, str(dashed), *argv], capture_output=True, text=True, timeout=240, env=env
    )
    assert run.stdout.split("\n")[:2] == [f"key {server.api_key}", "exit 2"], run.stdout + run.stderr[-2000:]
