import asyncio
import json

import pytest
import torch

from miles_ray.multiturn import ChatTurnRunner, Tool, Turn, merge_turns


def test_merge_turns_by_hand():
    t1 = Turn([1, 2, 3], [4, 5], [-0.1, -0.2])
    t2 = Turn([1, 2, 3, 4, 5, 9, 9], [6], [-0.3])  # extends turn 1: template/tool tokens 9 9 in between
    [seq] = merge_turns([t1, t2])
    assert seq.prompt_ids == [1, 2, 3] and seq.response_ids == [4, 5, 9, 9, 6]
    assert seq.loss_mask == [1, 1, 0, 0, 1] and seq.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    drift = Turn([1, 2, 3, 4, 7, 9], [8], [-0.4])  # turn 1's response came back re-tokenised differently
    first, second = merge_turns([t1, drift])
    assert (first.ids, first.loss_mask) == ([1, 2, 3, 4, 5], [1, 1])
    assert (second.prompt_ids, second.response_ids, second.loss_mask) == ([1, 2, 3, 4, 7, 9], [8], [1])
    with pytest.raises(ValueError, match="turn 0: 2 response tokens but 1 logprobs"):
        merge_turns([Turn([1], [2, 3], [0.0])])


def _few_shot(a: int, b: int, op: str) -> list[dict]:
    """One worked calculator exchange in the standard function-calling form."""
    call = {
        "id": "c0",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": f"{a}{op}{b}"})},
    }
    return [
        {"role": "user", "content": f"What is {a} {op} {b}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0", "content": str(eval(f"{a}{op}{b}"))},
        {"role": "assistant", "content": str(eval(f"{a}{op}{b}"))},
    ]


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path):
    """SmolLM2 behind the engine's HTTP server with the ChatML tool template (its own ignores tools)."""
    from app_server import serve_in_thread

    from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from miles_ray.engines.http_server import EngineServer, HttpServerConfig
    from miles_ray.engines.loop import EngineLoop

    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=smollm2_path, max_batch_size=4, max_seq_len=512))
    config = HttpServerConfig(chat_template="chatml_tools")  # and a random key
    with serve_in_thread(EngineServer(EngineLoop(engine), "policy", config).app) as url:
        yield url, config.api_key.get_secret_value()


def test_a_function_calling_conversation_is_token_exact_streamed_or_not(smollm2_server, smollm2_path):
    """Real SmolLM2, real server, real openai client: the policy calls the calculator through tool_calls (greedy,
    after two worked examples), gets the result as a tool message and answers; the turns merge into one sample
    whose trained tokens are exactly the sampled ones with the engine's logprobs (checked against HF), and the
    streamed conversation is the same conversation."""
    from openai import AsyncOpenAI
    from transformers import AutoModelForCausalLM

    seen = []

    def calculator(expression: str) -> str:
        seen.append(expression)
        return str(eval(expression, {"__builtins__": {}}))

    schema = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
    tool = Tool("calculator", calculator, "Evaluate an arithmetic expression", schema)
    question = [*_few_shot(12, 34, "*"), *_few_shot(305, 17, "+"), {"role": "user", "content": "What is 41 * 19?"}]

    async def converse(stream: bool):
        url, key = smollm2_server
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key=key)
        runner = ChatTurnRunner(
            client, "policy", [tool], max_turns=3, stream=stream, max_tokens=40, temperature=0, stop=["</tool_call>"]
        )
        return await runner.run(question)

    conv = asyncio.run(converse(stream=False))
    assert seen == ["41*19"] and conv.num_tool_calls == 1
    call_turn, tool_message = conv.messages[len(question)], conv.messages[len(question) + 1]
    assert call_turn["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression": "41*19"}'}
    assert tool_message == {"role": "tool", "tool_call_id": call_turn["tool_calls"][0]["id"], "content": "779"}
    assert len(conv.turns) == 2 and conv.turns[0].finish_reason == "tool_calls"
    [seq] = merge_turns(conv.turns)  # the call came back token for token: no re-tokenisation drift
    last = conv.turns[-1]
    assert seq.ids == last.prompt_ids + last.response_ids
    assert [t for t, m in zip(seq.response_ids, seq.loss_mask) if m] == [t for t in conv.turns for t in t.response_ids]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path).eval()
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([seq.ids])).logits[0, len(seq.prompt_ids) - 1 : -1].float()
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq.response_ids)[:, None])[:, 0]
    mask = torch.tensor(seq.loss_mask, dtype=torch.bool)
    assert (torch.tensor(seq.logprobs)[mask] - ref[mask]).abs().max() < 1e-4

    streamed = asyncio.run(converse(stream=True))
    assert [(t.prompt_ids, t.response_ids, t.finish_reason) for t in streamed.turns] == [
        (t.prompt_ids, t.response_ids, t.finish_reason) for t in conv.turns
    ]
    assert [t.logprobs for t in streamed.turns] == [t.logprobs for t in conv.turns]
    strip = [{k: v for k, v in m.items() if k not in ("id", "tool_call_id", "tool_calls")} for m in conv.messages]
    assert [
        {k: v for k, v in m.items() if k not in ("id", "tool_call_id", "tool_calls")} for m in streamed.messages
    ] == strip
    assert streamed.messages[len(question)]["tool_calls"][0]["function"] == call_turn["tool_calls"][0]["function"]


def test_bad_calls_are_answered_as_tool_errors():
    """What the policy gets back when its call is wrong (the rollout never raises on the policy's mistake)."""

    async def add(a: int, b: int) -> int:
        return a + b

    def fails(**_):
        raise RuntimeError("disk full")

    runner = ChatTurnRunner(None, "policy", [Tool("add", add), Tool("fails", fails)])

    async def calls():
        return [
            await runner._call("add", '{"a": 2, "b": 3}'),
            await runner._call("mul", "{}"),
            await runner._call("add", "{a: 2"),
            await runner._call("add", "[2, 3]"),
            await runner._call("add", '{"a": 2}'),
            await runner._call("fails", "{}"),
        ]

    ok, unknown, not_json, not_object, missing, raised = asyncio.run(calls())
    assert ok == "5" and unknown == "error: there is no tool 'mul'; tools: ['add', 'fails']"
    assert (
        not_json.startswith("error: the arguments are not JSON")
        and not_object == "error: the arguments must be a JSON object"
    )
    assert missing.startswith("error: TypeError") and "'b'" in missing and raised == "error: RuntimeError: disk full"
    with pytest.raises(ValueError, match="distinct names"):
        ChatTurnRunner(None, "policy", [Tool("add", add), Tool("add", add)])
