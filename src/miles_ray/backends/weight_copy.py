"""A bf16 copy of the trained weights, written once per optimizer step, that linear layers and a sync read.

Under bf16 autocast every linear layer casts its fp32 weight to bf16 in every forward (a pass over all the weights
per micro-batch and per logprob forward), and a weight sync to bf16 engines casts them all once more. Megatron's
mixed-precision training keeps bf16 model weights beside the optimizer's fp32 main weights for the same reason.
``WeightCopy`` keeps one bf16 copy of the weights, written in one pass when they lie in one buffer
(``flat_params``): by the trainer after each optimizer step (torch's fused AdamW writes the weights without
counting the write), and before a use whenever the weights' version counters show another in-place write (a
checkpoint load). Inside ``linear_weights()`` the plain ``nn.Linear`` layers read the copy: autocast
finds their weights already bf16 and casts nothing. The copy holds the values autocast's cast would make
(``Tensor.to`` rounds the same way) and the gradient goes back to the fp32 weight cast to fp32, as the cast's own
backward does, so losses and gradients equal plain autocast exactly (``tests/unit/backends/test_weight_copy.py``).
A sync to bf16 engines sends the copy as it lies (``bucket_view``) or copies from it, instead of casting.

Only modules of exactly ``nn.Linear`` read the copy: subclasses (peft's LoRA layers, fake-quant layers) and
everything else (embeddings, norms) compute as they did, and so does a recomputation under gradient checkpointing
(it runs after the block; autocast casts there as before, to the same values). The copy costs 2 bytes per weight;
autocast's own casts held as much for every forward until its backward.

Usage::

    copy = WeightCopy(module, torch.bfloat16)      # after flatten_parameters, before any forward
    with torch.autocast("cpu", dtype=torch.bfloat16), copy.linear_weights():
        loss = module(...).loss                    # backward may run after the block
    copy.tensors()                                 # {name: bf16 tensor} for a sync, up to date
"""

from __future__ import annotations

import contextlib

import torch

from miles_ray.backends.flat_params import flat_base


class _ReadCopy(torch.autograd.Function):
    """Forward: the weight's copy. Backward: the gradient to the weight in the weight's dtype (autocast's cast)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


class WeightCopy:
    """A ``dtype`` copy of ``module``'s floating-point parameters (tied ones once), refreshed when they change."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype
        named = [(n, p) for n, p in module.named_parameters() if p.is_floating_point() and p.dtype != dtype]
        self.params = [p for _, p in named]
        self.names = [n for n, _ in named]
        base = flat_base(self.params)
        if base is not None:  # one buffer, one pass: the copies are views at the weights' own offsets
            self._flat = (base, torch.empty(base.numel(), dtype=dtype, device=base.device))
            start = base.storage_offset()
            self.copies = [self._flat[1][p.storage_offset() - start :][: p.numel()].view(p.shape) for p in self.params]
        else:
            self._flat = None
            self.copies = [torch.empty(p.shape, dtype=dtype, device=p.device) for p in self.params]
        of = {id(p): c for p, c in zip(self.params, self.copies)}
        self._slots: dict[torch.nn.Module, list[tuple[str, torch.nn.Parameter, torch.Tensor]]] = {}
        for m in module.modules():
            if type(m) is torch.nn.Linear:
                for key in ("weight", "bias"):
                    p = m._parameters.get(key)
                    if p is not None and id(p) in of:
                        self._slots.setdefault(m, []).append((key, p, of[id(p)]))
        self._versions: list[int] | None = None

    def invalidate(self) -> None:
        """Rewrite the copy before its next use (for writes the version counters miss, e.g. through ``.data``)."""
        self._versions = None

    @torch.no_grad()
    def refresh(self, force: bool = False) -> None:
        """Write the copy from the weights (one pass over one buffer): if ``force``, or they changed since.

        A weight's version counter counts in-place writes through autograd-visible ops (``copy_``, a load);
        torch's fused AdamW does not count, so an optimizer calls this with ``force`` after its step.
        """
        versions = [p._version for p in self.params]
        if versions == self._versions and not force:
            return
        if self._flat is not None:
            self._flat[1].copy_(self._flat[0])
        else:
            for p, c in zip(self.params, self.copies):
                c.copy_(p)
        self._versions = versions

    def tensors(self) -> dict[str, torch.Tensor]:
        """The up-to-date copy by parameter name (views of its buffer: valid until the weights next change)."""
        self.refresh()
        return dict(zip(self.names, self.copies))

    @contextlib.contextmanager
    def linear_weights(self):
        """Inside: the ``nn.Linear`` layers compute with the copy; gradients reach the weights (in their dtype).

        Each layer reads its copy when it is called, not when the block opens: the autograd engine runs ready
        nodes newest first, so a read node made at the block's start would run last in the backward, holding every
        weight's gradient back to the end (DDP could reduce no bucket while the backward computes).
        """
        self.refresh()
        handles = []
        try:
            for m, slots in self._slots.items():
                handles.append(m.register_forward_pre_hook(lambda module, args, slots=slots: _read(module, slots)))
                handles.append(m.register_forward_hook(lambda module, args, out, slots=slots: _put_back(module, slots)))
            yield
        finally:
            for h in handles:
                h.remove()
            for m, slots in self._slots.items():  # also where a forward raised before its post-hook
                _put_back(m, slots)


def _read(module: torch.nn.Module, slots: list[tuple[str, torch.nn.Parameter, torch.Tensor]]) -> None:
    """The module's weights read from their copies (through ``_ReadCopy`` where a gradient is wanted)."""
    grad = torch.is_grad_enabled()
    for key, p, c in slots:
        module._parameters[key] = _ReadCopy.apply(p, c) if grad and p.requires_grad else c


def _put_back(module: torch.nn.Module, slots: list[tuple[str, torch.nn.Parameter, torch.Tensor]]) -> None:
    """The module's own parameters back in place of the reads."""
    for key, p, _ in slots:
        module._parameters[key] = p


__all__ = ["WeightCopy"]
