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

A shared-memory sync hands engines the copy itself (``publish``): from then on the copy lives in three shared
buffers, and each write goes to one that no engine may still compute on, so the sync copies nothing.

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
from collections.abc import Callable

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
            self.copies = self._views(self._flat[1])
        else:
            self._flat = None
            self.copies = [torch.empty(p.shape, dtype=dtype, device=p.device) for p in self.params]
        index = {id(p): i for i, p in enumerate(self.params)}
        self._slots: dict[torch.nn.Module, list[tuple[str, torch.nn.Parameter, int]]] = {}  # (key, weight, copy index)
        for m in module.modules():
            if type(m) is torch.nn.Linear:
                for key in ("weight", "bias"):
                    p = m._parameters.get(key)
                    if p is not None and id(p) in index:
                        self._slots.setdefault(m, []).append((key, p, index[id(p)]))
        self._versions: list[int] | None = None
        self._sets: list[torch.Tensor] = []  # published: the three buffers the copy moves between (``publish``)
        self._current = 0  # the set the copy is in
        self._published: list[int] = []  # the sets of the last two publications: engines may compute on them

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each weight's copy in ``flat`` (one buffer of the copies), at the weight's own offset."""
        start = self._flat[0].storage_offset()
        return [flat[p.storage_offset() - start :][: p.numel()].view(p.shape) for p in self.params]

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
        if self._current in self._published:  # engines may compute on it: write the free set
            self._move(next(i for i in range(len(self._sets)) if i not in self._published))
        if self._flat is not None:
            self._flat[1].copy_(self._flat[0])
        else:
            for p, c in zip(self.params, self.copies):
                c.copy_(p)
        self._versions = versions

    def publish(self, make_buffer: Callable[[int], torch.Tensor]) -> bool:
        """Keep the copy as it is now unwritten until this is called twice more (engines compute on it meanwhile).

        The first call moves the copy into three buffers from ``make_buffer(nbytes)`` (``uint8``; shared memory, which
        engines on the node map). A later write goes to the set published neither last (engines compute on it) nor
        the time before (engines may view it until that sync has ended, which it has when this is called again: a
        sync begins after the one before it ended). False where the copy is not one buffer on CPU.
        """
        if self._flat is None or self._flat[1].device.type != "cpu":
            return False
        self.refresh()
        if not self._sets:
            nbytes = self._flat[1].numel() * self._flat[1].element_size()
            self._sets = [make_buffer(nbytes).view(self.dtype) for _ in range(3)]
            self._sets[0].copy_(self._flat[1])
            self._move(0)
        self._published = [*self._published[-1:], self._current]
        return True

    def _move(self, index: int) -> None:
        """The copy lives in set ``index`` from now on (its values are written there next)."""
        self._current, self._flat = index, (self._flat[0], self._sets[index])
        self.copies = self._views(self._sets[index])

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
        copies, handles = self.copies, []  # no write inside the block: the optimizer steps outside it
        try:
            for m, slots in self._slots.items():
                read = lambda module, args, slots=slots: _read(module, slots, copies)  # noqa: E731
                handles.append(m.register_forward_pre_hook(read))
                handles.append(m.register_forward_hook(lambda module, args, out, slots=slots: _put_back(module, slots)))
            yield
        finally:
            for h in handles:
                h.remove()
            for m, slots in self._slots.items():  # also where a forward raised before its post-hook
                _put_back(m, slots)


def _read(module: torch.nn.Module, slots: list[tuple[str, torch.nn.Parameter, int]], copies: list[torch.Tensor]):
    """The module's weights read from their copies (through ``_ReadCopy`` where a gradient is wanted)."""
    grad = torch.is_grad_enabled()
    for key, p, i in slots:
        module._parameters[key] = _ReadCopy.apply(p, copies[i]) if grad and p.requires_grad else copies[i]


def _put_back(module: torch.nn.Module, slots: list[tuple[str, torch.nn.Parameter, int]]) -> None:
    """The module's own parameters back in place of the reads."""
    for key, p, _ in slots:
        module._parameters[key] = p


__all__ = ["WeightCopy"]
