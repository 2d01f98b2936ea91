"""Real HTTP: the engine server runs as its own process (the CLI) and is called with requests and the openai client."""

import base64
import threading
import time

import pytest
import requests
import torch

KEY = "test-key"  # the key the `server` fixture (tests/conftest.py) starts the engine with


def _auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def _post(url, route, body, key=True):
    return requests.post(f"{url}{route}", json=body, headers=_auth() if key else {}, timeout=120)


PROMPT = [1, 50, 60, 70, 80]


def test_bearer_token_is_required(server):
    assert requests.get(f"{server}/health", timeout=5).status_code == 401
    bad = requests.get(f"{server}/health", headers={"Authorization": "Bearer nope"}, timeout=5)
    assert bad.status_code == 401 and "bearer token" in bad.json()["error"]["message"]
    assert requests.get(f"{server}/health_generate", headers=_auth(), timeout=60).status_code == 200


def test_generate_returns_ids_and_exact_logprobs(server, teacher_forced):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 3}}
    r = _post(server, "/generate", {**body, "return_logprob": True, "rid": "g1"})
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert meta["id"] == "g1" and meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 12 == len(out["output_ids"])
    lps = [lp for lp, tok, _ in meta["output_token_logprobs"]]
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == out["output_ids"]
    ref = teacher_forced(PROMPT, out["output_ids"])
    assert (torch.tensor(lps) - ref).abs().max().item() < 1e-5
    again = _post(server, "/generate", {**body, "rid": "g2"}).json()  # same seed, same tokens
    assert again["output_ids"] == out["output_ids"] and "output_token_logprobs" not in again["meta_info"]


