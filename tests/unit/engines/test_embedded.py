import pytest
import torch

from miles_ray.engines.base import GenerateRequest, SamplingParams
from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return EmbeddedEngine(EmbeddedEngineConfig(model_path=tiny_model_path, max_batch_size=16, max_seq_len=128))


PROMPT = [1, 50, 60, 70, 80]


def test_n_samples_lengths_and_logprobs(engine):
    [out] = engine.generate([GenerateRequest(PROMPT, SamplingParams(n=4, max_new_tokens=12, ignore_eos=True, seed=1))])
    assert len(out.completions) == 4
    for c in out.completions:
        assert len(c.token_ids) == len(c.logprobs) == 12 and c.finish_reason == "length"
        assert all(lp <= 0 for lp in c.logprobs)
    assert len({tuple(c.token_ids) for c in out.completions}) > 1  # the group's samples differ


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    params = SamplingParams(n=2, max_new_tokens=10, seed=7, ignore_eos=True)
    [alone] = engine.generate([GenerateRequest(PROMPT, params)])
    batched = engine.generate(
        [GenerateRequest([1, 2, 3], SamplingParams(n=3, max_new_tokens=5)), GenerateRequest(PROMPT, params)]
    )
    assert [c.token_ids for c in alone.completions] == [c.token_ids for c in batched[1].completions]
    for a, b in zip(alone.completions, batched[1].completions):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4  # padding does not change numerics


def test_greedy_equals_hf_greedy(engine, tiny_model_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    [out] = engine.generate([GenerateRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))])
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.completions[0].token_ids == ref[0, len(PROMPT) :].tolist()


def test_top_k_1_is_greedy(engine):
    greedy = engine.generate(
        [GenerateRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))]
    )
    topk = engine.generate([GenerateRequest(PROMPT, SamplingParams(top_k=1, max_new_tokens=6, ignore_eos=True))])
    assert greedy[0].completions[0].token_ids == topk[0].completions[0].token_ids


def test_stop_token_ends_response(engine):
    [free] = engine.generate(
        [GenerateRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))]
    )
    stop_at = free.completions[0].token_ids[2]
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, stop_token_ids=[stop_at])
    [out] = engine.generate([GenerateRequest(PROMPT, params)])
    c = out.completions[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] == stop_at
    assert c.token_ids == free.completions[0].token_ids[: free.completions[0].token_ids.index(stop_at) + 1]


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        (GenerateRequest([], SamplingParams()), "prompt_ids must not be empty"),
        (GenerateRequest([10**7], SamplingParams()), "prompt_ids must be in"),
        (GenerateRequest([1], SamplingParams(n=17)), "exceeds max_batch_size"),
        (GenerateRequest([1] * 100, SamplingParams(max_new_tokens=64)), "exceeds max_seq_len"),
    ],
)
def test_invalid_requests(engine, request_, match):
    with pytest.raises(ValueError, match=match):
        engine.generate([request_])


def test_update_weights_validates_and_changes_output(engine):
    name = "model.norm.weight"
    with pytest.raises(ValueError, match="unknown parameter"):
        engine.update_weights([("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights([(name, torch.zeros(3))])
    before = engine.weights_checksum()
    old = dict(engine.model.named_parameters())[name].clone()
    engine.update_weights([(name, old * 2)])
    assert engine.weights_checksum() != before
    engine.update_weights([(name, old)])
    assert engine.weights_checksum() == before
