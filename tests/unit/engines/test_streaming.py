import asyncio
import random

import pytest

from miles_ray.engines.streaming import IncrementalDetokenizer, merged, rest_of, sendable


def test_deltas_join_into_the_full_decode(tiny_model_path):
    """Random token sequences (byte-level pieces of multi-byte characters included): the streamed deltas plus the
    final rest are exactly the one-shot decode, and no delta ends in a partial character."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    rng = random.Random(0)
    vocab = len(tok)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        detok, sent = IncrementalDetokenizer(tok), ""
        for t in ids:
            delta = detok.push(t)
            assert not delta.endswith("\ufffd") or not delta
            sent += delta
        full = tok.decode(ids, skip_special_tokens=True)
        assert sent + rest_of(full, sent) == full, ids


@pytest.mark.parametrize(
    ("text", "keep", "sent"),
    [
        ("say </ans", False, "say "),  # may be a stop string's start: held back
        ("say </ans", True, "say </ans"),  # kept stop strings need no hold-back: a partial one is text either way
        ("say </answer> more", False, "say "),  # cut before it
        ("say </answer> more", True, "say </answer>"),  # through it, never what its last token decodes after it
        ("say ST", False, "say "),  # the start of the other mark
        ("say x", False, "say x"),
        ("a STOP b </answer>", False, "a "),  # the first mark in the text wins
    ],
)
def test_a_stream_sends_no_text_past_a_stop_string_it_may_cut(text, keep, sent):
    assert sendable(text, ["</answer>", "STOP"], keep) == sent
    assert sendable(text, [], keep) == text  # no marks: everything


def test_merged_interleaves_and_closing_it_closes_every_stream():
    closed = []

    async def stream(name, n, delay):
        try:
            for i in range(n):
                await asyncio.sleep(delay)
                yield f"{name}{i}"
        finally:
            closed.append(name)

    async def run():
        items = [x async for x in merged([stream("a", 3, 0.001), stream("b", 2, 0.0015)])]
        gen = merged([stream("c", 100, 0.001), stream("d", 100, 0.001)])
        first = await anext(gen)
        await gen.aclose()  # a client that left: both streams are closed (their requests aborted)
        return items, first

    items, first = asyncio.run(run())
    assert sorted(items) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    assert first[1] in ("c0", "d0") and sorted(closed) == ["a", "b", "c", "d"]


def test_an_error_in_one_stream_ends_the_merge():
    async def ok():
        await asyncio.sleep(10)
        yield 1

    async def bad():
        raise ValueError("engine said no")
        yield  # an async generator

    async def run():
        return [x async for x in merged([ok(), bad()])]

    with pytest.raises(ValueError, match="engine said no"):
        asyncio.run(asyncio.wait_for(run(), 5))
