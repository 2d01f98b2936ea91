"""HF Llama/Qwen2/Qwen3/Mixtral/Qwen3-MoE <-> megatron-core GPT weights: names, layouts, TP splits (pure functions).

Megatron's local-spec GPT names and layouts, per TP rank ``r`` of ``tp``:

- ``embedding.word_embeddings.weight`` / ``output_layer.weight``: vocab rows ``r``-th of ``tp`` chunks.
- ``decoder.layers.i.self_attention.linear_qkv.weight``: one block per KV group ``[q heads of the group, k, v]``
  (each ``head_dim`` rows per head), groups split over ranks; ``.bias`` likewise (Qwen2).
- ``linear_proj`` (o_proj) and ``mlp.linear_fc2`` (down_proj): input columns split.
- ``mlp.linear_fc1.weight``: ``[gate rows of rank r, up rows of rank r]`` (SwiGLU halves split separately).
- MoE layers: ``mlp.router.weight`` (HF ``mlp.gate.weight``, replicated) and, per expert ``e``,
  ``mlp.experts.local_experts.e.linear_fc1/linear_fc2.weight``, cut from HF's fused ``mlp.experts.gate_up_proj``
  ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]`` (the in-memory layout engines and syncs use) like a dense MLP's.
- norms: replicated (``input_layernorm``, ``pre_mlp_layernorm``, ``decoder.final_layernorm``; Qwen3's per-head
  ``self_attention.q_layernorm`` / ``k_layernorm``).

``hf_to_megatron`` gives one rank's shard (``to_stage`` keeps what one pipeline stage holds, its layers numbered
from 0); ``megatron_to_hf`` takes every rank's shard of each tensor (rank order) and rebuilds the HF tensors. Both
only slice, concatenate and reshape, so a round trip is bit-exact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from miles_ray.models.llama import LlamaArgs


@dataclass(frozen=True)
class GPTShape:
    """What the conversion needs to know about the architecture."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False
    num_experts: int = 0
    moe_layers: tuple[int, ...] = ()  # layers with a sparse MoE feed-forward

    @classmethod
    def from_args(cls, a: LlamaArgs) -> GPTShape:
        """From the parsed HF config (``LlamaArgs.from_hf_config``)."""
        return cls(
            a.num_layers,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            a.tie_word_embeddings,
            a.attention_bias,
            a.qk_norm,
            a.num_experts,
            a.moe_layers,
        )

    @classmethod
    def from_hf_config(cls, cfg: dict) -> GPTShape:
        """From an HF ``config.json`` dict of a model type in ``MEGATRON_FAMILIES``.

        Raises:
            ValueError: for another model type, an output-projection bias, or what ``LlamaArgs.from_hf_config``
                refuses.

        """
        if cfg.get("model_type") not in MEGATRON_FAMILIES:
            raise ValueError(
                f"model_type must be one of {list(MEGATRON_FAMILIES)} for the Megatron backend, "
                f"got {cfg.get('model_type')!r}"
            )
        args = LlamaArgs.from_hf_config(cfg)
        if args.o_bias:  # megatron's add_bias_linear would put biases on the MLP too
            raise ValueError("attention_bias=True (an o_proj bias) is not supported by the Megatron backend")
        return cls.from_args(args)


MEGATRON_FAMILIES = ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe")


_HF_LAYER = "model.layers.{}."
_MG_LAYER = "decoder.layers.{}."
# one-to-one tensors: HF suffix -> (Megatron suffix, TP split dim or None for replicated)
_DIRECT = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", None),
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", 1),
}
_DENSE = {"mlp.down_proj.weight": ("mlp.linear_fc2.weight", 1)}  # gate/up: linear_fc1, below
_QK_NORM = {
    "self_attn.q_norm.weight": ("self_attention.q_layernorm.weight", None),
    "self_attn.k_norm.weight": ("self_attention.k_layernorm.weight", None),
}
_TOP = {
    "model.embed_tokens.weight": ("embedding.word_embeddings.weight", 0),
    "model.norm.weight": ("decoder.final_layernorm.weight", None),
    "lm_head.weight": ("output_layer.weight", 0),
}


