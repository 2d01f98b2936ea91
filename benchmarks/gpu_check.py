"""GPU check (#20): the CUDA paths of the engine, the trainer backends and colocated sync, one table, no Ray.

Runs in one process (plus one engine process for the colocated sync) under the GPU machine's own ``python3``:
nothing here imports Ray, SGLang or vLLM, and the packages that machine lacks travel as wheels
(``benchmarks/gpu_wheels.sh``). Models are random, made on the machine through transformers with SmolLM2's
tokenizer (carried as files: SmolLM2's weights are too large to carry). Every row is measured side by side with its
reference in the same run:

- ``engine decode``: the embedded engine's tokens/s at each batch size vs HF ``generate`` (same model, dtype, batch
  and tokens, sampling on, EOS ignored); ``engine MoE decode`` likewise for a Mixtral;
- ``engine vs trainer logprobs``: max |engine - trainer| over sampled tokens, fp32 (engine fp32, trainer fp32) and
  bf16 (engine bf16, trainer bf16 autocast); the reference column is the fp32 figure;
- ``grpo step``: one GRPO step on the torch backend (DDP, a one-rank NCCL group on CUDA), bf16 autocast, padded
  vs packed vs shared-prefix packing: seconds and peak memory; reference: the padded step;
- ``colocated sync``: the project's colocated transport between two processes on one device (trainer gathers into
  shared-memory buckets, the engine process loads them), GB/s vs a device-to-device copy of the same bytes; and
  the same bytes as CUDA IPC handles (``torch.multiprocessing``), which that transport does not use yet;
- ``verified sync``: after a GRPO step, the engine process's weight digest equals the trainer's, and the engine's
  logprobs of what it generates on the new weights match the trainer's;
- ``megatron step``: the Megatron backend at TP=1, one GRPO step: its grad norm vs the torch backend's on the same
  batch; ``megatron MoE step`` likewise for the Mixtral (megatron-core's MoE layers, EP=1) on a batch it sampled.

``--device cpu`` runs every row's code on the CPU with a tiny model in seconds (CI runs it so the script cannot rot
between GPU runs); its figures are no GPU figures.

    python -m benchmarks.gpu_check --device cuda --tokenizer .gpu/tokenizer      # on the GPU machine
    python -m benchmarks.gpu_check --device cpu                                  # here
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import emit


@dataclass(frozen=True)
class Setup:
    """What one run of the check uses (``--device`` picks the sizes)."""

    device: torch.device
    model: str  # the dense Llama every row uses
    moe_model: str | None
    batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    group: tuple[int, int]  # GRPO: prompts x samples each

    @property
    def cuda(self) -> bool:
        """Whether the run is on a CUDA device."""
        return self.device.type == "cuda"


def _models(device: str, tokenizer: str | None) -> tuple[str, str]:
    from miles_ray.models.hub import tiny_llama_dir, tiny_moe_dir

    if device == "cpu":
        return str(tiny_llama_dir(tokenizer=tokenizer)), str(tiny_moe_dir(tokenizer=tokenizer))
    # ~0.4B parameters with SmolLM2's 49k vocabulary (Qwen2.5-0.5B's shape, narrower vocabulary)
    dense = tiny_llama_dir(24, 1024, 16, 4, intermediate_size=4096, tokenizer=tokenizer)
    return str(dense), str(tiny_moe_dir(4, 512, 8, 2, 8, 4, tokenizer=tokenizer))


def _sync(setup: Setup) -> None:
    if setup.cuda:
        torch.cuda.synchronize()


def _timed(setup: Setup, fn):
    _sync(setup)
    start = time.perf_counter()
    out = fn()
    _sync(setup)
    return out, time.perf_counter() - start


def _prompts(count: int, length: int, offset: int = 0) -> list[list[int]]:
    return [[1] + [100 + (7 * (i + offset) + j) % 5000 for j in range(length - 1)] for i in range(count)]


def _engine(setup: Setup, model: str, dtype: str, batch: int):
    from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig

    config = EmbeddedEngineConfig(
        model_path=model,
        device=setup.device.type,
        dtype=dtype,
        max_batch_size=batch,
        max_seq_len=setup.prompt_len + setup.new_tokens + 8,
        kv_cache_memory_gb=64.0 if setup.cuda else 2.0,
        num_threads=os.cpu_count() if setup.cuda else 1,
    )
    return EmbeddedEngine(config)


def _engine_tokens_per_s(setup: Setup, engine, batch: int) -> float:
    from miles_ray.engines.requests import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=setup.new_tokens, ignore_eos=True, seed=0)
    requests = [GenerateRequest(p, params) for p in _prompts(batch, setup.prompt_len)]
    engine.generate(requests[:1])  # warm-up (allocator, kernels)
    outs, seconds = _timed(setup, lambda: engine.generate(requests))
    return sum(len(c.token_ids) for o in outs for c in o.completions) / seconds


def _hf_tokens_per_s(setup: Setup, model: str, dtype: torch.dtype, batch: int) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(setup.device).eval()
    ids = torch.tensor(_prompts(batch, setup.prompt_len), device=setup.device)
    kw = dict(do_sample=True, top_k=0, top_p=1.0, max_new_tokens=setup.new_tokens, min_new_tokens=setup.new_tokens)
    with torch.no_grad():
        hf.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), **kw)  # warm-up
        out, seconds = _timed(setup, lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), **kw))
    return (out.shape[1] - ids.shape[1]) * batch / seconds


def engine_rows(setup: Setup) -> list[dict]:
    """Embedded engine vs HF ``generate``, tokens/s, per batch size (bf16 on CUDA, fp32 on CPU)."""
    dtype = "bfloat16" if setup.cuda else "float32"
    rows = []
    for what, model, batches in (
        ("engine decode", setup.model, setup.batches),
        ("engine MoE decode", setup.moe_model, setup.batches[:2]),
    ):
        engine = _engine(setup, model, dtype, max(batches))
        for batch in batches:
            ours = _engine_tokens_per_s(setup, engine, batch)
            ref = _hf_tokens_per_s(setup, model, engine.dtype, batch)
            rows.append(_row(what, f"{dtype} batch {batch}", ours, "tok/s", ref, "HF generate"))
        del engine
        _free(setup)
    return rows


def _row(check: str, setting: str, value: float, unit: str, reference: float | None, against: str) -> dict:
    ratio = value / reference if reference else None
    return {"check": check, "setting": setting, "value": value, "unit": unit, "reference": reference,
            "ratio": ratio, "against": against}  # fmt: skip


def _free(setup: Setup) -> None:
    import gc

    gc.collect()
    if setup.cuda:
        torch.cuda.empty_cache()


# --- trainer and engine on the same samples ---------------------------------------------------------------------
def _rollout_batch(setup: Setup, engine, seed: int = 0):
    """A GRPO batch the engine sampled (``group`` prompts x samples), rewards alternating, advantages filled."""
    from miles_ray.backends import GRPOAdvantageConfig, compute_advantages
    from miles_ray.engines.requests import GenerateRequest, SamplingParams
    from miles_ray.types import RolloutBatch, Sample

    prompts, n = setup.group
    params = SamplingParams(n=n, max_new_tokens=setup.new_tokens, ignore_eos=True, seed=seed)
    requests = [GenerateRequest(p, params) for p in _prompts(prompts, setup.prompt_len, offset=seed)]
    outs = engine.generate(requests)
    samples = [
        Sample(r.prompt_ids, c.token_ids, c.logprobs, reward=float(i % 2), group_id=g)
        for g, (r, o) in enumerate(zip(requests, outs))
        for i, c in enumerate(o.completions)
    ]
    batch = RolloutBatch.from_samples(samples, pad_id=0)
    group = torch.tensor([s.group_id for s in samples])
    batch.advantages = compute_advantages(GRPOAdvantageConfig(), batch.rewards, group, batch.response_mask)
    return batch


def _rollout_logprobs(batch) -> torch.Tensor:
    return batch.rollout_logprobs[batch.response_mask > 0]


def _trainer(setup: Setup, autocast: bool, packing=None, micro_batch: int = 16, model: str | None = None):
    from miles_ray.backends import OptimizerConfig, TorchBackendConfig
    from miles_ray.backends.torch_backend import TorchBackend

    config = TorchBackendConfig(
        parallel="ddp",
        autocast="bfloat16" if autocast else "none",
        packing=packing,
        micro_batch_size=micro_batch,
        num_threads=os.cpu_count() if setup.cuda else 1,
    )
    return TorchBackend(config, OptimizerConfig(lr=1e-5), model or setup.model)


def logprob_rows(setup: Setup) -> list[dict]:
    """Max |engine - trainer| logprob over the engine's sampled tokens: fp32 pair, then bf16 engine vs bf16 autocast."""
    from miles_ray.backends.rl_step import logprobs

    diffs = {}
    for dtype, autocast in (("float32", False), ("bfloat16", True)):
        engine = _engine(setup, setup.model, dtype, setup.group[0] * setup.group[1])
        batch = _rollout_batch(setup, engine)
        del engine
        trainer = _trainer(setup, autocast)
        lp = logprobs(trainer, batch, temperature=1.0)[batch.response_mask > 0]
        diffs[dtype] = float((lp - _rollout_logprobs(batch)).abs().max())
        del trainer
        _free(setup)
    return [
        _row("engine vs trainer logprobs", "fp32", diffs["float32"], "max abs", None, "trainer fp32"),
        _row("engine vs trainer logprobs", "bf16", diffs["bfloat16"], "max abs", None, "trainer bf16 autocast"),
    ]


