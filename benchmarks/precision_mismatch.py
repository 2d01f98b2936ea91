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
from common import arithmetic_prompts, emit, mismatch_stats
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.models.hub import MODELS, model_dir
from miles_ray.models.quant import WeightFormatConfig, apply_weight_format

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
prompts = arithmetic_prompts(tok, args.prompts)


def recompute(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].double()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return lp.gather(1, torch.tensor(tokens)[:, None])[:, 0]


rows = []
for fmt in ("bf16", "fp8", "int4"):
    recipe = None if fmt == "bf16" else WeightFormatConfig(format=fmt, block=args.block)  # as users configure it
    engine = EmbeddedEngine(
        EmbeddedEngineConfig(model_path=path, dtype="bfloat16", max_seq_len=256, weight_format=recipe)
    )
    params = SamplingParams(n=args.group_size, max_new_tokens=args.new_tokens, seed=0)
    outs = engine.generate([GenerateRequest(ids, params) for ids in prompts])
    pairs = [(ids, c) for ids, out in zip(prompts, outs) for c in out.completions]
    rollout = torch.cat([torch.tensor(c.logprobs, dtype=torch.float64) for _, c in pairs])
    views = {"plain": hf}
    if recipe is not None:  # the trainer side of the same recipe (TorchBackendConfig.weight_format)
        views["view"] = copy.deepcopy(hf)
        apply_weight_format(views["view"], recipe, "trainer")
    for view, model in views.items():
        train = torch.cat([recompute(model, ids, c.token_ids) for ids, c in pairs])
        rows.append({"recipe": fmt, "trainer": view, **mismatch_stats(train, rollout)})
print(f"model {args.model}: engine bf16 weights in each format, trainer fp32 + bf16 autocast")
emit("precision_mismatch", rows)
