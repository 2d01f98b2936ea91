"""The embedded rollout engine: batched KV-cache decoding in pure PyTorch, runs anywhere (CPU included).

A batch of requests is prefilled once per prompt (the ``n`` samples of a group share the prompt's KV
cache: prefix sharing), then decoded token by token for all rows together; finished rows are dropped
from the batch when enough of them accumulate, so long tails do not pay for short responses.

Usage::

    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=path))
    [out] = engine.generate([GenerateRequest(prompt_ids=ids, params=SamplingParams(n=4))])
    out.completions[0].token_ids, out.completions[0].logprobs
"""

from __future__ import annotations

import threading
from typing import Literal

import torch
from pydantic import Field

from miles_ray.config import StrictConfig
from miles_ray.engines.base import Completion, GenerateOutput, GenerateRequest, SamplingParams
from miles_ray.sync.checksum import named_tensors_checksum

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EmbeddedEngineConfig(StrictConfig):
    """Configuration of one embedded engine."""

    kind: Literal["embedded"] = "embedded"
    model_path: str = Field(..., description="HF model directory (config.json + safetensors + tokenizer).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights and KV cache dtype.")
    max_batch_size: int = Field(64, ge=1, le=4096, description="Rows (samples) decoded together at most.")
    max_seq_len: int = Field(2048, ge=8, le=131072, description="Prompt + response tokens per row at most.")
    num_threads: int = Field(1, ge=1, le=256, description="torch intra-op threads for this engine.")
    seed: int = Field(0, description="Seed of the engine RNG used by requests without their own seed.")
    compact_fraction: float = Field(
        0.25, ge=0.0, le=1.0, description="Drop finished rows from the batch once this fraction is finished."
    )


