"""A pure-PyTorch Llama/Qwen2 decoder for the embedded rollout engine, with a preallocated KV cache.

Parameter names equal Hugging Face's (``model.layers.0.self_attn.q_proj.weight``, ...), so an HF state
dict loads as is and weight sync sends HF-named tensors. The numerics follow HF's implementation
(fp32 RMSNorm, rotate-half RoPE computed in fp32), so in fp32 the engine's logprobs match a trainer's
HF model to ~1e-5.

Contract of ``forward``: the caller owns the cache layout. ``positions`` are RoPE positions per token,
``cache_pos`` is the cache slot where this call's first token is written (same for all rows, because
rows are left-padded to a common length), ``key_mask`` ``[B, cache_pos + S]`` marks valid cache slots.

Usage::

    model = LlamaModel.from_hf_dir(path, dtype=torch.float32)
    cache = model.new_cache(batch_size=8, max_len=256)
    logits = model(input_ids, positions, cache, cache_pos=0, key_mask=mask)   # [B, S, V]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaArgs:
    """Architecture hyper-parameters read from an HF ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf_config(cls, cfg: dict) -> LlamaArgs:
        """Parse an HF config dict of model_type ``llama`` or ``qwen2``.

        Raises:
            ValueError: for an unsupported model type or RoPE scaling.

        """
        model_type = cfg.get("model_type")
        if model_type not in ("llama", "qwen2"):
            raise ValueError(f"model_type must be 'llama' or 'qwen2' for the embedded engine, got {model_type!r}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported by the embedded engine (only 'default')")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        num_heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=float(theta),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # qwen2 always has q/k/v biases; llama has them when attention_bias is set
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        )


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, as HF's LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dim of ``x``."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention writing into and reading from a preallocated KV cache."""

    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.a = a
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)

    def forward(self, x, cos, sin, k_cache, v_cache, cache_pos: int, attn_mask) -> torch.Tensor:
        """Attend ``x`` ``[B, S, H]`` over the cache after writing its keys/values at ``cache_pos``."""
        bsz, seq, _ = x.shape
        a = self.a
        q = self.q_proj(x).view(bsz, seq, a.num_heads, a.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, a.num_kv_heads, a.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        end = cache_pos + seq
        k_cache[:, :, cache_pos:end] = k
        v_cache[:, :, cache_pos:end] = v
        out = F.scaled_dot_product_attention(
            q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=attn_mask, enable_gqa=a.num_kv_heads != a.num_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, a.num_heads * a.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block."""

    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, cache_pos, attn_mask):
        """Residual attention then residual MLP."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, cache_pos, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class KVCache:
    """Per-layer key/value tensors ``[B, num_kv_heads, max_len, head_dim]``."""

    def __init__(self, a: LlamaArgs, batch_size: int, max_len: int, dtype: torch.dtype):
        shape = (batch_size, a.num_kv_heads, max_len, a.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(a.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(a.num_layers)]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` (drop finished sequences, or repeat a prompt's cache for its n samples)."""
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]


class LlamaModel(nn.Module):
    """Llama/Qwen2 causal LM with HF parameter names."""

    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.args = a
        self.model = _Backbone(a)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.int64).float() / a.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def from_hf_dir(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> LlamaModel:
        """Build from an HF directory holding ``config.json`` and ``*.safetensors``."""
        from safetensors.torch import load_file

        path = Path(path)
        args = LlamaArgs.from_hf_config(json.loads((path / "config.json").read_text()))
        with torch.device("meta"):
            model = cls(args)
        model = model.to_empty(device="cpu")
        model.inv_freq = 1.0 / (
            args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.int64).float() / args.head_dim)
        )
        state = {}
        for f in sorted(path.glob("*.safetensors")):
            state.update(load_file(f))
        if args.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
            state.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (args.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"{path}: missing weights {missing[:5]}, unexpected weights {unexpected[:5]}")
        return model.to(dtype).eval().requires_grad_(False)

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """Allocate a KV cache in the model's dtype."""
        return KVCache(self.args, batch_size, max_len, self.model.embed_tokens.weight.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        cache_pos: int,
        key_mask: torch.Tensor,
        last_only: bool = True,
    ) -> torch.Tensor:
        """Run ``S`` new tokens per row through the model.

        Args:
            input_ids: ``[B, S]`` token ids.
            positions: ``[B, S]`` RoPE positions.
            cache: KV cache with at least ``cache_pos + S`` slots.
            cache_pos: slot of the first new token.
            key_mask: ``[B, cache_pos + S]`` bool, True on valid (non-padding) cache slots.
            last_only: return logits of the last position only.

        Returns:
            ``[B, S, V]`` logits in fp32, or ``[B, V]`` with ``last_only``.

        """
        x = self.model.embed_tokens(input_ids)
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(x.dtype)[:, None]
        sin = emb.sin().to(x.dtype)[:, None]
        seq = input_ids.shape[1]
        end = cache_pos + seq
        # causal within the new tokens, every earlier valid slot visible
        causal = torch.ones(seq, end, dtype=torch.bool).tril(diagonal=cache_pos)
        attn_mask = (causal[None] & key_mask[:, None, :end])[:, None]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], cache_pos, attn_mask)
        if last_only:
            x = x[:, -1]
        return self.lm_head(self.model.norm(x)).float()
