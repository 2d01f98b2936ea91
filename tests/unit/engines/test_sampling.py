import pytest
import torch
from transformers import AutoTokenizer

from miles_ray.engines.requests import SamplingParams
from miles_ray.engines.sampling import STOP_TAIL_TOKENS, cut_at_stop, sample_tokens, stop_string_hit


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
    assert stop_string_hit(tokenizer, tokens, ["never", stop]) == stop
    assert stop_string_hit(tokenizer, tokens[:-1], [stop]) is None  # one token short: not yet
    assert stop_string_hit(tokenizer, tokens, []) is None and stop_string_hit(tokenizer, tokens, ["elsewhere"]) is None


def test_the_first_stop_string_listed_is_the_one_that_ended_a_response(tokenizer):
    """Two stop strings completed by the same token: the first listed ends the response, as vLLM decides."""
    tokens = tokenizer.encode("The answer is 42.", add_special_tokens=False)
    assert (
        stop_string_hit(tokenizer, tokens, ["42.", "2."]) == "42."
        and stop_string_hit(tokenizer, tokens, ["2.", "42."]) == "2."
    )


@pytest.mark.parametrize(
    ("stop_reason", "keep", "text"),
    [
        ("</a>", True, "x </a>"),
        ("</a>", False, "x "),
        (7, True, "x </a> y"),
        (None, False, "x </a> y"),
        ("z", False, "x </a> y"),
    ],
)
def test_a_text_is_cut_at_the_stop_string_that_ended_it(stop_reason, keep, text):
    """Only a stop string cuts (a stop token id or None leave the text whole), with or without the string."""
    assert cut_at_stop("x </a> y", stop_reason, keep) == text
