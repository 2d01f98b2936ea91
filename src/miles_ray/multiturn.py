"""Multi-turn trajectories from an OpenAI-compatible chat API, token-exact (token-in, token-out).

Every chat call to a miles_ray engine returns the prompt exactly as the engine tokenised it
(``prompt_token_ids``) and the sampled tokens with their logprobs (``choices[0].token_ids``, ``logprobs``).
``merge_turns`` joins the turns of one conversation into training samples without re-tokenising
anything: when a turn's prompt starts with the previous turn's prompt + response (the usual case), the
new prompt tokens between them (chat-template tokens, tool output) join the sequence with loss mask 0
and the new response with mask 1; when it does not (re-tokenisation drift: the template re-encoded an
earlier response differently), the turn starts a new sample instead, so no trained token is ever
one the policy did not sample.

``ChatTurnRunner`` drives one conversation with tools through the ``openai`` client, by standard function
calling (``tools`` in, ``tool_calls`` out, ``tool`` messages back), streamed or not.

Usage::

    turns = [Turn(prompt_ids, token_ids, logprobs), ...]      # from successive chat responses
    for seq in merge_turns(turns):                              # usually one
        Sample(seq.prompt_ids, seq.response_ids, seq.logprobs, loss_mask=seq.loss_mask, ...)
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import ray

from miles_ray.rewards.safe import SafeReward
from miles_ray.rollout import apply_reward
from miles_ray.types import GroupRef, Sample


@dataclass
class Turn:
    """One chat call: the prompt as the engine tokenised it, the sampled response and its logprobs."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"
    weight_version: int = 0


@dataclass
class Sequence:
    """A trainable token sequence: ``prompt_ids`` then ``response_ids`` (policy tokens where ``loss_mask`` is 1)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        """All tokens, prompt first."""
        return self.prompt_ids + self.response_ids


def merge_turns(turns: list[Turn]) -> list[Sequence]:
    """Join turns into as few token-exact sequences as the engine's tokenisation allows (see module doc).

    Raises:
        ValueError: if a turn's logprobs and response lengths differ.

    """
    sequences: list[Sequence] = []
    for i, t in enumerate(turns):
        if len(t.response_ids) != len(t.logprobs):
            raise ValueError(f"turn {i}: {len(t.response_ids)} response tokens but {len(t.logprobs)} logprobs")
        current = sequences[-1] if sequences else None
        if current is not None and t.prompt_ids[: len(current.ids)] == current.ids:
            delta = t.prompt_ids[len(current.ids) :]  # template + tool tokens the policy did not sample
            current.response_ids += delta
            current.logprobs += [0.0] * len(delta)
            current.loss_mask += [0] * len(delta)
        else:
            current = Sequence(list(t.prompt_ids))
            sequences.append(current)
        current.response_ids += t.response_ids
        current.logprobs += t.logprobs
        current.loss_mask += [1] * len(t.response_ids)
    return sequences


@dataclass
class Tool:
    """A function the policy may call: its OpenAI description and the Python function that runs a call.

    ``fn`` gets the call's arguments as keyword arguments and returns the result (sync or async); its string
    form goes back to the policy as a ``tool`` message.
    """

    name: str
    fn: Callable[..., Awaitable[object] | object]
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def spec(self) -> dict:
        """The entry of the request's ``tools``."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass
class Conversation:
    """What one tool-using conversation produced."""

    messages: list[dict]
    turns: list[Turn]
    final_text: str
    num_tool_calls: int


