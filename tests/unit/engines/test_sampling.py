import pytest
import torch
from transformers import AutoTokenizer

from miles_ray.engines.requests import SamplingParams
from miles_ray.engines.sampling import STOP_TAIL_TOKENS, hit_stop_string, sample_tokens


def test_sampler_draws_from_the_truncated_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    num = 4000
    logits = probs.clamp(min=1e-30).log().expand(num, 5)
    gens = [torch.Generator().manual_seed(i) for i in range(num)]

    def draw(**kw):
        tokens, lps = sample_tokens(logits, [SamplingParams(**kw)] * num, gens)
        return torch.bincount(tokens, minlength=5).float() / num, tokens, lps

    freq, tokens, lps = draw()
    assert (freq - probs).abs().max() < 3 * (0.25 / num) ** 0.5 and freq[4] == 0
    torch.testing.assert_close(lps, probs.log()[tokens])  # logprob of the full distribution
    freq, _, _ = draw(top_k=2)
    assert freq[2:].sum() == 0 and abs(freq[0] - 2 / 3) < 0.03
    freq, _, _ = draw(top_p=0.7)  # nucleus {0, 1}: the smallest prefix reaching 0.7
    assert freq[2:].sum() == 0 and abs(freq[0] - 2 / 3) < 0.03
    freq, _, _ = draw(temperature=0)
    assert freq[0] == 1


def test_seeded_rows_draw_the_same_tokens_whatever_else_is_in_the_batch():
    logits = torch.randn(6, 50)
    params = [SamplingParams(seed=i, top_k=10 if i % 2 else -1) for i in range(6)]
    alone = [sample_tokens(logits[i : i + 1], [params[i]], [torch.Generator().manual_seed(i)])[0] for i in range(6)]
    batched, _ = sample_tokens(logits, params, [torch.Generator().manual_seed(i) for i in range(6)])
    assert batched.tolist() == torch.cat(alone).tolist()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.mark.parametrize("words", [2, 40])
def test_a_stop_string_is_found_at_the_end_of_the_text_however_many_tokens_it_spans(tokenizer, words):
    """Regression: only the last 16 tokens were decoded, so a stop string of more tokens never stopped a row."""
    stop = " ".join(["wait"] * words) + " done"
    tokens = tokenizer.encode("The answer is 4. " + stop, add_special_tokens=False)
    assert words < 10 or len(tokenizer.encode(stop, add_special_tokens=False)) > STOP_TAIL_TOKENS
    assert hit_stop_string(tokenizer, tokens, ["never", stop])
    assert not hit_stop_string(tokenizer, tokens[:-1], [stop])  # one token short: not yet
    assert not hit_stop_string(tokenizer, tokens, []) and not hit_stop_string(tokenizer, tokens, ["elsewhere"])
