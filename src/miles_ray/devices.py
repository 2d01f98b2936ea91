"""Where a process computes, and in which precision its device computes fast.

``native_bf16`` decides the ``"auto"`` precisions (``TorchBackendConfig.autocast``, ``EmbeddedEngineConfig.dtype``):
bfloat16 where the device computes it natively (CUDA with bf16, CPUs with AVX512-BF16 or AMX), float32 elsewhere.
On a CPU without them bf16 matmuls are emulated, many times slower than fp32 (17x measured on an AVX2-only EPYC).

Usage::

    dtype = torch.bfloat16 if native_bf16(rank_device()) else torch.float32
"""

from __future__ import annotations

import torch


def rank_device() -> torch.device:
    """The device of the calling process: the CUDA device Ray gave the actor, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 matmuls natively (emulated bf16 on a CPU is many times slower than fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    caps = torch.cpu.get_capabilities()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