def grpo_rows(setup: Setup):
    """One GRPO step padded, packed, and packed with shared prefixes: seconds and peak memory (the 2nd step timed).

    Returns the rows and the last trainer with its batch (the sync rows continue from its trained weights).
    """
    from miles_ray.backends import ObjectiveConfig
    from miles_ray.backends.packing import PackingConfig
    from miles_ray.backends.rl_step import RLStep

    engine = _engine(setup, setup.model, "bfloat16" if setup.cuda else "float32", setup.group[0] * setup.group[1])
    batch = _rollout_batch(setup, engine)
    del engine
    rows, padded = [], None
    for name, packing in (
        ("padded", None),
        ("packed", PackingConfig(share_prefix=False)),
        ("shared prefix", PackingConfig(share_prefix=True)),
    ):
        trainer = _trainer(setup, autocast=setup.cuda, packing=packing)
        step = RLStep(trainer, ObjectiveConfig())
        step.update(batch)  # warm-up: optimizer state, allocator, kernels
        if setup.cuda:
            torch.cuda.reset_peak_memory_stats()
        metrics, seconds = _timed(setup, lambda: step.update(batch))  # noqa: B023 (called at once)
        padded = padded or seconds
        row = _row("grpo step", f"{name}, bf16 autocast" if setup.cuda else name, seconds, "s", padded, "padded")
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30 if setup.cuda else None
        row.update(loss=metrics["loss"], grad_norm=metrics["grad_norm"])  # equal in the three layouts
        rows.append(row)
        if name != "shared prefix":
            del trainer, step
            _free(setup)
    return rows, trainer, batch


