"""Bounded fuzzing (#23): 1000+ random and malformed bodies against every POST route of the embedded engine's HTTP
server and of the reward server. No body may get a 5xx, the engine must still generate correctly afterwards, and
the engine process may not grow by more than 200 MB. Bodies come from a seeded generator (reproducible: a failure
prints the route and body), shaped like each route's fields so that they reach its validation, not only the JSON
parser."""

import json
import random

import psutil
import pytest
import requests
from app_server import serve_in_thread

KEY = "test-key"
ROUTE_FIELDS = {
    "/generate": ["input_ids", "text", "sampling_params", "return_logprob", "rid", "stream"],
    "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs", "stream"],
    "/v1/chat/completions": [
        "messages",
        "max_tokens",
        "tools",
        "tool_choice",
        "logprobs",
        "top_logprobs",
        "stop",
        "seed",
    ]
    + ["n", "stream", "stream_options"],
    "/abort_request": ["rid", "abort_all"],
    "/pause_generation": ["mode"],
    "/continue_generation": [],
    "/flush_cache": [],
    "/update_weights_from_tensor": ["serialized_named_tensors", "weight_version"],
    "/update_weights_from_disk": ["model_path", "weight_version"],
}
SAMPLING = ["max_new_tokens", "temperature", "top_p", "top_k", "n", "stop", "stop_token_ids", "ignore_eos", "seed"]
SAMPLING += ["sampling_seed", "min_p"]


def value(rng: random.Random, depth: int = 0):
    """A random JSON value, biased to the edges: huge and negative numbers, empty and odd containers."""
    kinds = ["none", "bool", "int", "bigint", "float", "str", "list", "dict", "ids"]
    kind = rng.choice(kinds if depth < 3 else kinds[:6])
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, 2, -1, 3, 7, 64, 127, 128, 2**31])
    if kind == "bigint":
        return rng.choice([2**63, -(2**63) - 1, 10**30, -(10**30)])
    if kind == "float":
        return rng.choice([0.0, -0.5, 0.5, 1e308, -1e-308, 3.7])
    if kind == "str":
        return rng.choice(
            ["", "a", "abort", "in_place", "x" * 300, "\u0000\ud7ff", "<tool_call>", "/", "Hello", "auto"]
        )
    if kind == "ids":
        return [rng.randrange(-2, 70000) for _ in range(rng.randrange(0, 6))]
    if kind == "list":
        return [value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {rng.choice(SAMPLING + ["role", "content", "a"]): value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def body(rng: random.Random, route: str) -> bytes:
    """A body for ``route``: mostly its own fields with random values, sometimes not JSON or not an object."""
    roll = rng.random()
    if roll < 0.1:
        return rng.choice([b"", b"{", b"[" * 5000, b"\xff\xfe", b"null", b"[1, 2]", b'"text"', b"{}" * 3])
    fields = ROUTE_FIELDS[route] or ["a"]
    out = {f: value(rng) for f in rng.sample(fields, rng.randrange(0, len(fields) + 1))}
    if "sampling_params" in out and rng.random() < 0.7:
        out["sampling_params"] = {k: value(rng, 2) for k in rng.sample(SAMPLING, rng.randrange(0, 4))}
    if route == "/v1/chat/completions" and rng.random() < 0.5:
        out["messages"] = [{"role": rng.choice(["user", "system", "tool", 5]), "content": value(rng, 2)}]
    return json.dumps(out).encode()


def _engine_process(url: str) -> psutil.Process:
    port = url.rsplit(":", 1)[1]
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "miles_ray.engines.http_server" in cmd and port in cmd:
            return p
    raise AssertionError(f"no engine process serving {url}")


def _fuzz(url: str, routes: list[str], n: int, seed: int, headers: dict, make_body) -> list[str]:
    rng, bad = random.Random(seed), []
    with requests.Session() as s:
        for i in range(n):
            route = routes[i % len(routes)]
            data = make_body(rng, route)
            r = s.post(f"{url}{route}", data=data, headers={**headers, "Content-Type": "application/json"}, timeout=60)
            streamed_error = (
                r.headers.get("Content-Type", "").startswith("text/event-stream") and "server_error" in r.text
            )
            if r.status_code >= 500 or streamed_error:  # a stream's status is sent first: errors come as events
                bad.append(f"{route} {data[:200]!r} -> {r.status_code} {r.text[:200]}")
            if route == "/pause_generation":  # a valid pause would stall the rest: undo it
                s.post(f"{url}/continue_generation", headers=headers, timeout=60)
    return bad


def test_engine_routes_survive_random_bodies(server):
    proc = _engine_process(server)
    auth = {"Authorization": f"Bearer {KEY}"}
    warm = _fuzz(server, list(ROUTE_FIELDS), 90, seed=1, headers=auth, make_body=body)  # caches, lazy imports
    rss_before = proc.memory_info().rss
    bad = warm + _fuzz(server, list(ROUTE_FIELDS), 1080, seed=2, headers=auth, make_body=body)
    grown_mb = (proc.memory_info().rss - rss_before) / 2**20
    assert not bad, "\n".join(bad[:10])
    assert grown_mb < 200, f"the engine process grew by {grown_mb:.0f} MB over 1080 bodies"
    greedy = {"input_ids": [1, 50, 60], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    outs = [requests.post(f"{server}/generate", json=greedy, headers=auth, timeout=60) for _ in range(2)]
    assert all(o.status_code == 200 for o in outs) and outs[0].json()["output_ids"] == outs[1].json()["output_ids"]
    assert len(outs[0].json()["output_ids"]) == 4
    assert requests.get(f"{server}/health", headers=auth, timeout=10).status_code == 200


def reward_body(rng: random.Random, route: str) -> bytes:
    roll = rng.random()
    if roll < 0.1:
        return rng.choice([b"", b"{", b"[" * 5000, b"\xff\xfe", b"null"])
    fields = ["response", "responses", "entry"]
    return json.dumps({f: value(rng) for f in rng.sample(fields, rng.randrange(0, 4))}).encode()


def total_reward(text, entry):  # defined for any input, so any 5xx is the server's fault, not the function's
    return float(len(str(text)) % 3)


def total_group_reward(texts, entry):
    return [float(len(str(t)) % 3) for t in texts] if isinstance(texts, list) else [0.0]


@pytest.fixture(scope="module")
def reward_server():
    from miles_ray.rewards.http import reward_app

    with serve_in_thread(reward_app(total_reward, total_group_reward, api_key="k")) as url:
        yield url


def test_reward_routes_survive_random_bodies(reward_server):
    auth = {"Authorization": "Bearer k"}
    bad = _fuzz(reward_server, ["/reward", "/reward_group"], 1000, seed=3, headers=auth, make_body=reward_body)
    assert not bad, "\n".join(bad[:10])
    ok = requests.post(f"{reward_server}/reward", json={"response": "abcd", "entry": {}}, headers=auth, timeout=10)
    assert ok.json() == {"reward": 1.0}