def test_generate_batch_and_n(server):
    r = _post(server, "/generate", {"input_ids": [PROMPT, [1, 2]], "sampling_params": {"max_new_tokens": 3, "n": 2}})
    items = r.json()
    assert r.status_code == 200 and len(items) == 4 and all(len(i["output_ids"]) <= 3 for i in items)
    text = _post(server, "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}).json()
    assert isinstance(text["text"], str) and len(text["output_ids"]) <= 2


def test_generate_trims_what_stopped_it_unless_no_stop_trim_as_sglang(server, tiny_model_path):
    """SGLang's /generate cuts the stop string that ended a response, or a matched stop token's text, out of the
    text unless ``no_stop_trim``; ``matched`` names it. The stop string spans a token boundary."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    sampling = {"max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 3}

    def gen(**extra):
        item = _post(server, "/generate", {"input_ids": PROMPT, "sampling_params": {**sampling, **extra}}).json()
        return item["text"], item["output_ids"], item["meta_info"]["finish_reason"]

    text, ids, _ = gen()
    ends = [len(tok.decode(ids[:m], skip_special_tokens=True)) for m in range(2, len(ids))]
    stop = next(p for b in ends if (p := text[b - 1 : b + 2]).isascii() and p.strip() and text.count(p) == 1)
    cut, kept = gen(stop=[stop]), gen(stop=[stop], no_stop_trim=True, skip_special_tokens=True)
    at = text.index(stop)
    assert (cut[0], kept[0]) == (text[:at], text[: at + len(stop)]) and cut[1] == kept[1] == ids[: len(cut[1])]
    assert cut[2] == kept[2] == {"type": "stop", "matched": stop}
    token = ids[3]
    by_token, kept = gen(stop_token_ids=[token]), gen(stop_token_ids=[token], no_stop_trim=True)
    n = ids.index(token) + 1
    assert by_token[0] == tok.decode(ids[: n - 1], skip_special_tokens=True) and by_token[1] == ids[:n]
    assert kept[0] == tok.decode(ids[:n], skip_special_tokens=True) and by_token[2]["matched"] == token


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"input_ids": [1], "sampling_params": {"skip_special_tokens": False}}, "skip_special_tokens is not supported"),
        ({"input_ids": [1], "sampling_params": {"no_stop_trim": "yes"}}, "no_stop_trim must be true or false"),
        ({"input_ids": []}, "prompt_ids must not be empty"),
        ({"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 100}}, "exceeds max_seq_len"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"input_ids": [1], "sampling_params": {"min_p": 0.1}}, "sampling_params.min_p is not supported"),
        ({"input_ids": [1], "sampling_params": {"n": 9}}, "exceeds the engine's 8 KV slots"),
        ({"input_ids": "abc"}, "input_ids must be a list"),
        ({"prompt": [1]}, "unsupported field"),
    ],
)
def test_invalid_requests_get_4xx_and_the_engine_stays_up(server, body, match):
    r = _post(server, "/generate", body)
    assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
    ok = _post(server, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200


def test_weight_update_and_version(server, tiny_model_path):
    from safetensors.torch import load_file, save

    greedy = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    before = _post(server, "/generate", greedy).json()["output_ids"]
    weights = load_file(f"{tiny_model_path}/model.safetensors")
    changed = {"model.norm.weight": -weights["model.norm.weight"]}  # flips every logit
    blob = base64.b64encode(save(changed)).decode()
    r = _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": blob, "weight_version": 5})
    assert r.status_code == 200, r.text
    assert requests.get(f"{server}/get_weight_version", headers=_auth(), timeout=5).json() == {"weight_version": 5}
    after = _post(server, "/generate", greedy).json()
    assert after["output_ids"] != before and after["meta_info"]["weight_version"] == 5
    bad = _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": "bm9wZQ=="})
    assert bad.status_code == 400 and "not valid safetensors" in bad.json()["error"]["message"]
    r = _post(server, "/update_weights_from_disk", {"model_path": tiny_model_path, "weight_version": 6})
    assert r.status_code == 200, r.text
    assert _post(server, "/generate", greedy).json()["output_ids"] == before
    missing = _post(server, "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert missing.status_code == 400 and "model_path" in missing.json()["error"]["message"]


def _in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.__setitem__("r", fn()))
    t.start()
    return t, box


def _wait_running(server, count):
    for _ in range(200):
        info = requests.get(f"{server}/get_model_info", headers=_auth(), timeout=5).json()
        if info["running"] + info["waiting"] >= count:
            return info
        time.sleep(0.02)
    raise AssertionError("request never reached the engine")


def test_pause_abort_and_continue(server):
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 120, "ignore_eos": True}, "return_logprob": True}
    t, box = _in_thread(lambda: _post(server, "/generate", {**long, "rid": "long-1"}).json())
    _wait_running(server, 1)
    assert _post(server, "/abort_request", {"rid": "long-1"}).status_code == 200
    t.join(60)
    meta = box["r"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and len(meta["output_token_logprobs"]) == len(
        box["r"]["output_ids"]
    )

    # in-place pause: the request waits, then finishes in full after continue
    assert _post(server, "/pause_generation", {"mode": "in_place"}).json()["mode"] == "in_place"
    short = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    t, box = _in_thread(lambda: _post(server, "/generate", short).json())
    info = _wait_running(server, 1)
    time.sleep(0.3)
    assert info["paused"] and "r" not in box
    assert _post(server, "/continue_generation", {}).status_code == 200
    t.join(60)
    assert box["r"]["meta_info"]["finish_reason"]["type"] == "length"
    assert _post(server, "/pause_generation", {"mode": "retract"}).status_code == 400


def _still_generates(server) -> bool:
    """A short request answered within 30 s: the engine loop is alive."""
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    try:
        return requests.post(f"{server}/generate", json=body, headers=_auth(), timeout=30).status_code == 200
    except requests.Timeout:
        return False


@pytest.mark.parametrize("rid", [{"a": 1}, [[1]], 7, "r" * 300, [""]])
def test_a_bad_rid_is_refused_and_later_aborts_keep_the_loop_alive(server, rid):
    """Regression (#23): an unhashable rid used to kill the engine loop at the next abort; /health stayed 200."""
    assert _post(server, "/pause_generation", {"mode": "in_place"}).status_code == 200  # keeps the request queued
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "rid": rid}
    t, box = _in_thread(lambda: _post(server, "/generate", body))
    deadline = time.monotonic() + 30  # until it is refused (fixed) or queued (the abort below then reaches it)
    while "r" not in box and requests.get(f"{server}/get_model_info", headers=_auth(), timeout=5).json()["waiting"] < 1:
        assert time.monotonic() < deadline, "the request neither queued nor was refused"
        time.sleep(0.01)
    assert _post(server, "/abort_request", {"rid": "someone-else"}).status_code == 200
    assert _post(server, "/continue_generation", {}).status_code == 200
    assert _still_generates(server)
    t.join(60)
    assert box["r"].status_code == 400 and box["r"].json()["error"]["param"] == "rid", box["r"].text


def test_a_huge_seed_fails_alone(server):
    """Regression (#23): a seed past 64 bits failed inside prefill and took the running request down with it."""
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    t, box = _in_thread(lambda: _post(server, "/generate", long))
    _wait_running(server, 1)
    for seed_field in ("sampling_seed", "seed"):
        bad = _post(server, "/generate", {"input_ids": PROMPT, "sampling_params": {seed_field: 10**30}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == f"sampling_params.{seed_field}", bad.text
    openai = _post(server, "/v1/completions", {"prompt": PROMPT, "seed": -(10**30), "max_tokens": 2})
    assert openai.status_code == 400 and openai.json()["error"]["param"] == "seed", openai.text
    t.join(120)
    assert box["r"].status_code == 200 and len(box["r"].json()["output_ids"]) == 64


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/generate", {"input_ids": PROMPT, "sampling_params": [1, 2]}, "sampling_params"),
        ("/generate", {"input_ids": PROMPT, "sampling_params": "greedy"}, "sampling_params"),
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"stop": 5}}, "sampling_params.stop"),
        ("/generate", {"input_ids": PROMPT, "return_logprob": "yes"}, "return_logprob"),
        ("/v1/completions", {"prompt": PROMPT, "stop": {"a": 1}}, "stop"),
        ("/v1/completions", {"prompt": PROMPT, "stop": ""}, "stop"),
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"stop": ["x", ""]}}, "sampling_params.stop"),
        ("/v1/completions", {"prompt": [PROMPT, 3]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": "all"}, "tools"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": "bm9wZQ==", "weight_version": "v1"}, None),
        ("/abort_request", {"rid": ["a"]}, "rid"),
        ("/pause_generation", {"mode": ["abort"]}, "mode"),
    ],
)
def test_wrong_types_get_400_naming_the_field(server, route, body, param):
    """Regression (#23): a wrong-typed field used to surface as a 500 with an AttributeError."""
    r = _post(server, route, body)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text
    assert _still_generates(server)