# --- colocated sync: the trainer here, the engine in a process of its own on the same device ----------------------
def _engine_process(conn, setup: Setup, dtype: str, batch: int) -> None:
    """The engine's side: loads what each message carries and answers (runs in a spawned process)."""
    from miles_ray.engines.requests import GenerateRequest, SamplingParams
    from miles_ray.sync.buckets import unpack
    from miles_ray.sync.shm import open_buckets

    engine = _engine(setup, setup.model, dtype, batch)
    conn.send("ready")
    while (message := conn.recv())[0] != "stop":
        op, plan, payload = message
        if op == "checksum":
            conn.send(engine.weights_checksum())
            continue
        if op == "generate":
            params = SamplingParams(n=setup.group[1], max_new_tokens=setup.new_tokens, ignore_eos=True, seed=payload)
            outs = engine.generate([GenerateRequest(p, params) for p in _prompts(setup.group[0], setup.prompt_len)])
            conn.send([(c.token_ids, c.logprobs) for o in outs for c in o.completions])
            continue
        flats = open_buckets(payload) if op == "shared" else payload  # "ipc": tensors through torch's reductions
        named = [kv for b, f in zip(plan.buckets, flats) for kv in unpack(b, f.view(b.dtype))]
        engine.update_weights(named, alias=op == "shared")
        _sync(setup)
        conn.send("loaded")


