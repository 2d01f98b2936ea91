"""The OpenAI routes of the embedded engine over real HTTP, called with the real ``openai`` client: plain and
streamed completions and chats (a stream carries exactly the plain response's tokens, logprobs and text), tool
choice, and the hardened surface (client disconnects abort, the waiting queue is bounded, admin routes have
their own key)."""

import asyncio
import contextlib
import threading
import time

import pytest
import requests
import torch

KEY = "test-key"  # the key the `server` fixture (tests/conftest.py) starts the engine with
PROMPT = [1, 50, 60, 70, 80]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def _client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def test_openai_completions_with_token_prompt(server, teacher_forced):
    client = _client(server)
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
    from openai import BadRequestError
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    client = _client(server)
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, n=2, logprobs=True, seed=1)
    expected_prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert resp.prompt_token_ids == list(expected_prompt)
    for choice in resp.choices:
        assert choice.message.content == tok.decode(choice.token_ids, skip_special_tokens=True)
        assert len(choice.logprobs.content) == len(choice.token_ids)
        assert all(c.logprob <= 0 for c in choice.logprobs.content)
    for alternatives in (1, 3):
        with pytest.raises(BadRequestError, match="top_logprobs"):
            client.chat.completions.create(model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=alternatives)


def test_a_streamed_chat_is_the_plain_chat_chunk_by_chunk(server):
    """Same seed, stream and no stream: the deltas join into the same text, tokens and logprobs (n=2, usage)."""
    client = _client(server)
    kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "n": 2, "logprobs": True, "seed": 11}
    plain = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    text, ids, lps, reasons, prompts, usage, roles = {}, {}, {}, {}, {}, None, {}
    for chunk in stream:
        extra = chunk.model_extra or {}
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            i = c.index
            if c.delta.role:
                roles[i] = c.delta.role
                prompts[i] = extra["prompt_token_ids"]
            text[i] = text.get(i, "") + (c.delta.content or "")
            ids.setdefault(i, []).extend(c.model_extra["token_ids"])
            lps.setdefault(i, []).extend(x.logprob for x in (c.logprobs.content if c.logprobs else []))
            reasons[i] = c.finish_reason or reasons.get(i)
    assert roles == {0: "assistant", 1: "assistant"} and prompts[0] == prompts[1] == plain.prompt_token_ids
    for choice in plain.choices:
        i = choice.index
        assert text[i] == choice.message.content and ids[i] == choice.token_ids
        assert lps[i] == [x.logprob for x in choice.logprobs.content] and reasons[i] == choice.finish_reason
    assert usage.completion_tokens == plain.usage.completion_tokens == sum(len(c.token_ids) for c in plain.choices)


def test_streamed_completions_of_several_prompts_match_the_plain_ones(server):
    client = _client(server)
    kwargs = {"model": "tiny", "prompt": [PROMPT, [1, 2, 3]], "max_tokens": 20, "n": 2, "seed": 4, "logprobs": 0}
    plain = client.completions.create(**kwargs)
    text, ids, lps, prompts = {}, {}, {}, {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            extra = c.model_extra
            text[c.index] = text.get(c.index, "") + c.text
            ids.setdefault(c.index, []).extend(extra["token_ids"])
            lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs if c.logprobs else [])
            if "prompt_token_ids" in extra:
                prompts[c.index] = extra["prompt_token_ids"]
    assert sorted(text) == [0, 1, 2, 3]
    for choice in plain.choices:
        assert text[choice.index] == choice.text and ids[choice.index] == choice.token_ids
        assert lps[choice.index] == choice.logprobs.token_logprobs
        assert prompts[choice.index] == choice.prompt_token_ids == ([PROMPT] * 2 + [[1, 2, 3]] * 2)[choice.index]


def test_a_named_tool_choice_starts_the_call_in_the_prompt(server, tiny_model_path):
    """tool_choice naming a function: the parser's opening of the call joins the prompt, the sampled tokens
    follow it; the random tiny model writes no valid JSON, so the text stays content (never a 500)."""
    from transformers import AutoTokenizer

    from miles_ray.engines.tool_calls import HermesToolParser

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    prefix = HermesToolParser().forced_prefix("calculator")
    choice = {"type": "function", "function": {"name": "calculator"}}
    resp = _client(server).chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=6, seed=2
    )
    rendered = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert resp.prompt_token_ids == tok(rendered + prefix, add_special_tokens=False)["input_ids"]
    [c] = resp.choices
    sampled = tok.decode(c.token_ids, skip_special_tokens=True)
    assert c.message.tool_calls is None and c.message.content == prefix + sampled


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"tool_choice": "auto"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}}, "one of the tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice must be"),
        ({"stream": "yes"}, "stream must be true or false"),
        ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options"),
    ],
)
def test_bad_tool_and_stream_fields_get_400(server, extra, match):
    r = requests.post(
        f"{server}/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 2, **extra},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 400 and match in r.json()["error"]["message"], r.text


@contextlib.contextmanager
def _in_process_server(model_path: str, config):
    """``start_server`` itself (not the CLI: its config is under test) on a small engine; yields ``(url, engine)``."""
    from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from miles_ray.engines.http_server import start_server
    from miles_ray.engines.loop import EngineLoop

    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=model_path, max_batch_size=2, max_seq_len=64))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    runner, url = asyncio.run_coroutine_threadsafe(start_server(EngineLoop(engine), "tiny", config), loop).result(60)
    try:
        yield url, engine
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)