class ChatTurnRunner:
    """Runs a conversation by standard function calling, up to ``max_turns`` chat calls.

    It asks with ``tools``, runs the ``tool_calls`` the policy makes, sends their results back as ``tool``
    messages, and asks again, until a response makes no call.

    A call the policy gets wrong (an unknown tool, arguments that are not a JSON object or do not fit the
    function, a function that raises) is answered with an ``error: ...`` tool message, as an agent framework
    would, so the policy learns from it and the rollout goes on.

    Args:
        client: an ``openai.AsyncOpenAI`` client pointed at an engine's ``/v1``.
        model: the served model name.
        tools: the functions the policy may call.
        max_turns: chat calls at most.
        stream: ask for server-sent events and rebuild each turn from its chunks (same tokens and logprobs).
        sampling: extra ``chat.completions.create`` arguments (``max_tokens``, ``temperature``, ``stop``...). As
            OpenAI's, the engines cut a stop string out of the content (a reward reads the final content);
            ``extra_body={"include_stop_str_in_output": True}`` keeps it. The tokens keep it either way.

    """

    def __init__(self, client, model: str, tools: list[Tool], max_turns: int = 3, stream: bool = False, **sampling):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if len({t.name for t in tools}) != len(tools):
            raise ValueError(f"tools must have distinct names, got {[t.name for t in tools]}")
        self.client = client
        self.model = model
        self.tools = {t.name: t for t in tools}
        self.max_turns = max_turns
        self.stream = stream
        self.sampling = sampling

    async def run(self, messages: list[dict]) -> Conversation:
        """Run one conversation starting from ``messages`` (not modified)."""
        messages = list(messages)
        turns: list[Turn] = []
        calls = 0
        for _ in range(self.max_turns):
            turn, message = await (self._streamed_turn(messages) if self.stream else self._turn(messages))
            turns.append(turn)
            messages.append(message)
            for call in message.get("tool_calls", []):
                content = await self._call(call["function"]["name"], call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
                calls += 1
            if "tool_calls" not in message:
                break
        return Conversation(messages, turns, messages[-1].get("content") or "", calls)

    def _request(self, messages: list[dict]) -> dict:
        tools = [t.spec() for t in self.tools.values()] or None
        return {"model": self.model, "messages": messages, "tools": tools, "logprobs": True, **self.sampling}

    async def _turn(self, messages: list[dict]) -> tuple[Turn, dict]:
        resp = await self.client.chat.completions.create(**self._request(messages))
        choice = resp.choices[0]
        logprobs = [c.logprob for c in choice.logprobs.content]
        version = int((resp.model_extra or {}).get("weight_version", 0))
        turn = Turn(resp.prompt_token_ids, choice.token_ids, logprobs, choice.finish_reason, version)
        message = {"role": "assistant", "content": choice.message.content}
        if choice.message.tool_calls:
            message["tool_calls"] = [
                c.model_dump(include={"id", "type", "function"}) for c in choice.message.tool_calls
            ]
        return turn, message

    async def _streamed_turn(self, messages: list[dict]) -> tuple[Turn, dict]:
        stream = await self.client.chat.completions.create(**self._request(messages), stream=True)
        prompt_ids, ids, logprobs, content, calls, reason, version = [], [], [], "", {}, "stop", 0
        async for chunk in stream:
            extra = chunk.model_extra or {}
            prompt_ids = extra.get("prompt_token_ids", prompt_ids)
            version = int(extra.get("weight_version", version))
            for c in chunk.choices:
                ids += c.model_extra["token_ids"]
                logprobs += [x.logprob for x in c.logprobs.content] if c.logprobs else []
                content += c.delta.content or ""
                for delta in c.delta.tool_calls or []:  # OpenAI's stream format: pieces of call `index`
                    call = calls.setdefault(
                        delta.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                    )
                    call["id"] = delta.id or call["id"]
                    call["function"]["name"] += delta.function.name or ""
                    call["function"]["arguments"] += delta.function.arguments or ""
                reason = c.finish_reason or reason
        message = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        return Turn(prompt_ids, ids, logprobs, reason, version), message

    async def _call(self, name: str, arguments: str) -> str:
        """Run one call; what went wrong, if anything, as the policy should read it."""
        tool = self.tools.get(name)
        if tool is None:
            return f"error: there is no tool {name!r}; tools: {sorted(self.tools)}"
        try:
            args = json.loads(arguments)
        except ValueError as exc:
            return f"error: the arguments are not JSON ({exc})"
        if not isinstance(args, dict):
            return "error: the arguments must be a JSON object"
        try:
            result = tool.fn(**args)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:  # the policy's call, not the rollout, went wrong
            return f"error: {type(exc).__name__}: {exc}"
        return str(result)


async def tool_groups(
    runners: list[ChatTurnRunner], task, group_size: int, num_prompts: int, reward: SafeReward | None = None
) -> list[GroupRef]:
    """A rollout function for tool use: ``group_size`` conversations per prompt, rewarded on the final answer.

    Conversations are spread round-robin over ``runners`` (one per engine URL). Each conversation becomes
    one sample (more only if re-tokenisation drift split it, see ``merge_turns``) whose loss mask covers
    exactly the tokens the policy sampled; every sample of a conversation gets its reward.

    Args:
        runners: one ``ChatTurnRunner`` per engine.
        task: data source + reward with ``next_prompt()`` giving ``messages`` and ``entry`` (``ReasoningGymTask``).
        group_size: conversations per prompt (the GRPO group).
        num_prompts: prompts (groups).
        reward: run safely; defaults to ``SafeReward(task.reward)``.

    """
    reward = reward or SafeReward(task.reward)
    prompts = [task.next_prompt() for _ in range(num_prompts)]
    jobs = [
        runners[(i * group_size + j) % len(runners)].run(p["messages"])
        for i, p in enumerate(prompts)
        for j in range(group_size)
    ]
    conversations = await asyncio.gather(*jobs)
    groups = []
    for i, prompt in enumerate(prompts):
        samples = []
        for conv in conversations[i * group_size : (i + 1) * group_size]:
            sequences = merge_turns(conv.turns)
            for seq in sequences:
                metadata = {"tool_calls": conv.num_tool_calls, "sequences": len(sequences)}
                value, loss_mask = apply_reward(reward, conv.final_text, prompt["entry"], seq.loss_mask, metadata)
                samples.append(
                    Sample(
                        prompt_ids=seq.prompt_ids,
                        response_ids=seq.response_ids,
                        rollout_logprobs=seq.logprobs,
                        loss_mask=loss_mask,
                        reward=value,
                        group_id=prompt["uid"],
                        weight_version=min(t.weight_version for t in conv.turns),
                        finish_reason=conv.turns[-1].finish_reason,
                        response_text=conv.final_text,
                        metadata=metadata,
                    )
                )
        version = min(s.weight_version for s in samples)
        groups.append(GroupRef(ray.put(samples), len(samples), version, prompt["uid"]))
    return groups