def _shared_sync(trainer, plan, buffers, conn) -> str:
    """Gather every bucket into the shared buffers, hand the engine their handles; the trainer side's digest."""
    from miles_ray.sync.buckets import unpack
    from miles_ray.sync.digest import TensorDigests

    digests = TensorDigests()
    flats = buffers.next(plan)
    for bucket, flat in zip(plan.buckets, flats):
        digests.add(unpack(bucket, trainer.gather_bucket(bucket, bucket.dtype, flat.view(bucket.dtype))))
    conn.send(("shared", plan, buffers.handles()))
    return digests.hexdigest()


def _device_buckets(trainer, plan, device: torch.device) -> list[torch.Tensor]:
    """The plan's buckets packed on the trainer's device (what a CUDA IPC transport would hand over)."""
    params = dict(trainer.hf_model.named_parameters())
    flats = []
    for bucket in plan.buckets:
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        for m in bucket.tensors:
            flat[m.offset : m.offset + m.numel].copy_(params[m.name].detach().reshape(-1))
        flats.append(flat.view(torch.uint8))
    return flats


def _best_of(setup: Setup, fn, repeats: int = 3) -> float:
    return min(_timed(setup, fn)[1] for _ in range(repeats))


def sync_rows(setup: Setup, trainer, batch) -> list[dict]:
    """Colocated sync GB/s (shared-memory buckets, CUDA IPC) vs a device copy, then a verified sync + generation."""
    from miles_ray.backends.rl_step import logprobs
    from miles_ray.sync.shm import BucketBuffers
    from miles_ray.types import RolloutBatch, Sample

    dtype = "bfloat16" if setup.cuda else "float32"
    plan = trainer.sync_plan(getattr(torch, dtype), bucket_bytes=512 << 20)
    nbytes = sum(b.nbytes for b in plan.buckets)
    copy_gbs = nbytes / _copy_seconds(setup, nbytes) / 1e9
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_engine_process, args=(child_conn, setup, dtype, setup.group[0] * setup.group[1]))
    child.start()
    try:
        assert conn.recv() == "ready"
        buffers = BucketBuffers(shared=True)
        shared_s = _best_of(setup, lambda: (_shared_sync(trainer, plan, buffers, conn), conn.recv()))
        ipc_s = _ipc_seconds(setup, trainer, plan, conn)
        expected = _shared_sync(trainer, plan, buffers, conn)  # the trained weights (grpo_rows stepped them)
        conn.recv()
        conn.send(("checksum", None, None))
        verified = conn.recv() == expected
        conn.send(("generate", None, 1))
        samples = [Sample(p, t, lp) for p, (t, lp) in zip(_repeat_prompts(setup), conn.recv())]
        conn.send(("stop",))
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    if not verified:
        raise RuntimeError("verified sync: the engine's weight digest differs from the trainer's")
    again = RolloutBatch.from_samples(samples, pad_id=0)
    mask = again.response_mask > 0
    diff = float((logprobs(trainer, again, temperature=1.0)[mask] - again.rollout_logprobs[mask]).abs().max())
    sync = f"{dtype}, {nbytes / 2**20:.0f} MiB"
    ipc = "CUDA IPC handles" if setup.cuda else "torch shared memory"  # torch.multiprocessing's reductions
    return [
        _row("colocated sync", f"shm buckets, {sync}", nbytes / shared_s / 1e9, "GB/s", copy_gbs, "device copy"),
        _row("colocated sync", f"{ipc}, {sync}", nbytes / ipc_s / 1e9, "GB/s", copy_gbs, "device copy"),
        _row("verified sync", "digest equal, then engine vs trainer logprobs", diff, "max abs", None, "trainer"),
    ]  # fmt: skip


def _copy_seconds(setup: Setup, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=setup.device)
    dst = torch.empty_like(src)
    return _best_of(setup, lambda: dst.copy_(src))