@pytest.fixture(scope="module")
def paused_server(tiny_model_path):
    """An in-process server with a one-request queue bound and an admin key; yields ``(url, engine)``."""
    from miles_ray.engines.http_server import HttpServerConfig

    config = HttpServerConfig(api_key=KEY, admin_api_key="admin-key", max_waiting_requests=1)
    with _in_process_server(tiny_model_path, config) as served:
        yield served


def _wait_for(condition, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_admin_routes_need_the_admin_key(paused_server):
    url, engine = paused_server
    user, admin = {"Authorization": f"Bearer {KEY}"}, {"Authorization": "Bearer admin-key"}
    refused = requests.post(f"{url}/pause_generation", json={"mode": "in_place"}, headers=user, timeout=10)
    assert refused.status_code == 401 and "admin bearer token" in refused.json()["error"]["message"]
    assert not engine.paused
    assert requests.post(f"{url}/abort_request", json={"abort_all": True}, headers=user, timeout=10).status_code == 401
    assert requests.get(f"{url}/health", headers=admin, timeout=10).status_code == 401  # admin key is not api_key
    assert requests.post(f"{url}/pause_generation", json={}, headers=admin, timeout=10).status_code == 200
    assert requests.post(f"{url}/continue_generation", headers=admin, timeout=10).status_code == 200


def test_a_full_queue_answers_503_and_a_client_that_leaves_is_aborted(paused_server):
    """Paused engine: one request waits (the bound), the next gets 503 + Retry-After; the waiting client then
    disconnects, and its request leaves the engine (handler cancelled, request aborted) without a resume."""
    url, engine = paused_server
    user, admin = {"Authorization": f"Bearer {KEY}"}, {"Authorization": "Bearer admin-key"}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4}
    requests.post(f"{url}/pause_generation", json={"mode": "in_place"}, headers=admin, timeout=10)
    try:
        for stream in (False, True):
            leaving = threading.Thread(target=_leave_after, args=(url, {**body, "stream": stream}, user, 2.0))
            leaving.start()
            assert _wait_for(lambda: engine.stats()["waiting"] == 1)
            full = requests.post(f"{url}/v1/completions", json=body, headers=user, timeout=10)
            assert full.status_code == 503 and full.headers["Retry-After"] == "1"
            assert "max_waiting_requests=1" in full.json()["error"]["message"]
            leaving.join()
            assert _wait_for(lambda: engine.stats()["waiting"] == 0 and not engine.request_ids()), stream
    finally:
        requests.post(f"{url}/continue_generation", headers=admin, timeout=10)
    ok = requests.post(f"{url}/v1/completions", json=body, headers=user, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) <= 4


def _leave_after(url: str, body: dict, headers: dict, seconds: float) -> None:
    """A client that gives up after ``seconds`` (its connection closes)."""
    try:
        with requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=seconds, stream=True) as r:
            for _ in r.iter_lines():  # a stream sends headers at once: wait for events until the timeout
                pass
    except requests.exceptions.RequestException:
        pass


def _ask(client, route: str, asked, stream: bool, **kwargs) -> dict:
    """One seeded choice for ``asked`` (a prompt for ``completions``, messages for ``chat``), plain or streamed and
    joined: its text, token ids, finish reason and stop reason."""
    kwargs = {"model": "tiny", "max_tokens": 24, "seed": 3, "stream": stream, **kwargs}
    kwargs["extra_body"] = {"ignore_eos": True, **kwargs.get("extra_body", {})}
    if route == "completions":
        out = client.completions.create(prompt=asked, **kwargs)
    else:
        out = client.chat.completions.create(messages=asked, **kwargs)
    got = {"text": "", "token_ids": [], "finish_reason": None, "stop_reason": None}
    for c in out if stream else out.choices:
        c = c.choices[0] if stream else c
        text = c.text if route == "completions" else (c.delta.content if stream else c.message.content)
        got["text"] += text or ""
        got["token_ids"] += c.model_extra["token_ids"]
        got["finish_reason"] = c.finish_reason or got["finish_reason"]
        got["stop_reason"] = c.model_extra.get("stop_reason") or got["stop_reason"]
    return got


