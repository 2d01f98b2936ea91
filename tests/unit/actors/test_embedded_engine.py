"""The embedded engine actor in-process (no Ray): how it continues a completion that a weight load aborted."""

import asyncio

from miles_ray.actors.embedded_engine import EmbeddedEngineActor
from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.engines.requests import Completion, GenerateOutput, GenerateRequest, SamplingParams


def test_a_continued_completion_ends_at_a_stop_string_across_its_abort(tiny_model_path, greedy_and_a_piece):
    """Fault injected: the first tokens of a real greedy response, cut inside a stop string, stand for a completion
    that an ``abort_resume`` weight load aborted (a real abort cannot be placed on a given token). Its continuation
    ends where the uninterrupted request ends, with the same tokens, text (cut right after the stop string, inside a
    token) and stop reason."""
    config = EmbeddedEngineConfig(model_path=tiny_model_path, max_batch_size=4, max_seq_len=128)
    prompt, first, i, piece = greedy_and_a_piece(EmbeddedEngine(config), 3)
    stop = piece[:-1]  # ends inside the piece's last token: the text is cut within a token
    assert first.text.count(stop) == 1 and len(stop.strip()) >= 2, (first.text, stop)
    actor = EmbeddedEngineActor(0, config)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop=[stop])
    request = GenerateRequest(prompt, params, request_id="r")
    aborted = Completion(first.token_ids[: i + 1], first.logprobs[: i + 1], "abort", "")

    async def both():
        whole = await actor.loop.generate(request)
        return whole, await actor._continue(request, GenerateOutput("r", [aborted], weight_version=0))

    whole, continued = asyncio.run(both())
    [w], [c] = whole.completions, continued.completions
    assert (c.finish_reason, c.stop_reason) == (w.finish_reason, w.stop_reason) == ("stop", stop)
    assert c.token_ids == w.token_ids and c.text == w.text == first.text[: first.text.index(stop) + len(stop)]