def _qkv_blocks(s: GPTShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v (weights ``[rows, H]`` or biases ``[rows]``) -> Megatron's grouped layout ``[groups, per, d, ...]``."""
    per = s.num_heads // s.num_kv_heads
    tail = q.shape[1:]
    q = q.reshape(s.num_kv_heads, per, s.head_dim, *tail)
    k = k.reshape(s.num_kv_heads, 1, s.head_dim, *tail)
    v = v.reshape(s.num_kv_heads, 1, s.head_dim, *tail)
    return torch.cat([q, k, v], dim=1)


def hf_to_megatron(
    hf: dict[str, torch.Tensor], s: GPTShape, tp: int, rank: int, ep: int = 1, ep_rank: int = 0
) -> dict[str, torch.Tensor]:
    """TP rank ``rank``'s (and expert-parallel rank ``ep_rank``'s) Megatron shard of the HF state dict ``hf``.

    Of an MoE layer's ``E`` experts, expert-parallel rank ``ep_rank`` of ``ep`` holds the ``ep_rank``-th block of
    ``E / ep`` as its local experts ``0..E/ep-1``.

    Raises:
        ValueError: if KV heads, vocab, MLP rows or experts do not split over ``tp`` / ``ep``, or a tensor is missing.

    """
    if s.num_kv_heads % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} must divide num_key_value_heads={s.num_kv_heads}")
    if s.num_experts % ep:
        raise ValueError(f"expert_model_parallel_size={ep} must divide the model's {s.num_experts} experts")
    local = s.num_experts // ep
    out = {}

    def split(t: torch.Tensor, dim: int | None, name: str) -> torch.Tensor:
        if dim is None:
            return t.clone()
        if t.shape[dim] % tp:
            raise ValueError(f"{name}: dim {dim} of size {t.shape[dim]} does not split over {tp} TP ranks")
        return t.chunk(tp, dim=dim)[rank].clone()

    for hf_name, (mg_name, dim) in _TOP.items():
        if hf_name == "lm_head.weight" and s.tie_word_embeddings:
            continue
        out[mg_name] = split(hf[hf_name], dim, hf_name)
    for i in range(s.num_layers):
        h, m = _HF_LAYER.format(i), _MG_LAYER.format(i)
        moe = i in s.moe_layers
        direct = _DIRECT | (_QK_NORM if s.qk_norm else {}) | ({} if moe else _DENSE)
        for suffix, (mg_suffix, dim) in direct.items():
            out[m + mg_suffix] = split(hf[h + suffix], dim, h + suffix)
        kinds = ("weight", "bias") if s.qkv_bias else ("weight",)
        for kind in kinds:
            blocks = _qkv_blocks(s, *(hf[f"{h}self_attn.{p}_proj.{kind}"] for p in "qkv"))
            mine = blocks.chunk(tp, dim=0)[rank]
            out[f"{m}self_attention.linear_qkv.{kind}"] = mine.reshape(-1, *blocks.shape[3:]).clone()
        if moe:
            out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"].clone()
            gate_up, down = hf[h + "mlp.experts.gate_up_proj"], hf[h + "mlp.experts.down_proj"]
            for j in range(local):
                e = ep_rank * local + j
                expert, name = f"{m}mlp.experts.local_experts.{j}.", f"{h}mlp.experts[{e}]"
                gate, up = gate_up[e].chunk(2, dim=0)
                out[expert + "linear_fc1.weight"] = torch.cat([split(gate, 0, name), split(up, 0, name)])
                out[expert + "linear_fc2.weight"] = split(down[e], 1, name)
        else:
            gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
            out[m + "mlp.linear_fc1.weight"] = torch.cat(
                [split(gate, 0, h + "mlp.gate_proj.weight"), split(up, 0, h + "mlp.up_proj.weight")]
            )
    return out


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_FUSED = {"linear_fc1": "mlp.experts.gate_up_proj", "linear_fc2": "mlp.experts.down_proj"}


