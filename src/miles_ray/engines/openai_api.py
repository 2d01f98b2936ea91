"""OpenAI routes of an embedded engine: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

Besides the standard fields, responses carry the exact token ids (vLLM's names: ``choices[i].token_ids``, and
``prompt_token_ids`` on the completion choice or the chat response), and ``/v1/completions`` accepts a token-id
prompt, so an agent using the ``openai`` client yields trainable token-in/token-out trajectories.

vLLM's chat fields ``chat_template_kwargs``, ``continue_final_message`` and ``add_generation_prompt`` shape the
prompt as they do there. Fields the engine does not implement are refused by name with a 400, except at the value
that changes nothing, which clients send by default (penalties 0 or 1, ``logit_bias: {}``, ``store: false``, a
text ``response_format``).

A stop string that ends a choice is cut out of its text, as OpenAI and vLLM do (its tokens stay in ``token_ids``:
they were sampled and are trained on); ``include_stop_str_in_output: true`` (vLLM's field) keeps it. Each finished
choice says what ended it in vLLM's ``stop_reason``: the stop string, the stop token id, or null (EOS, length).

``stream: true`` answers with server-sent events (``engines/streaming.py``); every chunk carries its
``token_ids`` (and logprobs when asked), the first chunk of a choice its ``prompt_token_ids``, so a streamed
call is as trainable as a plain one. ``stream_options.include_usage`` adds a usage chunk. Text that may be the
start of a stop string is held back until the next tokens show whether it is, so the deltas never carry a stop
string that the whole text leaves out.

Function calling: ``tools`` go to the chat template, and with ``tool_choice`` ``auto`` (the default when tools are
given) the response text is parsed by the configured ``ToolCallParser`` into ``message.tool_calls`` (finish reason
``tool_calls``); text that does not parse stays ``content``. ``required`` or a named function starts the
response with the parser's opening of a call (``forced_prefix``): those tokens join the prompt
(``prompt_token_ids``), so the sampled tokens remain exactly what is trained. A stream holds content back from
the first sign of a call and sends the parsed calls in full when the response ends.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from miles_ray.engines.http_common import (
    NEUTRAL_FIELDS,
    SAMPLING_FIELDS,
    HttpServerConfig,
    RequestError,
    TokenizerThread,
    admit,
    check_neutral,
    flag,
    read_json,
    run_requests,
    sampling_params,
)
from miles_ray.engines.loop import EngineLoop, TokenEvent
from miles_ray.engines.requests import Completion, GenerateOutput, GenerateRequest, SamplingParams
from miles_ray.engines.sampling import cut_at_stop
from miles_ray.engines.streaming import EventStream, IncrementalDetokenizer, merged, rest_of, sendable
from miles_ray.engines.tool_calls import chat_template, tool_call_parser

_PARAMS = {**SAMPLING_FIELDS, "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
# accepted fields that are not sampling params (handled, or meaningless for one served model); vLLM's
# include_stop_str_in_output keeps the stop string that ended a choice in its text
_HANDLED = {
    "model",
    "user",
    "logprobs",
    "top_logprobs",
    "return_token_ids",
    "stream",
    "stream_options",
    "include_stop_str_in_output",
    "metadata",
}
# vLLM's chat fields that shape the prompt: whether it ends with an assistant turn's opening or continues the last
# message (an assistant prefix), and the chat template's own variables (enable_thinking, ...)
_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
# apply_chat_template's own arguments, which chat_template_kwargs may not set
_TEMPLATE_RESERVED = {"conversation", "messages", "tools", "documents", "chat_template", "tokenize", "return_dict"}
_TEMPLATE_RESERVED |= {"return_tensors", "tokenizer_kwargs", "return_assistant_tokens_mask", *_TEMPLATE_FIELDS}
# OpenAI fields the engine takes only at the value that changes nothing (besides http_common.NEUTRAL_FIELDS)
_NEUTRAL = {"logit_bias": {}, "store": False, "response_format": {"type": "text"}}
_CHAT_ONLY = {"messages", "tools", "tool_choice", "parallel_tool_calls", *_TEMPLATE_FIELDS}


class OpenAIRoutes:
    """The OpenAI API of one engine; ``routes()`` for the server's application."""

    def __init__(self, loop: EngineLoop, model_name: str, config: HttpServerConfig, tokenize: TokenizerThread):
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = loop.engine.tokenizer
        self.model_name = model_name
        self.config = config
        self.parser = tool_call_parser(config.tool_call_parser)
        self.template = chat_template(config.chat_template)
        self.tokenize = tokenize

    def routes(self) -> list[web.RouteDef]:
        """The three routes."""
        return [
            web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
        ]

    async def models(self, request: web.Request) -> web.Response:
        """The one served model."""
        entry = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "miles_ray"}
        return web.json_response({"object": "list", "data": [entry]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``/v1/completions``; ``prompt`` may be text, token ids, or a list of either."""
        body = await read_json(request, self.config.max_request_mb, "max_request_mb")
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("prompt must be a string, a list of token ids, or a non-empty list of those", "prompt")
        special = body.get("add_special_tokens", True)  # vLLM's field: a text prompt gets BOS where the model has one
        if not isinstance(special, bool):
            raise RequestError(f"add_special_tokens must be true or false, got {special!r}", "add_special_tokens")
        ids = [await self._encode(p, special) for p in prompt]
        params, want_logprobs, usage, keep_stop = self._params(body, default_max=16, chat=False)
        reqs = [GenerateRequest(p, self._fit(p, params, "prompt"), f"cmpl-{uuid.uuid4().hex[:12]}") for p in ids]
        fmt = _TextFormat(self, ids, params.n, want_logprobs, params.stop, keep_stop)
        if body.get("stream"):
            return await self._stream(request, reqs, fmt, usage)
        outs = await run_requests(self.loop, reqs, self.config.max_waiting_requests)
        choices = [fmt.choice(k * params.n + j, c) for k, out in enumerate(outs) for j, c in enumerate(out.completions)]
        return web.json_response(self._envelope(fmt.kind, outs, choices, ids))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``/v1/chat/completions`` through the chat template, with tools and tool calls (see the module doc)."""
        body = await read_json(request, self.config.max_request_mb, "max_request_mb")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
        messages = [_text_content(m, i) for i, m in enumerate(messages)]
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise RequestError("tools must be a list of tool objects ({type, function})", "tools")
        parse, prefix = self._tool_choice(body.get("tool_choice"), tools or [])
        text = await self.tokenize.run(self._render, messages, tools or None, _template_args(body, messages))
        ids = await self.tokenize.run(self._text_ids, text + prefix)
        # OpenAI: up to the context limit (_fit says so when the prompt leaves no room)
        default_max = max(1, self.engine.config.max_seq_len - len(ids))
        params, want_logprobs, usage, keep_stop = self._params(body, default_max=default_max, chat=True)
        req = GenerateRequest(ids, self._fit(ids, params, "messages"), f"chatcmpl-{uuid.uuid4().hex[:12]}")
        fmt = _ChatFormat(self, [ids], params.n, want_logprobs, params.stop, keep_stop, parse=parse, prefix=prefix)
        if body.get("stream"):
            return await self._stream(request, [req], fmt, usage)
        [out] = await run_requests(self.loop, [req], self.config.max_waiting_requests)
        resp = self._envelope(fmt.kind, [out], [fmt.choice(j, c) for j, c in enumerate(out.completions)], [ids])
        resp["prompt_token_ids"] = ids
        return web.json_response(resp)

    # --- request parts -------------------------------------------------------------------------
    def _params(self, body: dict, default_max: int, chat: bool) -> tuple[SamplingParams, bool, bool, bool]:
        """Sampling params, logprobs wanted, a usage chunk wanted, and whether stop strings stay in the text.

        Stop strings stay with vLLM's ``include_stop_str_in_output: true``; OpenAI cuts them out.
        Logprobs are asked with ``logprobs: true`` in chat and ``logprobs: 0`` in completions.
        """
        own = _CHAT_ONLY if chat else {"prompt", "add_special_tokens"}
        unknown = sorted(set(body) - set(_PARAMS) - set(NEUTRAL_FIELDS) - set(_NEUTRAL) - _HANDLED - own)
        if unknown:
            raise RequestError(f"{unknown[0]} is not supported by the embedded engine", unknown[0])
        for key in ("stream", "parallel_tool_calls"):
            flag(body, key, False)  # checked up front: a bad value fails before any work; read where used
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise RequestError("stream_options may only hold include_usage (true or false)", "stream_options")
        logprobs = body.get("logprobs")
        alternatives = body.get("top_logprobs") if chat else logprobs
        if alternatives is not None and alternatives is not False and alternatives != 0:
            name = "top_logprobs" if chat else "logprobs"
            raise RequestError(f"{name} > 0 (alternative tokens) is not supported; sampled-token logprobs are", name)
        for key, neutral in _NEUTRAL.items():
            check_neutral(key, body.get(key), neutral)
        raw = {k: v for k, v in body.items() if (k in _PARAMS or k in NEUTRAL_FIELDS) and v is not None}
        if "max_tokens" not in raw and "max_completion_tokens" not in raw:
            raw["max_tokens"] = default_max
        params = sampling_params(raw, _PARAMS, "")
        want_logprobs, usage = logprobs is not None and logprobs is not False, options.get("include_usage") is True
        return params, want_logprobs, usage, flag(body, "include_stop_str_in_output", False)

    def _fit(self, prompt_ids: list[int], params: SamplingParams, where: str) -> SamplingParams:
        """``params`` with ``max_tokens`` cut to what the context leaves after the prompt, as vLLM's server does.

        Raises:
            RequestError: naming ``where`` when the prompt leaves no room for one token, in the words of vLLM's
                (and OpenAI's) context-length error, which agent frameworks recognise.

        """
        limit = self.engine.config.max_seq_len
        room = limit - len(prompt_ids)
        if room < 1:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{len(prompt_ids)} input tokens, which leaves no room for output tokens. Please reduce the length "
                f"of the {where}.",
                where,
            )
        return params if params.max_new_tokens <= room else params.model_copy(update={"max_new_tokens": room})

    def _tool_choice(self, choice, tools: list[dict]) -> tuple[bool, str]:
        """``(parse tool calls, forced prefix)`` for ``tool_choice``: none | auto | required | a named function."""
        names = [t.get("function", {}).get("name") for t in tools if isinstance(t.get("function"), dict)]
        if choice is None:
            choice = "auto" if tools else "none"
        if choice == "none":
            return False, ""
        if not tools:
            raise RequestError(f"tool_choice={choice!r} needs tools", "tool_choice")
        if choice == "auto":
            return True, ""
        if choice == "required":
            return True, self.parser.forced_prefix(None)
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in names:
            raise RequestError(
                "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': N}} "
                f"with N one of the tools {names}, got {choice!r}",
                "tool_choice",
            )
        return True, self.parser.forced_prefix(name)

    def _render(self, messages: list[dict], tools: list[dict] | None, args: dict) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self.template, tokenize=False, **args
            )
        except Exception as exc:  # a template raises anything on messages it does not expect
            raise RequestError(f"messages do not fit the model's chat template: {exc}", "messages") from None

    def _text_ids(self, text: str, special: bool = False) -> list[int]:
        return self.tokenizer(text, add_special_tokens=special)["input_ids"]

    async def _encode(self, prompt, special: bool) -> list[int]:
        if isinstance(prompt, str):
            return await self.tokenize.run(self._text_ids, prompt, special)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        raise RequestError("each prompt must be a string or a list of token ids", "prompt")

    # --- responses -----------------------------------------------------------------------------
    async def _stream(
        self, request: web.Request, reqs: list[GenerateRequest], fmt: _Format, usage: bool
    ) -> web.StreamResponse:
        """Answer ``reqs`` as server-sent events; a client that goes away aborts them."""
        admit(self.loop, reqs, self.config.max_waiting_requests)  # errors before the stream opens get a 4xx/503
        sse = EventStream(request)
        await sse.open()
        n, outs = reqs[0].params.n, []
        try:
            async with contextlib.aclosing(merged([self.loop.stream(r) for r in reqs])) as events:
                async for k, event in events:
                    if isinstance(event, TokenEvent):
                        chunks = fmt.token(k * n + event.index, event.token_id, event.logprob)
                    else:
                        outs.append(event)
                        chunks = [
                            chunk
                            for j, done in enumerate(event.completions)
                            for chunk in fmt.finish(k * n + j, done, event.weight_version)
                        ]
                    for choice, extras in chunks:
                        await sse.send(self._chunk(fmt.kind_chunk, reqs[0].request_id, [choice], **extras))
        except ConnectionResetError:  # the client left: the closed iterator has aborted its requests
            return sse.response
        except Exception as exc:  # the status line is sent: the error travels as an event, as vLLM does
            await sse.send({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error", "code": 500}})
        if usage and outs:
            tail = self._envelope(fmt.kind_chunk, outs, [], [r.prompt_ids for r in reqs])
            await sse.send({**tail, "id": reqs[0].request_id})
        return await sse.close()

    def _chunk(self, kind: str, request_id: str, choices: list, **extra) -> dict:
        return {
            "id": request_id,
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            **extra,
        }

    def _envelope(self, kind: str, outs: list[GenerateOutput], choices: list, prompts: list[list[int]]) -> dict:
        completion_tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
        prompt_tokens = sum(len(p) for p in prompts)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        out = self._chunk(kind, outs[0].request_id, choices, usage=usage)
        out["weight_version"] = outs[0].weight_version
        return out


@dataclass
class _ChoiceState:
    """What a stream has sent of one choice."""

    detok: IncrementalDetokenizer
    text: str = ""  # decoded so far
    sent: str = ""  # text sent as deltas
    started: bool = False  # its first chunk (role, prompt ids) is out


@dataclass
class _Format:
    """How a route shapes choice ``i`` (of prompt ``i // n``): whole, or as stream chunks.

    ``token`` and ``finish`` return ``(choice, envelope extras)`` pairs, one per chunk to send.
    """

    routes: OpenAIRoutes
    prompts: list[list[int]]  # per prompt, as the engine saw it
    n: int
    want_logprobs: bool
    stop: list[str]  # the stop strings asked for
    keep_stop: bool  # a choice's text keeps the stop string that ended it (else it is cut out)
    states: dict[int, _ChoiceState] = field(default_factory=dict)

    def state(self, index: int) -> _ChoiceState:
        if index not in self.states:
            self.states[index] = _ChoiceState(IncrementalDetokenizer(self.routes.tokenizer))
        return self.states[index]

    def tokens(self, token_ids: list[int]) -> list[str]:
        return self.routes.tokenizer.convert_ids_to_tokens(token_ids)

    def text(self, c: Completion) -> str:
        """The choice's text: the engine's (through the stop string that ended it), less that string unless kept."""
        return cut_at_stop(c.text, c.stop_reason, self.keep_stop)


class _TextFormat(_Format):
    kind = kind_chunk = "text_completion"

    def choice(self, index: int, c: Completion) -> dict:
        """A whole ``/v1/completions`` choice."""
        return self._choice(index, self.text(c), c, c.token_ids, c.logprobs)

    def token(self, index: int, token_id: int, logprob: float) -> list[tuple[dict, dict]]:
        st = self.state(index)
        st.text += st.detok.push(token_id)
        visible = sendable(st.text, self.stop, self.keep_stop)
        choice = self._choice(index, visible[len(st.sent) :], None, [token_id], [logprob], first=not st.started)
        st.sent, st.started = visible, True
        return [(choice, {})]

    def finish(self, index: int, c: Completion, version: int) -> list[tuple[dict, dict]]:
        st = self.state(index)
        choice = self._choice(index, rest_of(self.text(c), st.sent), c, [], [], first=not st.started)
        return [(choice, {"weight_version": version})]

    def _choice(self, index, text, done: Completion | None, token_ids, logprobs, first: bool = True) -> dict:
        """Choice ``index``'s text and tokens; ``done``: the finished completion, on its last chunk."""
        choice = {"index": index, "text": text, "logprobs": None, "token_ids": token_ids, **_finish(done)}
        if self.want_logprobs:
            choice["logprobs"] = {
                "tokens": self.tokens(token_ids),
                "token_logprobs": logprobs,
                "top_logprobs": None,
                "text_offset": None,
            }
        if first:
            choice["prompt_token_ids"] = self.prompts[index // self.n]
        return choice


@dataclass
class _ChatFormat(_Format):
    parse: bool = False  # read tool calls out of the text
    prefix: str = ""  # forced opening of a call (tool_choice), part of the prompt
    kind = "chat.completion"
    kind_chunk = "chat.completion.chunk"

    def message(self, c: Completion) -> tuple[dict, str]:
        """The assistant message of ``c`` and its finish reason (``tool_calls`` when calls parsed)."""
        text = self.prefix + self.text(c)
        if self.parse:
            content, calls = self.routes.parser.parse(text)
            if calls:
                reason = c.finish_reason if c.finish_reason == "abort" else "tool_calls"
                return {
                    "role": "assistant",
                    "content": content or None,
                    "tool_calls": [call.to_openai() for call in calls],
                }, reason
        return {"role": "assistant", "content": text}, c.finish_reason

    def choice(self, index: int, c: Completion) -> dict:
        """A whole ``/v1/chat/completions`` choice."""
        message, reason = self.message(c)
        logprobs = self._logprobs(c.token_ids, c.logprobs)
        return {
            "index": index,
            "message": message,
            "finish_reason": reason,
            "stop_reason": c.stop_reason,
            "logprobs": logprobs,
            "token_ids": c.token_ids,
        }

    def token(self, index: int, token_id: int, logprob: float) -> list[tuple[dict, dict]]:
        st = self.state(index)
        st.text += st.detok.push(token_id)
        visible = self.prefix + sendable(st.text, self.stop, self.keep_stop)
        if self.parse:  # a call is sent parsed when the response ends, not as content
            visible = sendable(visible, [self.routes.parser.start])
        delta = {"content": visible[len(st.sent) :]}
        st.sent = visible
        return [self._chunk(st, index, delta, None, [token_id], [logprob])]

    def finish(self, index: int, c: Completion, version: int) -> list[tuple[dict, dict]]:
        st = self.state(index)
        message, reason = self.message(c)
        rest = {"content": rest_of(message["content"] or "", st.sent)}
        chunks = []
        if "tool_calls" in message:
            calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            chunks.append(self._chunk(st, index, {**rest, "tool_calls": calls}, None, [], []))
            rest = {}
        final = self._chunk(st, index, rest, reason, [], [])
        final[0]["stop_reason"] = c.stop_reason
        return [*chunks, (final[0], {**final[1], "weight_version": version})]

    def _chunk(self, st: _ChoiceState, index, delta, reason, token_ids, logprobs) -> tuple[dict, dict]:
        if not delta.get("content"):
            delta = {k: v for k, v in delta.items() if k != "content"}
        extras = {}
        if not st.started:  # the first chunk of a choice: its role, and the prompt as the engine saw it
            delta = {"role": "assistant", "content": "", **delta}
            extras["prompt_token_ids"] = self.prompts[index // self.n]
            st.started = True
        choice = {"index": index, "delta": delta, "logprobs": self._logprobs(token_ids, logprobs)}
        return {**choice, "finish_reason": reason, "stop_reason": None, "token_ids": token_ids}, extras

    def _logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict | None:
        if not self.want_logprobs:
            return None
        pairs = zip(self.tokens(token_ids), logprobs)
        return {
            "content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in pairs]
        }


def _template_args(body: dict, messages: list[dict]) -> dict:
    """``apply_chat_template``'s arguments from vLLM's chat fields (``_TEMPLATE_FIELDS``).

    Raises:
        RequestError: naming a field of the wrong type, both endings asked for, a continued message that is not the
            assistant's, or a template variable that is one of ``apply_chat_template``'s own arguments.

    """
    ends = {"add_generation_prompt": flag(body, "add_generation_prompt", True)}
    ends["continue_final_message"] = flag(body, "continue_final_message", False)
    if ends["continue_final_message"]:
        if body.get("add_generation_prompt"):
            raise RequestError(
                "continue_final_message and add_generation_prompt cannot both be true", "add_generation_prompt"
            )
        if messages[-1].get("role") != "assistant":
            raise RequestError("continue_final_message needs the last message to be the assistant's", "messages")
        ends["add_generation_prompt"] = False
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise RequestError(f"chat_template_kwargs must be an object, got {extra!r:.80}", "chat_template_kwargs")
    clash = sorted(set(extra) & _TEMPLATE_RESERVED)
    if clash:
        raise RequestError(f"chat_template_kwargs may not set {clash}: the route sets them", "chat_template_kwargs")
    return {**extra, **ends}


def _text_content(message: dict, index: int) -> dict:
    """``message`` with its content parts joined into one string, as vLLM does for a text-only chat template.

    Agent frameworks send content as parts (``[{"type": "text", "text": ...}]``); a chat template wants a string.
    The texts are joined with newlines; null content (an assistant turn that only calls tools) is the empty string.

    Raises:
        RequestError: naming ``messages[i].content`` (or the part) that is neither text nor null.

    """
    content, where = message.get("content"), f"messages[{index}].content"
    if isinstance(content, str):
        return message
    if content is None:
        return {**message, "content": ""}
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string, null or a list of text parts, got {content!r:.80}", where)
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(
                f"{where}[{j}] must be a text part {{type: text, text: ...}} (a text-only model), got {kind!r}",
                f"{where}[{j}]",
            )
    return {**message, "content": "\n".join(part["text"] for part in content)}


def _finish(done: Completion | None) -> dict:
    """A choice's ``finish_reason`` and vLLM's ``stop_reason`` (the stop string or token id that ended it)."""
    if done is None:
        return {"finish_reason": None, "stop_reason": None}
    return {"finish_reason": done.finish_reason, "stop_reason": done.stop_reason}
