"""Drawing the next token of each running sequence, and stop strings: the embedded engine's sampler.

Each row samples from its own ``torch.Generator`` (a seeded request draws the same tokens whatever else is in the
batch) with its own ``SamplingParams`` (temperature, top-k, top-p; temperature 0 is greedy), and returns the
logprob of the token drawn under the whole vocabulary's distribution at that temperature (1 for greedy rows), not
the top-k/top-p truncated one.

Usage::

    tokens, logprobs = sample_tokens(logits, [SamplingParams(top_p=0.9)] * len(gens), gens)
    hit = stop_string_hit(tokenizer, row_tokens, ["</answer>"])  # "</answer>" once generated, else None
    text = cut_at_stop(tokenizer.decode(row_tokens, skip_special_tokens=True), hit)
"""

from __future__ import annotations

import torch

from miles_ray.engines.requests import SamplingParams

STOP_TAIL_TOKENS = 16  # the fewest tokens decoded to look for a stop string


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator], exact_logprobs: bool = False
):
    """Draw one token per row. ``logits``: ``[R, V]`` fp32. Returns ``(tokens [R], logprobs [R])``.

    Sampling is by inverse CDF with one uniform per row from the row's own generator (so a seeded
    request is reproducible whatever else is in the batch); ``torch.multinomial`` costs ~1 ms per row on
    a 49k vocabulary here, the batched cumsum + searchsorted a fraction of that.
    """
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    if any(t != 1.0 for t in temps):  # vocab-wide ops dominate sampling: skip the ones that do nothing
        logits = logits / torch.tensor(temps, device=logits.device)[:, None]
    logprobs_all = torch.log_softmax(logits, dim=-1)
    tokens = logprobs_all.argmax(-1)  # greedy rows keep this
    # the rows' generators live on the CPU whatever the device: a seed draws the same uniforms on CPU and GPU
    u = torch.stack([torch.rand((), generator=g) for g in gens]).to(logits.device)
    plain = [i for i, p in enumerate(params) if p.temperature > 0 and p.top_k == -1 and p.top_p == 1.0]
    if plain:
        rows = logprobs_all if len(plain) == len(params) else logprobs_all[plain]
        cdf = rows.exp().cumsum_(-1)
        pick = torch.searchsorted(cdf, (u[plain] * cdf[:, -1])[:, None], right=True)[:, 0]
        tokens[plain] = pick.clamp(max=cdf.shape[1] - 1)
    skip = set(plain)
    for i, p in enumerate(params):
        if p.temperature == 0 or i in skip:
            continue
        lp = logprobs_all[i]
        k = p.top_k if p.top_k > 0 else lp.numel()
        vals, idx = torch.topk(lp, min(k, lp.numel()))
        cum = torch.cumsum(vals.exp(), dim=0)
        if p.top_p < 1.0:
            keep = int((cum < p.top_p * cum[-1]).sum()) + 1  # smallest prefix whose mass reaches top_p
            cum = cum[:keep]
        choice = int(torch.searchsorted(cum, u[i] * cum[-1], right=True).clamp(max=cum.numel() - 1))
        tokens[i] = idx[choice]
    if not exact_logprobs:
        return tokens, logprobs_all.gather(1, tokens[:, None])[:, 0]
    # the returned logprob from an fp64 log-sum-exp: over a 49k vocabulary the fp32 one adds up to ~1e-5
    wide = logits.double()
    return tokens, (wide.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(wide, dim=-1)).float()


def stop_string_hit(tokenizer, tokens: list[int], stop: list[str]) -> str | None:
    """The first of ``stop`` (in list order, as vLLM) that has appeared in the text of ``tokens``, else None.

    Called after each token, so a stop string can only be at the text's end: only the tail is decoded, enough
    tokens to hold the longest stop string. A token decodes to at least one character, or to one of the up to 4
    bytes of one (byte-level BPE), so ``4 * len(s)`` tokens hold ``s``; one more keeps ``s`` off the tail's first
    token, whose leading space a SentencePiece tokenizer drops.
    """
    if not stop:
        return None
    tail = tokenizer.decode(tokens[-stop_tail_length(stop) :], skip_special_tokens=False)
    return next((s for s in stop if s in tail), None)


def stop_tail_length(stop: list[str]) -> int:
    """How many of the last tokens ``stop_string_hit`` decodes for these stop strings."""
    return max(STOP_TAIL_TOKENS, 4 * max(map(len, stop), default=0) + 1)


def cut_at_stop(text: str, stop_reason: str | int | None, keep: bool = True) -> str:
    """``text`` up to the stop string that ended it (``stop_reason``), with it (``keep``) or without it.

    A ``stop_reason`` that is no stop string (a stop token id, None) leaves ``text`` whole. Every engine's response
    text keeps the stop string, as its tokens do (the trainer trains on them), and nothing decoded after it: vLLM's
    ``include_stop_str_in_output`` and SGLang's ``no_stop_trim`` give the same text. The OpenAI routes cut it out
    unless asked to keep it, as OpenAI and vLLM do.
    """
    at = text.find(stop_reason) if isinstance(stop_reason, str) else -1
    return text if at < 0 else text[: at + len(stop_reason) if keep else at]
