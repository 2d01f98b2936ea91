"""Run megatron-core on CPU: map the few ``torch.cuda`` calls it makes outside kernels onto the CPU.

megatron-core assumes CUDA for its RNG tracker (``tensor_parallel.random``), for the device it moves rotary
tables and buffers to (``torch.cuda.current_device()``), for ``torch.cuda.synchronize()`` and for the stream
its gradient reduction waits on (``torch.cuda.current_stream()``). With gloo and
its pure-PyTorch ("local") layer spec everything else runs on CPU. ``apply()`` patches exactly these, and only
when CUDA is absent: on a GPU machine it returns False and touches nothing.

What changes on CPU: the tracker's per-TP-rank RNG states are CPU generator states (dropout and init on
CPU draw from them), ``current_device()`` is the CPU device, ``synchronize()`` does nothing.

Megatron's optimizer, grad-norm and checkpoint code also create small tensors with a literal ``device="cuda"``
(loss scale, found-inf flags, norms) and check ``tensor.type()`` against CUDA type names. ``cpu_devices()`` is
a context (a ``TorchFunctionMode``) that places those on the CPU; the backend enters it only around optimizer
construction, step and checkpoint calls, so the model's forward/backward pay nothing for it. On a GPU machine
it is a no-op context.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False


class _NoStream:
    """What ``torch.cuda.current_stream()`` returns on CPU: waiting on it waits for nothing."""

    def wait_event(self, event) -> None:
        """No-op."""

    def wait_stream(self, stream) -> None:
        """No-op."""

    def synchronize(self) -> None:
        """No-op."""


_NO_STREAM = _NoStream()


def apply() -> bool:
    """Patch ``torch.cuda`` / megatron's RNG helpers for CPU if CUDA is absent; True if patched (idempotent)."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    torch.cuda.get_rng_state = get_state
    torch.cuda.random.get_rng_state = get_state
    torch.cuda.set_rng_state = set_state
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_stream = lambda device=None: _NO_STREAM  # grad sync waits on it (CUDA-graph events only)
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    _APPLIED = True
    return True


def _is_cuda(device) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cuda"
    return False


class _CPUDevices(TorchFunctionMode):
    """Rewrite ``device="cuda"`` / ``.cuda()`` / ``.to("cuda")`` to the CPU; ``t.type()`` names CUDA types.

    Megatron's optimizer picks its fp32/fp16 paths and asserts on ``param.type() == 'torch.cuda.FloatTensor'``.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def cpu_devices():
    """Context placing megatron's literal CUDA tensors on the CPU (after ``apply()``; no-op with CUDA)."""
    return _CPUDevices() if _APPLIED else contextlib.nullcontext()
