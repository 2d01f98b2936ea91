"""Engine vs trainer logprobs for the same sampled tokens, in fp32 and bf16.

The engine samples ``--prompts x --group-size`` responses; an HF model (the trainer's) recomputes the
logprob of every sampled token by teacher forcing, in fp32 and under bf16 autocast (the quick-start's
trainer precision), and in fp64 as the exact reference. Rows: engine dtype x trainer precision, with
max and mean abs difference over all response tokens; ``*_vs_fp64`` columns give each side's own error
against the fp64 recompute, which shows the fp32 noise floor the fp32/fp32 difference sits on.

    python benchmarks/logprob_numerics.py --model smollm2-135m
"""

import argparse

import torch
from common import arithmetic_prompts, emit
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.models.hub import MODELS, model_dir

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
p.add_argument("--prompts", type=int, default=4)
p.add_argument("--group-size", type=int, default=4)
p.add_argument("--new-tokens", type=int, default=64)
args = p.parse_args()
torch.set_num_threads(1)

path = str(model_dir(args.model))
tok = AutoTokenizer.from_pretrained(path)
hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
prompts = arithmetic_prompts(tok, args.prompts)


hf64 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def recompute(prompt: list[int], tokens: list[int], autocast: bool, model=hf) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].double()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return lp.gather(1, torch.tensor(tokens)[:, None])[:, 0]


rows = []
for dtype in __import__("os").environ.get("DTYPES", "float32 bfloat16").split():
    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=path, dtype=dtype, max_seq_len=256))
    params = SamplingParams(n=args.group_size, max_new_tokens=args.new_tokens, seed=0)
    outs = engine.generate([GenerateRequest(ids, params) for ids in prompts])
    exact = [recompute(ids, c.token_ids, False, hf64) for ids, out in zip(prompts, outs) for c in out.completions]
    engine_lp = [torch.tensor(c.logprobs, dtype=torch.float64) for out in outs for c in out.completions]
    engine_err = torch.cat([(e - x).abs() for e, x in zip(engine_lp, exact)])
    for trainer in ("fp32", "bf16_autocast"):
        ref = [
            recompute(ids, c.token_ids, trainer != "fp32") for ids, out in zip(prompts, outs) for c in out.completions
        ]
        d = torch.cat([(e - r).abs() for e, r in zip(engine_lp, ref)])
        trainer_err = torch.cat([(r - x).abs() for r, x in zip(ref, exact)])
        rows.append(
            {
                "model": args.model,
                "engine_dtype": dtype,
                "trainer": trainer,
                "tokens": d.numel(),
                "max_abs_diff": d.max().item(),
                "mean_abs_diff": d.mean().item(),
                "engine_max_vs_fp64": engine_err.max().item(),
                "trainer_max_vs_fp64": trainer_err.max().item(),
            }
        )
emit("logprob_numerics", rows)