def _across_tokens(text: str, token_ids: list[int], tokenizer) -> str | None:
    """Three characters of the last two thirds of ``text``, across a boundary of its tokens and found once in it: a
    stop string whose first character a stream would send too early without holding it back."""
    ends = [len(tokenizer.decode(token_ids[:m], skip_special_tokens=True)) for m in range(1, len(token_ids))]
    pieces = (text[b - 1 : b + 2] for b in ends if len(text) // 3 <= b - 1 and b + 2 <= len(text))
    return next((p for p in pieces if p.isascii() and p.strip() and text.count(p) == 1), None)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_stop_string_is_cut_from_the_text_unless_kept_plain_or_streamed(server, route, tiny_model_path):
    """As OpenAI and vLLM: the stop string that ended a choice is not in its text (its tokens stay in token_ids),
    unless ``include_stop_str_in_output``; ``stop_reason`` names it. A stream's deltas join into the same text, so
    they never carry a stop string the text leaves out (a partial one is held back until the next tokens) nor what a
    kept one's last token decodes to after it. Seeded samples, as greedy text of a random model often repeats one
    token."""
    client = _client(server)
    asked = PROMPT if route == "completions" else MESSAGES
    full = _ask(client, route, asked, False)
    from transformers import AutoTokenizer

    stop = _across_tokens(full["text"], full["token_ids"], AutoTokenizer.from_pretrained(tiny_model_path))
    assert stop is not None and full["stop_reason"] is None, full
    text, at = full["text"], full["text"].index(stop)
    for stream in (False, True):
        cut = _ask(client, route, asked, stream, stop=[stop])
        kept = _ask(client, route, asked, stream, stop=[stop], extra_body={"include_stop_str_in_output": True})
        assert cut["text"] == text[:at] and kept["text"] == text[: at + len(stop)], (stream, cut, kept, stop)
        for got in (cut, kept):
            assert (got["finish_reason"], got["stop_reason"]) == ("stop", stop)
            assert got["token_ids"] == full["token_ids"][: len(got["token_ids"])] and got["token_ids"]
    r = requests.post(
        f"{server}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 2, "include_stop_str_in_output": "yes"},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 400 and "include_stop_str_in_output must be true or false" in r.text, r.text


NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {}, "store": False}
NEUTRAL |= {"response_format": {"type": "text"}, "metadata": {"run": "a"}}


def test_fields_at_their_neutral_value_are_accepted_and_change_nothing(server):
    """Clients send penalties, logit_bias, store... at their defaults: the routes take them (and SGLang's /generate
    the penalties) and answer as without them."""
    client = _client(server)
    kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "seed": 5}
    plain = client.chat.completions.create(**kwargs)
    given = client.chat.completions.create(**kwargs, extra_body=NEUTRAL)
    assert given.choices[0].token_ids == plain.choices[0].token_ids
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "seed": 5}
    texts = [
        _post(server, "/v1/completions", {**body, **extra}).json()["choices"][0]["text"] for extra in ({}, NEUTRAL)
    ]
    assert texts[0] == texts[1]
    sampling = {"max_new_tokens": 4, "sampling_seed": 5, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    assert _post(server, "/generate", {"input_ids": PROMPT, "sampling_params": sampling}).status_code == 200


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("/v1/chat/completions", {"presence_penalty": 0.5}, "presence_penalty"),
        ("/v1/completions", {"frequency_penalty": -1}, "frequency_penalty"),
        ("/v1/completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
        ("/v1/chat/completions", {"logit_bias": {"50": 100}}, "logit_bias"),
        ("/v1/chat/completions", {"store": True}, "store"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/generate", {"sampling_params": {"presence_penalty": 1.0}}, "sampling_params.presence_penalty"),
    ],
)
def test_fields_that_would_change_sampling_get_400_naming_them(server, route, extra, param):
    """The engine implements no penalty or bias: a policy's samples must come from the distribution its logprobs
    describe. A value other than the neutral one is refused, not ignored."""
    body = {"input_ids": PROMPT} if route == "/generate" else {"model": "tiny", "max_tokens": 2}
    body |= {"prompt": PROMPT} if route == "/v1/completions" else {"messages": MESSAGES} if "chat" in route else {}
    r = _post(server, route, {**body, **extra})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and "except at" in error["message"], r.text


def _post(url, route, body):
    return requests.post(f"{url}{route}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_content_parts_are_joined_as_text_and_other_parts_refused(server):
    """Agent frameworks send ``content`` as a list of parts: text parts join with newlines into the string a chat
    template renders (as vLLM does for a text-only model), and null content (a turn of tool calls) is "", which the
    model's own template could not render; an image part gets a 400 naming it, not a template error."""
    client = _client(server)
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 3?"}]
    as_parts = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=2, seed=1
    )
    as_text = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "What is\n2 + 3?"}], max_tokens=2, seed=1
    )
    assert (
        as_parts.prompt_token_ids == as_text.prompt_token_ids
        and as_parts.choices[0].token_ids == as_text.choices[0].token_ids
    )
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    null = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "So?"}]
    assert client.chat.completions.create(model="tiny", messages=null, max_tokens=2).choices[0].token_ids  # as ""
    image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]
    for content, param in ((image, "messages[1].content[1]"), (7, "messages[1].content")):
        body = {"model": "tiny", "max_tokens": 2, "messages": [MESSAGES[0], {"role": "user", "content": content}]}
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_max_tokens_beyond_the_context_is_cut_to_it_and_a_prompt_that_fills_it_refused(server):
    """As vLLM's server: ``max_tokens`` past the context (128 here) generates up to its end, and a prompt that
    leaves no room gets the context-length error agent frameworks recognise ("maximum context length")."""
    client = _client(server)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=500, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and len(resp.choices[0].token_ids) == 128 - len(PROMPT)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1000, seed=1)
    assert len(chat.choices[0].token_ids) + len(chat.prompt_token_ids) <= 128
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": [5] * 128, "max_tokens": 1})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "prompt", r.text
    assert error["message"].startswith("This model's maximum context length is 128 tokens. However, your prompt")


