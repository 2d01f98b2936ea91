"""Rollout throughput: the embedded engine vs HF ``generate`` on the same model, prompts and lengths.

Every configuration produces exactly ``batch * new_tokens`` tokens (EOS ignored), sampled at temperature
1, one torch thread by default, ``batch`` = prompts x ``--group-size`` samples (a GRPO group shares a
prompt). Columns: tokens/s of HF ``generate`` in fp32 and bf16, of the engine in fp32, in fp32 with
prefix sharing off, and in bf16 (weights and KV cache); ratios are engine over HF in the same run.
With a vLLM environment (``--vllm-python``, default ``.venv-vllm`` when it exists) a real vLLM server
(CPU build, prefix caching on, its threads pinned to ``--threads`` cores) runs the same requests in fp32
and bf16, and the embedded engine is also reported over vLLM.

    python benchmarks/rollout_throughput.py --batch-sizes 8 32 64 --new-tokens 128 --group-size 8
"""

import argparse
import asyncio
import time
from pathlib import Path

import torch
from common import emit
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.models.hub import MODELS, model_dir

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 64])
p.add_argument("--new-tokens", type=int, default=128)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--group-size", type=int, default=8, help="samples per prompt (prefix sharing when > 1)")
venv_vllm = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
p.add_argument("--vllm-python", default=str(venv_vllm) if venv_vllm.exists() else None, help="'' skips vLLM")
args = p.parse_args()
torch.set_num_threads(args.threads)

path = str(model_dir(args.model))
tok = AutoTokenizer.from_pretrained(path)
hfs = {d: AutoModelForCausalLM.from_pretrained(path, dtype=d).eval() for d in (torch.float32, torch.bfloat16)}


def engine(dtype: str, sharing: bool) -> EmbeddedEngine:
    cfg = EmbeddedEngineConfig(
        model_path=path,
        dtype=dtype,
        prefix_sharing=sharing,
        max_batch_size=max(args.batch_sizes),
        max_seq_len=128 + args.new_tokens,
        kv_cache_memory_gb=8.0,
        num_threads=args.threads,
    )
    return EmbeddedEngine(cfg)


engines = {
    "fp32": engine("float32", True),
    "fp32_no_sharing": engine("float32", False),
    "bf16": engine("bfloat16", True),
}
questions = [f"What is {i} + {i * 3}? Explain step by step." for i in range(max(args.batch_sizes))]
prompts = [
    tok(
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    for q in questions
]


def run_hf(hf, batch: int) -> float:
    num_prompts = batch // args.group_size
    tok.padding_side = "left"
    enc = tok.pad({"input_ids": prompts[:num_prompts]}, return_tensors="pt")
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(
            **enc,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            num_return_sequences=args.group_size,
            pad_token_id=tok.pad_token_id,
        )
    seconds = time.perf_counter() - start
    assert out.shape == (batch, enc["input_ids"].shape[1] + args.new_tokens)
    return batch * args.new_tokens / seconds


def run_engine(eng: EmbeddedEngine, batch: int) -> float:
    num_prompts = batch // args.group_size
    params = SamplingParams(n=args.group_size, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    start = time.perf_counter()
    outs = eng.generate([GenerateRequest(ids, params) for ids in prompts[:num_prompts]])
    seconds = time.perf_counter() - start
    assert sum(len(c.token_ids) for o in outs for c in o.completions) == batch * args.new_tokens
    return batch * args.new_tokens / seconds


def run_vllm(server, batch: int) -> float:
    num_prompts = batch // args.group_size
    params = SamplingParams(n=args.group_size, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)

    async def go() -> float:
        start = time.perf_counter()
        outs = await asyncio.gather(*(server.generate(GenerateRequest(ids, params)) for ids in prompts[:num_prompts]))
        seconds = time.perf_counter() - start
        assert sum(len(c.token_ids) for o in outs for c in o) == batch * args.new_tokens
        return batch * args.new_tokens / seconds

    return loop.run_until_complete(go())


vllm_tps: dict[int, dict[str, float]] = {b: {} for b in args.batch_sizes}
if args.vllm_python:  # one server at a time (each ~3 GB), before the in-process engines compete for the cores
    from miles_ray.engines.vllm import VLLMEngineConfig, VLLMServer

    loop = asyncio.new_event_loop()
    pin = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}" if args.threads > 1 else "0"}
    for name, dtype in (("vllm_fp32", "float32"), ("vllm_bf16", "bfloat16")):
        cfg = VLLMEngineConfig(
            model_path=path,
            python=args.vllm_python,
            dtype=dtype,
            kv_cache_gb=4,
            env=pin,
            max_model_len=128 + args.new_tokens,
            vllm_args={"max-num-seqs": max(args.batch_sizes)},
        )
        server = VLLMServer(cfg)
        try:
            loop.run_until_complete(server.wait_healthy())
            run_vllm(server, args.group_size)  # warm-up
            for batch in args.batch_sizes:
                vllm_tps[batch][name] = run_vllm(server, batch)
        finally:
            loop.run_until_complete(server.aclose())

for eng in engines.values():  # warm-up
    run_engine(eng, args.group_size)
for hf in hfs.values():
    run_hf(hf, args.group_size)
rows = []
for batch in args.batch_sizes:
    row = {"model": args.model, "batch": batch, "group_size": args.group_size, "new_tokens": args.new_tokens}
    hf32, hf16 = run_hf(hfs[torch.float32], batch), run_hf(hfs[torch.bfloat16], batch)
    tps = {name: run_engine(eng, batch) for name, eng in engines.items()}
    row |= {"hf_fp32_tok_s": hf32, "hf_bf16_tok_s": hf16} | {f"{k}_tok_s": v for k, v in tps.items()}
    row["fp32_over_hf_fp32"] = tps["fp32"] / hf32
    row["fp32_no_sharing_over_hf_fp32"] = tps["fp32_no_sharing"] / hf32
    row["bf16_over_hf_bf16"] = tps["bf16"] / hf16
    row["bf16_over_hf_fp32"] = tps["bf16"] / hf32
    if vllm_tps[batch]:
        v32, v16 = vllm_tps[batch]["vllm_fp32"], vllm_tps[batch]["vllm_bf16"]
        row |= {"vllm_fp32_tok_s": v32, "vllm_bf16_tok_s": v16}
        row |= {"fp32_over_vllm_fp32": tps["fp32"] / v32, "bf16_over_vllm_bf16": tps["bf16"] / v16}
    rows.append(row)
emit(f"rollout_throughput_g{args.group_size}", rows)
