"""Token logprobs and entropies from LM-head logits, in row chunks, with the gradient written by hand.

The obvious expression, ``log_softmax(logits.float() / T)`` then ``-(p * logp).sum(-1)``, materialises five or
six ``[N, V]`` fp32 tensors forward and as many backward: with a 49k vocabulary that is ~100 MB each for 500
tokens, every one freshly allocated (page faults) and streamed through memory. On a small model it cost ~1 s
of a ~7 s CPU train step (torch profiler, 2-core EPYC). Here each chunk of rows is cast, normalised, reduced and
dropped while it is in cache; backward recomputes a chunk's softmax from the saved logits and its log-sum-exp
and writes the gradient straight into one ``[N, V]`` buffer in the logits' dtype:

    logp = z - lse,   p = exp(logp),   H = -sum_v p logp          (z = logits / T)
    d logp[target] / dz = onehot(target) - p
    d H / dz            = -p * (logp + H)

The result equals the obvious expression up to float summation order (``tests/unit/backends/test_logprobs.py``
checks values and gradients in fp32 and from bf16 logits).

Usage::

    lp, entropy = token_logprobs(logits, targets, temperature)   # logits [..., V], targets [...]
"""

from __future__ import annotations

import torch

# rows per chunk: ~1M fp32 elements (4 MB) on a CPU, where cache reuse is the point; on a GPU one launch per
# ~64M elements keeps the kernel count small while still bounding the temporaries
_CHUNK_ELEMENTS = {"cpu": 1 << 20}
_DEFAULT_CHUNK_ELEMENTS = 1 << 26


def _chunk_rows(logits: torch.Tensor) -> int:
    elements = _CHUNK_ELEMENTS.get(logits.device.type, _DEFAULT_CHUNK_ELEMENTS)
    return max(1, elements // logits.shape[-1])


def _logp(logits: torch.Tensor, lse: torch.Tensor | None, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_softmax(logits / T), lse)`` of a ``[n, V]`` chunk in fp32; ``lse`` is computed when None."""
    z = logits.float()  # a copy for bf16 logits; for fp32 ones, a fresh tensor is needed before the in-place ops
    if z.data_ptr() == logits.data_ptr():
        z = z.clone()
    if temperature != 1.0:
        z.div_(temperature)
    if lse is None:
        lse = torch.logsumexp(z, dim=-1)
    return z.sub_(lse[:, None]), lse


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float):
        n, rows = logits.shape[0], _chunk_rows(logits)
        lp = logits.new_empty(n, dtype=torch.float32)
        entropy, lse = torch.empty_like(lp), torch.empty_like(lp)
        for s in range(0, n, rows):
            logp, lse[s : s + rows] = _logp(logits[s : s + rows], None, temperature)
            entropy[s : s + rows] = -torch.linalg.vecdot(logp.exp(), logp)
            lp[s : s + rows] = logp.gather(-1, targets[s : s + rows, None])[:, 0]
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)  # an output the loss does not use (often the entropy) costs nothing
        return lp, entropy

    @staticmethod
    def backward(ctx, grad_lp: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, targets, lse, entropy = ctx.saved_tensors
        t, rows = ctx.temperature, _chunk_rows(logits)
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], rows):
            g = _logp(logits[s : s + rows], lse[s : s + rows], t)[0]  # logp, overwritten into the gradient
            p = g.exp()
            if grad_entropy is None:
                g = p.mul_(-1.0)
            else:  # -p * (g_lp + g_H * (logp + H))
                g.add_(entropy[s : s + rows, None]).mul_(grad_entropy[s : s + rows, None])
                if grad_lp is not None:
                    g.add_(grad_lp[s : s + rows, None])
                g.mul_(p).neg_()
            if grad_lp is not None:
                if grad_entropy is None:
                    g.mul_(grad_lp[s : s + rows, None])
                g.scatter_add_(-1, targets[s : s + rows, None], grad_lp[s : s + rows, None])
            elif grad_entropy is None:
                g.zero_()
            if t != 1.0:
                g.div_(t)
            grad[s : s + rows] = g
        return grad, None, None


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token and the entropy of each position's distribution (differentiable).

    Args:
        logits: ``[..., V]``, any float dtype (bf16 from an autocast LM head is read as is; math in fp32).
        targets: ``[...]`` token ids.
        temperature: logits are divided by it.

    Returns:
        ``(logprobs [...], entropy [...])`` in fp32.

    """
    shape = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    lp, entropy = _TokenLogprobs.apply(flat, targets.reshape(-1), float(temperature))
    return lp.view(shape), entropy.view(shape)
