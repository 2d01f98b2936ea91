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


def configure_host(num_threads: int, tune_malloc: bool) -> None:
    """Set this process's torch threads and, with ``tune_malloc``, keep freed memory in its heap for its next tensors.

    glibc serves an allocation over its mmap threshold (32 MB at most) with a fresh mapping and unmaps it on free,
    and returns freed heap memory to the OS, so the large temporaries of every training or decode step
    (activations, logits, gradient buckets) page-fault on first touch every step: a new 100 MB tensor costs ~45 ms
    on a 2-core EPYC against ~5 ms for reused memory. With it on, glibc allocates from its heap and keeps what is
    freed (the resident size stays at the step's peak instead of falling back between steps). Measured there: a
    trainer rank's step on the quick-start workload ~10% faster, the embedded engine's decode ~20%
    (``docs/performance.md``, ``docs/engine.md``). A no-op where the C library is not glibc.
    """
    torch.set_num_threads(num_threads)
    if tune_malloc:
        _glibc_keep_freed_memory()


def _glibc():
    """The C library through ctypes if it is glibc, else None."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _glibc_keep_freed_memory() -> None:
    libc = _glibc()
    if libc is None:
        return
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    # no mmap-served allocations at all, and no trim: mallopt takes an int, which glibc reads as a size_t, so -1
    # is SIZE_MAX. A finite threshold (2**31 - 1, the largest int, was used before) still trims whenever a step
    # frees more than that at the heap's top, and the next step page-faults it all in again
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, -1)


def reserve_heap(gib: float) -> bool:
    """Grow this process's heap by ``gib`` GiB of touched memory, free for its next tensors (glibc, ``tune_malloc``).

    Memory a process touches for the first time is slow to get: on the 2-core EPYC VM a fresh GiB took ~0.75 s
    to write against 0.04 s for a reused one (the page faults and the host behind them), and a trainer's heap grows
    over its first steps (optimizer state, DDP's rebuilt buckets, activations of other lengths), so those steps pay
    it. Touching the memory once at start, then freeing it into a heap that ``configure_host(..., tune_malloc=True)``
    never trims, lets them reuse it. Returns False where the C library is not glibc (nothing done).
    """
    import ctypes

    libc = _glibc()
    if libc is None:
        return False
    libc.malloc.restype = ctypes.c_void_p
    nbytes = int(gib * 2**30)
    block = libc.malloc(ctypes.c_size_t(nbytes))
    if not block:
        raise MemoryError(f"reserve_heap: could not allocate {gib} GiB")
    ctypes.memset(block, 0, nbytes)
    libc.free(ctypes.c_void_p(block))
    return True
