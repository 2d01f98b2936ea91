"""Tool calls in generated text: a parser per format, and the chat templates that teach a model the format.

A model asked to call functions writes them in its own format; the OpenAI routes parse the text into
``tool_calls`` and leave the sampled tokens untouched (``token_ids`` are what the trainer trains on, whatever
the parse gave). A parser never raises on model output: text that does not parse stays ``content``, as with
vLLM's parsers, since a policy in training writes malformed calls and its reward should say so, not a 500.

``ToolCallParser`` is the contract; ``HermesToolParser`` reads the Hermes / Qwen format, also used by Qwen2.5,
Qwen3 and their MoE variants::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

A server selects one by name (``"hermes"``) or by import path (``"pkg.mod:MyParser"``, a class built with
no arguments). ``CHAT_TEMPLATES["chatml_tools"]`` is a ChatML template (SmolLM2's tokens) that renders
``tools``, assistant ``tool_calls`` and ``tool`` messages in that format, for models whose own template
ignores tools.

Usage::

    parser = tool_call_parser("hermes")
    content, calls = parser.parse(text)   # calls: [ToolCall(id, name, arguments), ...]
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from miles_ray.callables import resolve_callable
from miles_ray.contracts import protocol_gaps


@dataclass
class ToolCall:
    """One parsed call; ``arguments`` is a JSON string, as in OpenAI's ``tool_calls[i].function.arguments``."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        """The OpenAI ``tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallParser(Protocol):
    """Reads tool calls out of a response's text."""

    start: str  # text that opens a call: a stream holds content back from here on

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content, calls)``: the text before the first call and the calls; ``(text, [])`` if none parse."""
        ...

    def forced_prefix(self, name: str | None) -> str:
        """Text that starts a call (to function ``name``, or any function if None), for ``tool_choice``."""
        ...


class HermesToolParser:
    """Hermes calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more.

    The last may be unclosed: a stop string ``</tool_call>`` ends generation before the tag.
    """

    start = "<tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """See ``ToolCallParser.parse``; any call that is not ``{"name": str, "arguments": object}`` voids the parse."""
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text, at):
            try:
                call = json.loads(body)
            except ValueError:
                return text, []
            if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]):
                return text, []
            args = call.get("arguments", {})
            if not isinstance(args, dict):
                return text, []
            calls.append(ToolCall(call["name"], _raw_arguments(body, args)))
        return text[:at], calls

    def forced_prefix(self, name: str | None) -> str:
        """The opening the chat template gives an assistant call, up to the name (or to its quote)."""
        opening = '<tool_call>\n{"name": "'
        return opening if name is None else f'{opening}{name}", "arguments": '


def _raw_arguments(body: str, args: dict) -> str:
    """The arguments exactly as the model wrote them; re-serialised only if they cannot be cut out.

    The template writes a string back verbatim, so the next turn's prompt repeats the sampled tokens.
    """
    key = _ARGUMENTS.search(body)
    if key is not None:
        try:
            value, end = _DECODER.raw_decode(body, key.end())
        except ValueError:
            value = None
        if value == args:
            return body[key.end() : end]
    return json.dumps(args, ensure_ascii=False)


_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')
_DECODER = json.JSONDecoder()

TOOL_CALL_PARSERS: dict[str, type] = {"hermes": HermesToolParser}

_TEMPLATE_DIR = Path(__file__).parent / "templates"
CHAT_TEMPLATES: dict[str, Path] = {"chatml_tools": _TEMPLATE_DIR / "chatml_tools.jinja"}


def tool_call_parser(spec: str) -> ToolCallParser:
    """The parser named ``spec`` (a key of ``TOOL_CALL_PARSERS``) or at import path ``spec``.

    Raises:
        ValueError: for an unknown name, an import path that does not resolve, or a class that is no parser.

    """
    if spec in TOOL_CALL_PARSERS:
        return TOOL_CALL_PARSERS[spec]()
    if ":" not in spec and "." not in spec:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_CALL_PARSERS)} or an import path, got {spec!r}")
    cls = resolve_callable(spec, "tool_call_parser")
    gaps = protocol_gaps(cls, ToolCallParser) if isinstance(cls, type) else ["not a class"]
    if gaps:
        raise ValueError(f"tool_call_parser {spec!r} is no ToolCallParser: {'; '.join(gaps)}")
    return cls()


def chat_template(spec: str | None) -> str | None:
    """The Jinja text of a bundled template (a key of ``CHAT_TEMPLATES``) or of a file; None keeps the model's.

    Raises:
        ValueError: for a name that is neither bundled nor a readable file.

    """
    if spec is None:
        return None
    path = CHAT_TEMPLATES.get(spec, Path(spec))
    if not path.is_file():
        raise ValueError(f"chat_template must be one of {sorted(CHAT_TEMPLATES)} or a Jinja file, got {spec!r}")
    return path.read_text()