class EmbeddedEngine:
    """In-process rollout engine implementing ``RolloutEngine``."""

    def __init__(self, config: EmbeddedEngineConfig):
        from transformers import AutoTokenizer

        from miles_ray.models import build_engine_model

        self.config = config
        torch.set_num_threads(config.num_threads)
        self.model = build_engine_model(config.model_path, _DTYPES[config.dtype])
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._rng = torch.Generator().manual_seed(config.seed)
        self._version = 0
        # one batch or one weight update at a time
        self._lock = threading.Lock()
        self._params = dict(self.model.named_parameters())

    # --- weights -------------------------------------------------------------------------------
    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model (casting to the engine dtype).

        Raises:
            ValueError: for an unknown name or a shape mismatch; nothing is copied then.

        """
        for name, t in named_tensors:
            if name not in self._params:
                raise ValueError(f"update_weights: unknown parameter {name!r}")
            if tuple(t.shape) != tuple(self._params[name].shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(t.shape)}, engine expects "
                    f"{tuple(self._params[name].shape)}"
                )
        with self._lock, torch.no_grad():
            for name, t in named_tensors:
                self._params[name].copy_(t)

    def set_weight_version(self, version: int) -> None:
        """Record the version of the loaded weights."""
        self._version = int(version)

    def weight_version(self) -> int:
        """The version of the loaded weights."""
        return self._version

    def weights_checksum(self) -> str:
        """Checksum over the HF-named parameters (tied weights counted once)."""
        with self._lock:
            return named_tensors_checksum(self.model.named_parameters())

    def state_dict_names(self) -> list[str]:
        """HF names of the parameters this engine accepts."""
        return list(self._params)

    # --- generation ----------------------------------------------------------------------------
    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """Sample every request's ``n`` responses, in batches of at most ``max_batch_size`` rows.

        Raises:
            ValueError: for an empty prompt, a request with more rows than ``max_batch_size``, or a
                prompt + ``max_new_tokens`` longer than ``max_seq_len``.

        """
        for r in requests:
            self.validate(r)
        outputs: list[GenerateOutput] = []
        chunk: list[GenerateRequest] = []
        rows = 0
        for r in requests:
            if chunk and rows + r.params.n > self.config.max_batch_size:
                outputs += self._generate_batch(chunk)
                chunk, rows = [], 0
            chunk.append(r)
            rows += r.params.n
        if chunk:
            outputs += self._generate_batch(chunk)
        return outputs

    def validate(self, r: GenerateRequest) -> None:
        """Raise ``ValueError`` naming what is wrong with a request (see ``generate``)."""
        if not r.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        vocab = self.model.args.vocab_size
        if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= vocab:
            raise ValueError(f"prompt_ids must be in [0, {vocab}), got min {min(r.prompt_ids)} max {max(r.prompt_ids)}")
        if r.params.n > self.config.max_batch_size:
            raise ValueError(f"sampling_params.n={r.params.n} exceeds max_batch_size={self.config.max_batch_size}")
        total = len(r.prompt_ids) + r.params.max_new_tokens
        if total > self.config.max_seq_len:
            raise ValueError(
                f"prompt ({len(r.prompt_ids)} tokens) + max_new_tokens ({r.params.max_new_tokens}) "
                f"exceeds max_seq_len={self.config.max_seq_len}"
            )

    @torch.no_grad()
    def _generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        with self._lock:
            version = self._version
            rows = _decode(self, requests)
        outputs, i = [], 0
        for r in requests:
            comps = []
            for _ in range(r.params.n):
                toks, lps, reason = rows[i]
                comps.append(Completion(toks, lps, reason, self.tokenizer.decode(toks, skip_special_tokens=True)))
                i += 1
            outputs.append(GenerateOutput(r.request_id, comps, version))
        return outputs


def _sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]):
    """Draw one token per row. ``logits``: ``[R, V]`` fp32. Returns ``(tokens [R], logprobs [R])``."""
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    scaled = logits / temps[:, None]
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    tokens = torch.empty(len(params), dtype=torch.long)
    for row, (p, g) in enumerate(zip(params, gens)):
        if p.temperature == 0:
            tokens[row] = int(torch.argmax(scaled[row]))
            continue
        lp = logprobs_all[row]
        if p.top_k > 0 or p.top_p < 1.0:
            k = p.top_k if p.top_k > 0 else lp.numel()
            vals, idx = torch.topk(lp, min(k, lp.numel()))
            if p.top_p < 1.0:
                cum = torch.cumsum(vals.exp(), dim=0)
                keep = int((cum < p.top_p).sum()) + 1  # smallest prefix whose mass reaches top_p
                vals, idx = vals[:keep], idx[:keep]
            choice = torch.multinomial(vals.exp(), 1, generator=g)
            tokens[row] = idx[choice]
        else:
            tokens[row] = torch.multinomial(lp.exp(), 1, generator=g)
    return tokens, logprobs_all.gather(1, tokens[:, None])[:, 0]


def _decode(engine: EmbeddedEngine, requests: list[GenerateRequest]) -> list[tuple[list[int], list[float], str]]:
    """Prefill each prompt once, fan out its ``n`` rows, decode all rows together. Returns one tuple per row."""
    model, cfg = engine.model, engine.config
    prompts = [r.prompt_ids for r in requests]
    plen = max(len(p) for p in prompts)
    num_prompts = len(prompts)
    ids = torch.full((num_prompts, plen), engine.pad_token_id, dtype=torch.long)
    key_valid = torch.zeros((num_prompts, plen), dtype=torch.bool)
    for i, p in enumerate(prompts):  # left padding: every prompt ends at slot plen-1
        ids[i, plen - len(p) :] = torch.tensor(p)
        key_valid[i, plen - len(p) :] = True
    positions = (key_valid.long().cumsum(-1) - 1).clamp(min=0)
    max_new = max(r.params.max_new_tokens for r in requests)
    cache = model.new_cache(num_prompts, plen + max_new)
    logits = model(ids, positions, cache, 0, key_valid)  # [P, V]

    # fan out: row -> its prompt
    fan = torch.tensor([i for i, r in enumerate(requests) for _ in range(r.params.n)])
    cache.select(fan)
    logits, key_valid, next_pos = logits[fan], key_valid[fan], positions[fan, -1] + 1
    params = [requests[i].params for i in fan.tolist()]
    gens = []
    for r in requests:
        for j in range(r.params.n):
            seed = r.params.seed
            g = torch.Generator()
            g.manual_seed(
                seed * 1000003 + j if seed is not None else int(torch.randint(0, 2**62, (1,), generator=engine._rng))
            )
            gens.append(g)
    num_rows = len(params)
    out_tokens: list[list[int]] = [[] for _ in range(num_rows)]
    out_lps: list[list[float]] = [[] for _ in range(num_rows)]
    reasons = ["length"] * num_rows
    stop_ids = [set(p.stop_token_ids) | (set() if p.ignore_eos else {engine.eos_token_id}) for p in params]
    active = list(range(num_rows))  # original row index of each batch row
    done = [False] * num_rows
    for step in range(max_new):
        tokens, lps = _sample(logits, [params[r] for r in active], [gens[r] for r in active])
        for b, r in enumerate(active):
            if done[r]:
                continue
            tok = int(tokens[b])
            out_tokens[r].append(tok)
            out_lps[r].append(float(lps[b]))
            if tok in stop_ids[r] or _hit_stop_string(engine, out_tokens[r], params[r].stop):
                done[r], reasons[r] = True, "stop"
            elif len(out_tokens[r]) >= params[r].max_new_tokens:
                done[r] = True
        live = [b for b, r in enumerate(active) if not done[r]]
        if not live:
            break
        if len(live) <= (1.0 - cfg.compact_fraction) * len(active):
            keep = torch.tensor(live)
            cache.select(keep)
            key_valid, next_pos, tokens = key_valid[keep], next_pos[keep], tokens[keep]
            active = [active[b] for b in live]
        key_valid = torch.cat([key_valid, torch.ones(len(active), 1, dtype=torch.bool)], dim=1)
        logits = model(tokens[:, None], next_pos[:, None], cache, plen + step, key_valid)
        next_pos = next_pos + 1
    return [(out_tokens[r], out_lps[r], reasons[r]) for r in range(num_rows)]


def _hit_stop_string(engine: EmbeddedEngine, tokens: list[int], stop: list[str]) -> bool:
    if not stop:
        return False
    tail = engine.tokenizer.decode(tokens[-16:], skip_special_tokens=False)
    return any(s in tail for s in stop)