def _ipc_seconds(setup: Setup, trainer, plan, conn) -> float:
    """The plan's buckets packed on the device and handed over as CUDA IPC handles (on a CPU: shared memory)."""
    flats = _device_buckets(trainer, plan, setup.device)
    return _best_of(setup, lambda: (conn.send(("ipc", plan, flats)), conn.recv()))


def _repeat_prompts(setup: Setup) -> list[list[int]]:
    return [p for p in _prompts(setup.group[0], setup.prompt_len) for _ in range(setup.group[1])]


# --- Megatron ----------------------------------------------------------------------------------------------------
def megatron_rows(setup: Setup, batch) -> list[dict]:
    """A GRPO step of the Megatron backend and of the torch backend on the same batch: gradient norms.

    The dense model at TP=1 on ``batch``, then the MoE model (megatron-core's MoE layers, EP=1) on a batch its
    engine samples. (A first GRPO step's loss is 0 when every response has the same length: advantages sum to 0
    per group.)
    """
    rows = [_megatron_row(setup, setup.model, batch, "megatron step", "TP=1, fp32: grad norm")]
    if setup.moe_model is not None:
        engine = _engine(setup, setup.moe_model, "float32", setup.group[0] * setup.group[1])
        moe_batch = _rollout_batch(setup, engine)
        del engine
        _free(setup)
        rows.append(_megatron_row(setup, setup.moe_model, moe_batch, "megatron MoE step", "EP=1, fp32: grad norm"))
    return rows


def _megatron_row(setup: Setup, model: str, batch, check: str, setting: str) -> dict:
    from megatron.core import parallel_state as ps

    from miles_ray.backends import ObjectiveConfig, OptimizerConfig
    from miles_ray.backends.megatron_backend import MegatronBackend, MegatronBackendConfig
    from miles_ray.backends.rl_step import RLStep

    try:
        megatron = MegatronBackend(MegatronBackendConfig(micro_batch_size=16), OptimizerConfig(lr=1e-5), model)
        ours, seconds = _timed(setup, functools.partial(RLStep(megatron, ObjectiveConfig()).update, batch))
        del megatron  # its memory back before the torch backend's step
    finally:
        ps.destroy_model_parallel()
    _free(setup)
    theirs = RLStep(_trainer(setup, autocast=False, model=model), ObjectiveConfig()).update(batch)
    _free(setup)
    row = _row(check, setting, ours["grad_norm"], "norm", theirs["grad_norm"], "torch backend")
    row.update(loss=ours["loss"], seconds=seconds)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tokenizer", help="Directory of SmolLM2's tokenizer files; default: the installed SmolLM2's.")
    p.add_argument("--skip", default="", help="Comma-separated groups to leave out: engine,logprobs,grpo,sync,megatron")
    p.add_argument("--out", default="benchmarks/results", help="Directory of the JSON it writes.")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; --device cpu checks the script on a CPU")
    dense, moe = _models(a.device, a.tokenizer)
    cuda = a.device == "cuda"
    setup = Setup(
        device=torch.device("cuda", 0) if cuda else torch.device("cpu"),
        model=dense,
        moe_model=moe,
        batches=(1, 64, 256) if cuda else (1, 4),
        prompt_len=128 if cuda else 12,
        new_tokens=128 if cuda else 6,
        group=(8, 8) if cuda else (2, 4),
    )
    skip = set(filter(None, a.skip.split(",")))
    _init_process_group(setup)
    rows = []
    if "engine" not in skip:
        rows += engine_rows(setup)
    if "logprobs" not in skip:
        rows += logprob_rows(setup)
    rows_, trainer, batch = grpo_rows(setup)
    rows += rows_
    if "sync" not in skip:
        rows += sync_rows(setup, trainer, batch)
    del trainer
    _free(setup)
    if "megatron" not in skip:
        rows += megatron_rows(setup, batch)
    emit(f"gpu_check_{a.device}", rows, a.out)
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu (checks the script; no GPU figures)'}")
    dist.destroy_process_group()


def _init_process_group(setup: Setup) -> None:
    """A one-rank group: NCCL on CUDA (the backends' collectives run through it), gloo on the CPU."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if setup.cuda:
        torch.cuda.set_device(setup.device)
    backend = "nccl" if setup.cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


if __name__ == "__main__":
    main()
