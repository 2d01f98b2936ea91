"""Rollout throughput: the embedded engine vs HF ``generate`` on the same model, prompts and lengths.

Every configuration produces exactly ``batch * new_tokens`` tokens (EOS ignored), sampled at temperature
1, one torch thread by default, ``batch`` = prompts x ``--group-size`` samples (a GRPO group shares a
prompt). Columns: tokens/s of HF ``generate`` in fp32 and bf16, of the engine in fp32, in fp32 with
prefix sharing off, and in bf16 (weights and KV cache); ratios are engine over HF in the same run.

    python benchmarks/rollout_throughput.py --batch-sizes 8 32 64 --new-tokens 128 --group-size 8
"""

import argparse
import time

import torch
from common import emit
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_ray.engines.base import GenerateRequest, SamplingParams
from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.models.hub import MODELS, model_dir

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 64])
p.add_argument("--new-tokens", type=int, default=128)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--group-size", type=int, default=8, help="samples per prompt (prefix sharing when > 1)")
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
    rows.append(row)
emit(f"rollout_throughput_g{args.group_size}", rows)
