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


@pytest.mark.parametrize(
    ("body", "match"),
    [
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


def test_openai_completions_with_token_prompt(server, teacher_forced):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    resp = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, logprobs=0, seed=5, extra_body={"ignore_eos": True}
    )
    choice = resp.choices[0]
    assert choice.prompt_token_ids == PROMPT and len(choice.token_ids) == 8
    ref = teacher_forced(PROMPT, choice.token_ids)
    assert (torch.tensor(choice.logprobs.token_logprobs) - ref).abs().max().item() < 1e-5
    assert resp.usage.completion_tokens == 8 and resp.usage.prompt_tokens == 5


def test_openai_chat_returns_trainable_tokens(server, tiny_model_path):
    from openai import BadRequestError, OpenAI
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    client = OpenAI(base_url=f"{server}/v1", api_key=KEY)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, n=2, logprobs=True, seed=1)
    expected_prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert resp.prompt_token_ids == list(expected_prompt)
    for choice in resp.choices:
        assert choice.message.content == tok.decode(choice.token_ids, skip_special_tokens=True)
        assert len(choice.logprobs.content) == len(choice.token_ids)
        assert all(c.logprob <= 0 for c in choice.logprobs.content)
    with pytest.raises(BadRequestError, match="stream=true is not supported"):
        client.chat.completions.create(model="tiny", messages=messages, stream=True)
    for alternatives in (1, 3):
        with pytest.raises(BadRequestError, match="top_logprobs"):
            client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=alternatives)


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
