"""Train/rollout logprob mismatch of low-precision rollout recipes, with and without the trainer's view.

The engine (bf16) samples ``--prompts x --group-size`` responses with its linear weights held in each recipe's
format (bf16 as is; FP8 e4m3 with one scale per 128x128 tile; INT4 with one scale per 128 inputs; emulated:
rounded through the format, matmul in bf16, LM head and embeddings kept). The trainer (fp32 master weights, bf16
autocast) recomputes every sampled token's logprob twice: with its own weights ("plain", what a bf16 trainer
sees) and through the same quantiser ("view": the trainer's view of the rollout weights; for INT4 this is the
QAT forward). Columns: mean/max abs logprob difference, k3 KL(rollout || trainer), and the share of tokens TIS
at cap 2 would clip (``exp(train - rollout) > 2``).

    python benchmarks/precision_mismatch.py --model smollm2-135m
"""

import argparse
import copy

import torch
from common import emit
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_ray.engines.base import GenerateRequest, SamplingParams
from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.models.hub import MODELS, model_dir
from miles_ray.models.quant import quantize_linears_

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
p.add_argument("--prompts", type=int, default=4)
p.add_argument("--group-size", type=int, default=4)
p.add_argument("--new-tokens", type=int, default=64)
p.add_argument("--block", type=int, default=128, help="FP8 tile side and INT4 group size")
args = p.parse_args()
torch.set_num_threads(1)

path = str(model_dir(args.model))
tok = AutoTokenizer.from_pretrained(path)
hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
questions = [f"What is {i} + {2 * i + 1}? Answer briefly." for i in range(args.prompts)]
prompts = [
    tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True))[
        "input_ids"
    ]
    for q in questions
]


def recompute(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].double()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return lp.gather(1, torch.tensor(tokens)[:, None])[:, 0]


rows = []
for fmt in ("bf16", "fp8", "int4"):
    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=path, dtype="bfloat16", max_seq_len=256))
    if fmt != "bf16":
        quantize_linears_(engine.model, fmt, args.block)
    params = SamplingParams(n=args.group_size, max_new_tokens=args.new_tokens, seed=0)
    outs = engine.generate([GenerateRequest(ids, params) for ids in prompts])
    pairs = [(ids, c) for ids, out in zip(prompts, outs) for c in out.completions]
    rollout = torch.cat([torch.tensor(c.logprobs, dtype=torch.float64) for _, c in pairs])
    views = {"plain": hf}
    if fmt != "bf16":
        views["view"] = copy.deepcopy(hf)
        quantize_linears_(views["view"], fmt, args.block)
    for view, model in views.items():
        train = torch.cat([recompute(model, ids, c.token_ids) for ids, c in pairs])
        d = (train - rollout).abs()
        log_ratio = rollout - train
        rows.append({
            "recipe": fmt,
            "trainer": view,
            "tokens": d.numel(),
            "mean_abs_diff": d.mean().item(),
            "max_abs_diff": d.max().item(),
            "k3_kl": (log_ratio.exp() - 1 - log_ratio).mean().item(),
            "tis_clip_frac_cap2": ((train - rollout).exp() > 2).double().mean().item(),
        })  # fmt: skip
print(f"model {args.model}: engine bf16 weights in each format, trainer fp32 + bf16 autocast")
emit("precision_mismatch", rows)
