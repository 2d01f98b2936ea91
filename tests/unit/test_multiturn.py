import asyncio

import pytest
import torch

from miles_ray.multiturn import ChatTurnRunner, Turn, merge_turns


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


def test_tool_conversation_over_the_chat_api_is_token_exact(server, teacher_forced):
    """Real server, real openai client: trained tokens are exactly the sampled ones, with exact logprobs."""
    from openai import AsyncOpenAI

    calls = []

    def tool(text):  # answers the first two turns whatever the (random) policy wrote
        calls.append(text)
        return f"RESULT {len(calls)}" if len(calls) <= 2 else None

    async def run():
        client = AsyncOpenAI(base_url=f"{server}/v1", api_key="test-key")
        runner = ChatTurnRunner(client, "tiny", tool, max_turns=4, max_tokens=8, seed=3)
        return await runner.run([{"role": "user", "content": "What is 17 * 23?"}])

    conv = asyncio.run(run())
    assert len(conv.turns) == 3 and conv.num_tool_calls == 2
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    sequences = merge_turns(conv.turns)
    sampled = [tok for t in conv.turns for tok in t.response_ids]
    trained = [tok for s in sequences for tok, m in zip(s.response_ids, s.loss_mask) if m]
    assert trained == sampled  # every sampled token is trained on, and nothing else
    last = conv.turns[-1]
    if len(sequences) == 1:  # no drift: one sequence, exactly what the engine saw in the last turn
        assert sequences[0].ids == last.prompt_ids + last.response_ids
    for seq in sequences:
        ref = teacher_forced(seq.prompt_ids, seq.response_ids)
        mask = torch.tensor(seq.loss_mask, dtype=torch.bool)
        assert (torch.tensor(seq.logprobs)[mask] - ref[mask]).abs().max() < 1e-5