def test_an_oversized_body_gets_413_on_inference_routes(server):
    """Regression (#23): inference routes took bodies up to the weight-update limit, and a 413 became a 400."""
    big = {"input_ids": PROMPT, "rid": "x" * (33 * 2**20)}  # over the 32 MB request limit
    r = _post(server, "/generate", big)
    assert r.status_code == 413 and "32 MB" in r.json()["error"]["message"], r.text[:300]
    assert _still_generates(server)


def test_an_exposed_host_needs_a_key_and_the_key_stays_secret():
    """Regression (#23): host=0.0.0.0 without a key served weight loads and aborts to the whole network."""
    from miles_ray.engines.http_server import HttpServerConfig

    for host in ("0.0.0.0", "10.1.2.3", "::"):
        with pytest.raises(ValueError, match="set api_key, or bind 127.0.0.1"):
            HttpServerConfig(host=host)
    # every server has a key: loopback ones get a random one (any local user can reach a loopback port)
    keys = [HttpServerConfig(host=host).api_key.get_secret_value() for host in ("::1", "localhost", "127.0.0.1")]
    assert len(set(keys)) == 3 and all(len(k) >= 32 for k in keys)
    config = HttpServerConfig(host="0.0.0.0", api_key="hunter2")
    assert "hunter2" not in repr(config) and "hunter2" not in str(config.model_dump())
    assert config.api_key.get_secret_value() == "hunter2"


def test_a_dead_stepping_thread_answers_503(tiny_model_path):
    """/health said 200 while nothing was served any more (#23); now health and requests answer 503."""
    from app_server import serve_in_thread

    from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from miles_ray.engines.http_server import EngineServer
    from miles_ray.engines.loop import EngineLoop

    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=tiny_model_path, max_batch_size=2, max_seq_len=64))
    loop = EngineLoop(engine)
    server = EngineServer(loop, "tiny")  # the default config: a random key
    auth = {"Authorization": f"Bearer {server.config.api_key.get_secret_value()}"}
    with serve_in_thread(server.app) as url:
        assert requests.get(f"{url}/health", timeout=10).status_code == 401
        assert requests.get(f"{url}/health", headers=auth, timeout=10).status_code == 200

        def exit_thread():  # fault injection: end the stepping thread past its `except Exception`
            raise SystemExit

        engine.has_work = exit_thread
        loop.wake()
        loop._thread.join(10)
        assert requests.get(f"{url}/health", headers=auth, timeout=10).status_code == 503
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        r = requests.post(f"{url}/generate", json=body, headers=auth, timeout=10)
        assert r.status_code == 503 and "stepping thread has died" in r.json()["error"]["message"]
