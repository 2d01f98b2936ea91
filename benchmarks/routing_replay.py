"""MoE train/rollout logprob mismatch with and without routing replay (R3).

The engine (bf16) samples ``--prompts x --group-size`` responses from an MoE and records every token's experts.
The trainer (HF Mixtral, fp32 master weights, bf16 autocast or plain fp32) recomputes each sampled token's
logprob with its own routers ("off") and with the rollout's experts replayed ("on", ``RouteTracker``: the
trainer's router probabilities at the replayed experts, renormalised). Columns: the share of (token, layer)
top-k sets the trainer's routers choose differently from the engine's, mean/max abs logprob difference,
k3 KL(rollout || trainer) and the share of tokens TIS at cap 2 would clip.

The default model is SmolLM2-135M sparse-upcycled to 4 experts, top-2 (``models.hub.upcycled_moe_dir``: no
pretrained MoE is reachable offline); ``--model tiny-moe`` is the random test model.

    python benchmarks/routing_replay.py
"""

import argparse
import contextlib

import torch
from common import arithmetic_prompts, emit, mismatch_stats
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_ray.backends.routing import RouteTracker
from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.models.hub import model_dir
from miles_ray.types import RolloutBatch, Sample

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", choices=["smollm2-moe", "tiny-moe"], default="smollm2-moe")
p.add_argument("--prompts", type=int, default=4)
p.add_argument("--group-size", type=int, default=4)
p.add_argument("--new-tokens", type=int, default=64)
args = p.parse_args()
torch.set_num_threads(1)

path = str(model_dir(args.model))
tok = AutoTokenizer.from_pretrained(path)
prompts = arithmetic_prompts(tok, args.prompts)

engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=path, dtype="bfloat16", max_seq_len=512))
params = SamplingParams(n=args.group_size, max_new_tokens=args.new_tokens, seed=0)
outs = engine.generate([GenerateRequest(ids, params) for ids in prompts])
samples = [
    Sample(ids, c.token_ids, c.logprobs, routes=c.routes) for ids, out in zip(prompts, outs) for c in out.completions
]
del engine

hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
rows = []
for precision in ("bf16 autocast", "fp32"):
    for replay in (False, True):
        tracker = RouteTracker(hf, replay=replay)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision != "fp32" else contextlib.nullcontext()
        train, rollout = [], []
        for s in samples:  # one sequence per forward: no padding in the comparison
            batch = RolloutBatch.from_samples([s], pad_id=0)
            with torch.no_grad(), autocast, tracker.tracking(batch.routes):
                logits = hf(input_ids=batch.input_ids).logits[0].double()
            lp = torch.log_softmax(logits[len(s.prompt_ids) - 1 : -1], -1)
            train.append(lp.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0])
            rollout.append(torch.tensor(s.rollout_logprobs, dtype=torch.float64))
        tracker.remove()
        train, rollout = torch.cat(train), torch.cat(rollout)
        differ, recorded = tracker.take_mismatch()
        rows.append(
            {
                "trainer": precision,
                "replay": "on" if replay else "off",
                "route_mismatch_frac": differ / max(recorded, 1),
                **mismatch_stats(train, rollout),
            }
        )
print(f"model {args.model}: engine bf16 (routes recorded), trainer HF Mixtral")
emit("routing_replay", rows)