def megatron_sources(hf_name: str, s: GPTShape) -> list[str]:
    """The Megatron tensors an HF tensor is cut from.

    q/k/v share ``linear_qkv``, gate/up share ``linear_fc1``, and a fused expert tensor comes from every expert's.

    Raises:
        ValueError: for an HF name it does not know.

    """
    if hf_name in _TOP:
        return [_TOP[hf_name][0]]
    match = _HF_LAYER_RE.match(hf_name)
    if match:
        m, suffix = _MG_LAYER.format(match[1]), match[2]
        if suffix in _DIRECT | _QK_NORM | _DENSE:
            return [m + (_DIRECT | _QK_NORM | _DENSE)[suffix][0]]
        if suffix.startswith("self_attn.") and suffix.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
            return [m + "self_attention.linear_qkv." + suffix.rsplit(".", 1)[1]]
        if suffix in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            return [m + "mlp.linear_fc1.weight"]
        if suffix == "mlp.gate.weight":
            return [m + "mlp.router.weight"]
        fc = {v: k for k, v in _FUSED.items()}.get(suffix)
        if fc is not None:
            return [f"{m}mlp.experts.local_experts.{e}.{fc}.weight" for e in range(s.num_experts)]
    raise ValueError(f"megatron_sources: unknown HF tensor {hf_name!r}")


def megatron_to_hf(shards: dict[str, list[torch.Tensor]], s: GPTShape) -> dict[str, torch.Tensor]:
    """HF state dict from every TP rank's shard of each Megatron tensor (``shards[name][r]``, rank order).

    Raises:
        ValueError: for a Megatron name it does not know.

    """
    per = s.num_heads // s.num_kv_heads
    top = {mg: (hf, dim) for hf, (mg, dim) in _TOP.items()}
    direct = {mg: (hf, dim) for hf, (mg, dim) in (_DIRECT | _QK_NORM | _DENSE).items()}
    out = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}  # HF fused name -> expert -> its full tensor
    for name, parts in shards.items():
        if name in top:
            hf_name, dim = top[name]
            out[hf_name] = parts[0].clone() if dim is None else torch.cat(parts, dim=dim)
            continue
        match = _LAYER_RE.match(name)
        if not match:
            raise ValueError(f"megatron_to_hf: unknown tensor {name!r}")
        h, suffix = _HF_LAYER.format(match[1]), match[2]
        if suffix in direct:
            hf_suffix, dim = direct[suffix]
            out[h + hf_suffix] = parts[0].clone() if dim is None else torch.cat(parts, dim=dim)
        elif suffix.startswith("self_attention.linear_qkv."):
            kind = suffix.rsplit(".", 1)[1]
            full = torch.cat(parts, dim=0)
            blocks = full.reshape(s.num_kv_heads, per + 2, s.head_dim, *full.shape[1:])
            out[f"{h}self_attn.q_proj.{kind}"] = blocks[:, :per].reshape(-1, *full.shape[1:]).clone()
            out[f"{h}self_attn.k_proj.{kind}"] = blocks[:, per].reshape(-1, *full.shape[1:]).clone()
            out[f"{h}self_attn.v_proj.{kind}"] = blocks[:, per + 1].reshape(-1, *full.shape[1:]).clone()
        elif suffix == "mlp.linear_fc1.weight":
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = _gate_up(parts)
        elif suffix == "mlp.router.weight":
            out[h + "mlp.gate.weight"] = parts[0].clone()
        elif expert := _EXPERT_RE.match(suffix):
            fc = expert[2]
            full = torch.cat(_gate_up(parts)) if fc == "linear_fc1" else torch.cat(parts, dim=1)
            experts.setdefault(h + _FUSED[fc], {})[int(expert[1])] = full
        else:
            raise ValueError(f"megatron_to_hf: unknown tensor {name!r}")
    for hf_name, by_expert in experts.items():
        if sorted(by_expert) != list(range(s.num_experts)):
            raise ValueError(f"megatron_to_hf: {hf_name} needs experts 0..{s.num_experts - 1}, got {sorted(by_expert)}")
        out[hf_name] = torch.stack([by_expert[e] for e in range(s.num_experts)])
    return out  # a tied LM head stays implicit, as in HF's named_parameters()


