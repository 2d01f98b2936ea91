"""Rewards over real HTTP: reward_app served by aiohttp (in a thread, and as the CLI process), HttpReward client."""

import math
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests
from app_server import serve_in_thread

from miles_ray.rewards.http import HttpReward, reward_app
from miles_ray.rewards.safe import SafeGroupReward, SafeReward


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            requests.get(f"{url}/health", timeout=1)
            return
        except requests.ConnectionError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} not up after {timeout_s}s")


SLOW_STARTED = threading.Event()


def exact(text, entry):
    if text == "boom":
        raise RuntimeError("judge crashed")
    if text == "slow":
        SLOW_STARTED.set()
        time.sleep(2)
    return math.nan if text == "nan" else float(text.strip() == entry["answer"])


async def ranked(texts, entry):  # per group: 1 for the shortest correct answer, 0.5 other correct ones, else 0
    correct = [i for i, t in enumerate(texts) if entry["answer"] in t]
    best = min(correct, key=lambda i: len(texts[i])) if correct else None
    return [1.0 if i == best else 0.5 if i in correct else 0.0 for i in range(len(texts))]


@pytest.fixture(scope="module")
def reward_server():
    with serve_in_thread(reward_app(exact, ranked, api_key="k")) as url:
        _wait_healthy(url)
        yield url


def test_remote_reward_values_and_failures(reward_server):
    reward = SafeReward(HttpReward(reward_server, api_key="k"), timeout_s=1.0)
    assert reward("42", {"answer": "42"}) == (1.0, None)
    assert reward("41", {"answer": "42"}) == (0.0, None)
    value, failure = reward("boom", {"answer": "42"})
    assert (
        value == 0.0 and failure.kind == "exception" and "judge crashed" in failure.message and "500" in failure.message
    )
    assert reward("nan", {"answer": "42"})[1].kind == "exception"  # the server refuses to send a NaN
    assert reward("slow", {"answer": "42"})[1].kind == "timeout"
    value, failure = SafeReward(HttpReward(reward_server, api_key="wrong"))("42", {"answer": "42"})
    assert "401" in failure.message
    dead = SafeReward(HttpReward(f"http://127.0.0.1:{_port()}"), timeout_s=5)("42", {"answer": "42"})
    assert dead[0] == 0.0 and dead[1].kind == "exception"  # connection refused: recorded, not raised


def test_remote_group_reward(reward_server):
    group = SafeGroupReward(HttpReward(reward_server, api_key="k").group, timeout_s=2.0)
    out = group(["the answer is 42", "42", "7"], {"answer": "42"})
    assert out == [(0.5, None), (1.0, None), (0.0, None)]


def test_group_reward_failures_in_process():
    assert [f.kind for _, f in SafeGroupReward(lambda texts, e: [1.0])(["a", "b"], None)] == ["invalid"] * 2
    out = SafeGroupReward(lambda texts, e: [1.0, math.nan])(["a", "b"], None)
    assert out[0] == (1.0, None) and out[1][1].kind == "invalid"  # a NaN fails only its own sample
    assert SafeGroupReward(lambda texts, e: 1 / 0)(["a"], None)[0][1].kind == "exception"
    with pytest.raises(ValueError, match="must start with http"):
        HttpReward("localhost:8100")


def test_reward_server_cli_serves_an_import_path_behind_a_random_key(tmp_path):
    """No key given: the CLI makes one and writes it to --api-key-file (0600), never to its output (#23)."""
    port, key_file = _port(), tmp_path / "reward_key"
    cmd = [sys.executable, "-m", "miles_ray.rewards.http", "--fn", "operator:contains", "--port", str(port)]
    cmd += ["--api-key-file", str(key_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url)
        key = key_file.read_text()
        assert len(key) >= 32 and key_file.stat().st_mode & 0o777 == 0o600
        assert SafeReward(HttpReward(url), timeout_s=5)("hello world", "world")[1].kind == "exception"  # 401
        reward = SafeReward(HttpReward(url, api_key=key), timeout_s=5)
        assert reward("hello world", "world") == (1.0, None)  # operator.contains(text, entry)
        bad = requests.post(f"{url}/reward", json={"entry": "x"}, headers={"Authorization": f"Bearer {key}"}, timeout=5)
        assert bad.status_code == 400 and "'response'" in bad.json()["error"]
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=10)
    assert str(key_file) in output and key not in output


def test_a_slow_synchronous_reward_does_not_block_the_others(reward_server):
    """Regression (#23): synchronous reward functions ran on the server's event loop, one slow call blocking all."""
    headers = {"Authorization": "Bearer k"}
    slow = threading.Thread(
        target=requests.post,
        args=(f"{reward_server}/reward",),
        kwargs={"json": {"response": "slow", "entry": {"answer": "42"}}, "headers": headers, "timeout": 10},
    )
    SLOW_STARTED.clear()
    slow.start()
    assert SLOW_STARTED.wait(5), "the slow call never started"
    t0 = time.monotonic()
    fast = requests.post(
        f"{reward_server}/reward", json={"response": "42", "entry": {"answer": "42"}}, headers=headers, timeout=10
    )
    elapsed = time.monotonic() - t0
    slow.join(10)
    assert fast.json() == {"reward": 1.0} and elapsed < 1.5, elapsed  # the slow one sleeps 2 s
