"""Rollout throughput: the embedded engine vs HF ``generate`` on the same model, prompts and lengths.

Both produce exactly ``batch * new_tokens`` tokens (EOS ignored), sampled at temperature 1, one torch
thread each by default. The ratio column is engine tokens/s divided by HF tokens/s in the same run.

    python benchmarks/rollout_throughput.py --model smollm2-135m --batch-sizes 8 32 --new-tokens 64
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
p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
p.add_argument("--new-tokens", type=int, default=64)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--group-size", type=int, default=1, help="samples per prompt (prefix sharing when > 1)")
args = p.parse_args()
torch.set_num_threads(args.threads)

path = str(model_dir(args.model))
tok = AutoTokenizer.from_pretrained(path)
hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
engine = EmbeddedEngine(
    EmbeddedEngineConfig(model_path=path, max_batch_size=max(args.batch_sizes), num_threads=args.threads)
)
questions = [f"What is {i} + {i * 3}? Explain step by step." for i in range(max(args.batch_sizes))]
prompts = [
    tok(
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    for q in questions
]


def run_hf(batch: int) -> float:
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


def run_engine(batch: int) -> float:
    num_prompts = batch // args.group_size
    params = SamplingParams(n=args.group_size, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    start = time.perf_counter()
    outs = engine.generate([GenerateRequest(ids, params) for ids in prompts[:num_prompts]])
    seconds = time.perf_counter() - start
    assert sum(len(c.token_ids) for o in outs for c in o.completions) == batch * args.new_tokens
    return batch * args.new_tokens / seconds


run_engine(args.group_size), run_hf(args.group_size)  # warm-up
rows = []
for batch in args.batch_sizes:
    hf_tps, eng_tps = run_hf(batch), run_engine(batch)
    rows.append(
        {
            "group_size": args.group_size,
            "model": args.model,
            "batch": batch,
            "new_tokens": args.new_tokens,
            "hf_tok_s": hf_tps,
            "engine_tok_s": eng_tps,
            "engine_over_hf": eng_tps / hf_tps,
        }
    )
emit(f"rollout_throughput_g{args.group_size}", rows)