def _gate_up(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Full gate and up rows from every TP rank's ``linear_fc1`` (each ``[gate rows of r, up rows of r]``)."""
    halves = [p.chunk(2, dim=0) for p in parts]
    return torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])


def expert_on_rank(name: str, num_local: int, ep_rank: int | None = None) -> str:
    """Renumber an expert tensor between the global name (as ``megatron_sources`` gives) and its local one.

    Expert ``e`` is local expert ``e % num_local`` of expert-parallel rank ``e // num_local``. Without ``ep_rank``
    a global name becomes its local one; with it, local expert ``j`` of rank ``ep_rank`` becomes global expert
    ``ep_rank * num_local + j``. Other names are returned as they are.
    """
    layer = _LAYER_RE.match(name)
    expert = _EXPERT_RE.match(layer[2]) if layer else None
    if expert is None:
        return name
    e = int(expert[1])
    renumbered = e % num_local if ep_rank is None else ep_rank * num_local + e
    return name.replace(f".local_experts.{e}.", f".local_experts.{renumbered}.")


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """The layers pipeline stage ``pp_rank`` of ``pp`` holds: an even split, in order.

    Raises:
        ValueError: if ``pp`` does not divide ``num_layers``.

    """
    if num_layers % pp:
        raise ValueError(f"pipeline_model_parallel_size={pp} must divide the model's num_hidden_layers={num_layers}")
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def on_stage(name: str, s: GPTShape, pp: int, pp_rank: int) -> str | None:
    """The name a Megatron tensor (layers numbered over the whole model) has on pipeline stage ``pp_rank``, or None.

    Stage 0 holds the embedding, the last stage the final norm and the output layer, each stage its layers
    (``stage_layers``) numbered from 0.
    """
    layer = _LAYER_RE.match(name)
    if layer is not None:
        layers = stage_layers(s.num_layers, pp, pp_rank)
        i = int(layer[1])
        return f"decoder.layers.{i - layers.start}.{layer[2]}" if i in layers else None
    if name.startswith("embedding."):
        return name if pp_rank == 0 else None
    return name if pp_rank == pp - 1 else None


def to_stage(state: dict[str, torch.Tensor], s: GPTShape, pp: int, pp_rank: int) -> dict[str, torch.Tensor]:
    """What pipeline stage ``pp_rank`` holds of a (TP/EP-sharded) Megatron state dict, under its stage names.

    With tied embeddings and several stages the last stage holds its own copy of the embedding as the output layer
    (megatron sums the two copies' gradients, so they stay equal).
    """
    out = {}
    for name, t in state.items():
        local = on_stage(name, s, pp, pp_rank)
        if local is not None:
            out[local] = t
    if s.tie_word_embeddings and pp > 1 and pp_rank == pp - 1:
        out["output_layer.weight"] = state["embedding.word_embeddings.weight"]
    return out


def from_stage(name: str, s: GPTShape, pp: int, pp_rank: int) -> str:
    """The model-wide name of pipeline stage ``pp_rank``'s tensor ``name`` (``on_stage``'s inverse)."""
    layer = _LAYER_RE.match(name)
    if layer is None:
        return name
    return f"decoder.layers.{int(layer[1]) + stage_layers(s.num_layers, pp, pp_rank).start}.{layer[2]}"