THINKING_TEMPLATE = (  # ChatML whose generation prompt closes an empty think block when enable_thinking is false
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_vllm_chat_fields_shape_the_prompt(tiny_model_path, tmp_path):
    """vLLM's ``chat_template_kwargs`` reach the template (Qwen3's enable_thinking here), ``continue_final_message``
    continues an assistant prefix, ``add_generation_prompt: false`` leaves the turn's opening out; each prompt is
    the template's rendering token for token, and bad combinations get a 400 naming the field."""
    from transformers import AutoTokenizer

    from miles_ray.engines.http_server import HttpServerConfig

    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    prefix = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]

    def rendered(messages, **args):
        text = tok.apply_chat_template(messages, chat_template=THINKING_TEMPLATE, tokenize=False, **args)
        return tok(text, add_special_tokens=False)["input_ids"]

    with _in_process_server(tiny_model_path, HttpServerConfig(api_key=KEY, chat_template=str(template))) as (url, _):

        def prompt(messages, **extra):
            r = _post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text
            return r.json()["prompt_token_ids"]

        no_think = prompt(MESSAGES, chat_template_kwargs={"enable_thinking": False})
        assert no_think == rendered(MESSAGES, add_generation_prompt=True, enable_thinking=False)
        assert tok.decode(no_think).endswith("<think>\n\n</think>\n\n")
        assert prompt(MESSAGES) == rendered(MESSAGES, add_generation_prompt=True) != no_think
        assert prompt(MESSAGES, add_generation_prompt=False) == rendered(MESSAGES)
        continued = prompt(prefix, continue_final_message=True)
        assert continued == rendered(prefix, continue_final_message=True)
        assert tok.decode(continued).endswith("The answer is")
        for bad, param in (
            ({"continue_final_message": True}, "messages"),  # the last message is the user's
            ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
            ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
            ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
            ({"add_generation_prompt": "no"}, "add_generation_prompt"),
        ):
            messages = prefix if bad.get("add_generation_prompt") is True else MESSAGES
            r = _post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_a_text_prompt_gets_the_models_bos_unless_asked_not_to(tiny_model_path, tmp_path):
    """As vLLM's /v1/completions: a text prompt is tokenised with the model's special tokens (a Llama's BOS; the
    tiny model's tokenizer is set to add one here), ``add_special_tokens: false`` leaves them out; a token-id
    prompt is taken as it is."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from miles_ray.engines.http_server import HttpServerConfig

    for f in Path(tiny_model_path).iterdir():
        if not f.name.startswith("tokenizer"):
            (tmp_path / f.name).symlink_to(f)
    AutoTokenizer.from_pretrained(tiny_model_path, add_bos_token=True).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    bos, plain = tok("hi there")["input_ids"], tok("hi there", add_special_tokens=False)["input_ids"]
    assert bos == [tok.bos_token_id, *plain]
    with _in_process_server(str(tmp_path), HttpServerConfig(api_key=KEY)) as (url, _):

        def prompt_ids(**extra):
            r = _post(url, "/v1/completions", {"prompt": "hi there", "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["prompt_token_ids"]

        assert prompt_ids() == bos and prompt_ids(add_special_tokens=False) == plain
        assert prompt_ids(prompt=plain) == plain
        r = _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "add_special_tokens": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens", r.text
