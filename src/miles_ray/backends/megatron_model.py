"""Megatron-core model setup: the backend's typed config, and a ``GPTModel`` stage built from an HF checkpoint.

``MegatronBackendConfig`` (with ``MegatronParallelConfig``) is what ``TrainerGroup(backend={"kind": "megatron"})``
takes; ``build_gpt`` turns an HF Llama/Qwen2/Qwen3/Mixtral/Qwen3-MoE directory into this rank's shard of a
megatron-core ``GPTModel`` with the pure-PyTorch ("local") layer spec (``megatron_convert`` cuts the weights):
the TP / EP slice of its pipeline stage's layers. ``MegatronBackend`` (``megatron_backend``) trains it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from miles_ray.backends import megatron_cpu
from miles_ray.backends.megatron_convert import GPTShape, hf_to_megatron, stage_layers, to_stage
from miles_ray.backends.packing import MicroBatchConfig
from miles_ray.config import StrictConfig
from miles_ray.models.llama import LlamaArgs

# TransformerConfig fields this backend sets itself (from the HF config or the typed fields below)
_OWNED = set(
    """num_layers hidden_size num_attention_heads num_query_groups ffn_hidden_size kv_channels normalization
    gated_linear_unit activation_func add_bias_linear add_qkv_bias qk_layernorm layernorm_epsilon
    tensor_model_parallel_size
    pipeline_model_parallel_size context_parallel_size expert_model_parallel_size sequence_parallel
    recompute_granularity recompute_method recompute_num_layers params_dtype bf16 use_cpu_initialization
    gradient_accumulation_fusion pipeline_dtype variable_seq_lengths num_moe_experts moe_layer_freq moe_router_topk
    moe_ffn_hidden_size moe_router_pre_softmax moe_router_score_function moe_router_dtype""".split()
)


class MegatronParallelConfig(StrictConfig):
    """Megatron's parallel and recompute settings, passed to ``parallel_state`` and ``TransformerConfig``."""

    tensor_model_parallel_size: int = Field(1, ge=1, le=1024, description="TP: ranks one model is split across.")
    pipeline_model_parallel_size: int = Field(
        1,
        ge=1,
        le=1024,
        description="PP: stages the layers are split into (an even split), one rank each; a step's micro-batches go "
        "through megatron's 1F1B schedule.",
    )
    context_parallel_size: int = Field(
        1,
        ge=1,
        description="CP: only 1. megatron-core splits a sequence over ranks only in Transformer Engine's attention "
        "(CUDA); the pure-PyTorch layer spec this backend uses asserts CP=1.",
    )
    expert_model_parallel_size: int = Field(
        1,
        ge=1,
        le=1024,
        description="EP: ranks an MoE layer's experts are spread over (each holds experts / EP of them); the ranks of "
        "one expert-parallel group are data-parallel peers for everything else.",
    )
    sequence_parallel: bool = Field(False, description="Shard norms/dropout activations over the TP ranks.")
    recompute_granularity: Literal["full", "selective"] | None = Field(
        None, description="Activation recompute: 'full' layers or 'selective' (attention core); None: off."
    )
    recompute_method: Literal["uniform", "block"] | None = Field(None, description="With 'full': how layers group.")
    recompute_num_layers: int | None = Field(None, ge=1, description="With 'full': layers per recompute unit.")

    @model_validator(mode="after")
    def _check(self) -> MegatronParallelConfig:
        if self.context_parallel_size != 1:
            raise ValueError(
                f"context_parallel_size={self.context_parallel_size}: only 1 is supported (megatron-core's context "
                "parallelism runs in Transformer Engine's attention alone, which needs CUDA; this backend uses the "
                "pure-PyTorch layer spec)"
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1")
        if self.recompute_granularity == "full" and (self.recompute_method is None or not self.recompute_num_layers):
            raise ValueError("recompute_granularity='full' needs recompute_method and recompute_num_layers")
        return self


class MegatronBackendConfig(MicroBatchConfig):
    """Megatron-core backend of ``TrainerGroup`` (``backend={"kind": "megatron", ...}``)."""

    kind: Literal["megatron"] = "megatron"
    parallel: MegatronParallelConfig = Field(default_factory=MegatronParallelConfig, description="TP/PP/CP/EP.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Model dtype; bfloat16 keeps fp32 main params and grads in Megatron's optimizer."
    )
    num_threads: int = Field(1, ge=1, le=256, description="torch intra-op threads per rank.")
    tune_malloc: bool = Field(
        True,
        description="glibc only: keep freed host memory in the rank's heap (mallopt) so each step's large temporaries "
        "do not page-fault afresh; the resident size stays at the step's peak (devices.configure_host). Process-wide.",
    )
    seed: int = Field(1234, description="Seed of Megatron's RNG tracker (per-TP-rank states).")
    transformer_args: dict[str, Any] = Field(
        default_factory=dict,
        description="More megatron TransformerConfig fields, passed as is (checked against TransformerConfig at "
        "setup); the architecture and the fields above are set from the HF config and may not be given here.",
    )
    routing_replay: bool = Field(
        False,
        description="MoE: route every token through the experts the rollout engine recorded for it (R3), weighted "
        "by the trainer's router; off, the routes are only compared (moe_route_mismatch_frac).",
    )
    # the trainer reads these of any backend config; Megatron has no LoRA or low-precision recipe yet
    lora: None = Field(None, description="LoRA is not supported by the Megatron backend yet (None).")
    weight_format: None = Field(None, description="Low-precision recipes are not supported here yet (None).")

    @model_validator(mode="after")
    def _check_args(self) -> MegatronBackendConfig:
        owned = sorted(set(self.transformer_args) & _OWNED)
        if owned:
            raise ValueError(f"transformer_args may not set {owned}: they come from the HF config or `parallel`")
        return self


def _transformer_config(hf: dict, args: LlamaArgs, config: MegatronBackendConfig):
    from megatron.core.transformer import TransformerConfig

    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(config.transformer_args) - known)
    if unknown:
        raise ValueError(f"transformer_args: {unknown} are not megatron TransformerConfig fields")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu' for the Megatron backend, got {hf.get('hidden_act')!r}")
    p = config.parallel
    bf16 = config.dtype == "bfloat16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    extra = {
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        **(_MOE_DEFAULTS if args.moe_layers else {}),
        **config.transformer_args,
    }
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_heads,
        num_query_groups=args.num_kv_heads,
        kv_channels=args.head_dim,
        ffn_hidden_size=args.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=args.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=args.attention_bias,
        qk_layernorm=args.qk_norm,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        recompute_granularity=p.recompute_granularity,
        recompute_method=p.recompute_method,
        recompute_num_layers=p.recompute_num_layers,
        params_dtype=dtype,
        bf16=bf16,
        # pipeline stages exchange activations of this dtype, of one shape per step (the backend pads to it: megatron's
        # MoE all-gather dispatcher refuses variable_seq_lengths)
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        **_moe_args(args),
        **extra,
    )


def _moe_args(args: LlamaArgs) -> dict:
    """Megatron's MoE settings for an HF MoE config: HF's routing, megatron-core's layers (empty for a dense model).

    HF routes by softmax over all experts then top-k, renormalised with ``norm_topk_prob``; Megatron's router
    without ``pre_softmax`` takes the top-k logits then a softmax over them, which is the renormalised form, and
    with it the plain one. No load-balancing loss (HF trains without one unless ``output_router_logits``).
    """
    if not args.moe_layers:
        return {}
    return {
        "num_moe_experts": args.num_experts,
        "moe_layer_freq": [int(i in args.moe_layers) for i in range(args.num_layers)],
        "moe_router_topk": args.top_k,
        "moe_ffn_hidden_size": args.moe_intermediate_size,
        "moe_router_pre_softmax": not args.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
    }


# MoE settings a user may change through transformer_args (e.g. an auxiliary load-balancing loss)
_MOE_DEFAULTS = {
    "moe_router_load_balancing_type": "none",
    "moe_aux_loss_coeff": 0.0,
    "moe_token_dispatcher_type": "allgather",
}


class _SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm for megatron specs under sequence parallelism.

    megatron's torch-norm wrapper refuses sequence parallelism and its TE/apex norms need a GPU. Each TP rank
    normalises its own part of the sequence (or, for q/k norms, its own heads), so the weight is tagged
    ``sequence_parallel`` and ``finalize_model_grads`` sums its gradient over the TP ranks.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _with_norm(spec, norm: type):
    """``spec`` (megatron ModuleSpecs, submodule dataclasses, layer lists) with its torch norms replaced by ``norm``."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return norm
    if isinstance(spec, list):
        return [_with_norm(s, norm) for s in spec]
    if isinstance(spec, ModuleSpec) or (dataclasses.is_dataclass(spec) and not isinstance(spec, type)):
        for field in dataclasses.fields(spec):
            setattr(spec, field.name, _with_norm(getattr(spec, field.name), norm))
    return spec


def build_gpt(model_path: str, config: MegatronBackendConfig):
    """Megatron ``GPTModel`` shard of this TP / EP rank and pipeline stage with the HF weights at ``model_path``.

    Model parallelism must be initialised.

    Returns:
        ``(model, shape, hf_shapes)``: the module, its ``GPTShape`` and the HF name -> shape of every weight.

    Raises:
        ValueError: for an unsupported architecture, or a TP, EP or PP size the model does not split over.

    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from safetensors.torch import load_file

    from miles_ray.models.moe import fuse_checkpoint_experts

    hf = json.loads((Path(model_path) / "config.json").read_text())
    shape = GPTShape.from_hf_config(hf)  # refuses what the Megatron spec does not cover
    args = LlamaArgs.from_hf_config(hf)
    pp, pp_rank = config.parallel.pipeline_model_parallel_size, ps.get_pipeline_model_parallel_rank()
    stage_layers(args.num_layers, pp, pp_rank)  # refuses a PP size that does not divide the layers
    tconfig = _transformer_config(hf, args, config)
    tp = config.parallel.tensor_model_parallel_size
    if args.vocab_size % tp:
        raise ValueError(f"vocab_size={args.vocab_size} does not split over tensor_model_parallel_size={tp}")
    if args.moe_layers and tp > 1 and not config.parallel.sequence_parallel:
        raise ValueError(
            f"an MoE model at tensor_model_parallel_size={tp} needs parallel.sequence_parallel=True (megatron-core "
            "trains MoE layers under tensor parallelism only with it)"
        )
    ep = config.parallel.expert_model_parallel_size
    if ep > 1 and not args.moe_layers:
        raise ValueError(f"expert_model_parallel_size={ep} needs an MoE model; {model_path} is dense")
    if args.moe_layers:  # dense and MoE layers as moe_layer_freq says
        spec = get_gpt_decoder_block_spec(tconfig, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=args.qk_norm)
    if config.parallel.sequence_parallel:
        spec = _with_norm(copy.deepcopy(spec), _SequenceParallelRMSNorm)
    with megatron_cpu.cpu_devices():  # under PP a tied embedding's copies are summed at init, moved `.cuda()` first
        model = GPTModel(
            config=tconfig,
            transformer_layer_spec=spec,
            vocab_size=args.vocab_size,
            max_sequence_length=hf.get("max_position_embeddings", 4096),
            position_embedding_type="rope",
            rotary_base=args.rope_theta,
            share_embeddings_and_output_weights=shape.tie_word_embeddings,
            pre_process=ps.is_pipeline_first_stage(),  # the embedding
            post_process=ps.is_pipeline_last_stage(),  # the final norm and the output layer
        )
    state = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        state.update(load_file(f))
    if args.moe_layers:  # HF's in-memory (fused) expert names: what engines hold and syncs send
        state = fuse_checkpoint_experts(state, args.num_experts)
    tied = shape.tie_word_embeddings
    hf_shapes = {n: tuple(t.shape) for n, t in state.items() if not (tied and n == "lm_head.weight")}
    shard = hf_to_megatron(
        state, shape, tp, ps.get_tensor_model_parallel_rank(), ep, ps.get_expert_model_parallel_rank()
    )
    shard = to_stage(shard, shape, pp, pp_rank)
    dtype = tconfig.params_dtype
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in shard.items()}, strict=False)
    missing = [m for m in missing if not m.endswith("._extra_state")]
    if missing or unexpected:
        raise ValueError(f"{model_path}: Megatron weights missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model, shape, hf_shapes


def rope_at_positions(rope: torch.nn.Module) -> None:
    """Let Megatron's RoPE take per-token position ids (``rope.position_ids``, ``[B, L]``) instead of ``0..L-1``.

    Megatron's ``GPTModel`` applies rotary embeddings by sequence index alone (its ``position_ids`` feed learned
    absolute embeddings only); packed rows restart positions per segment and continue the prompt's in each response.
    The ``[L, B, 1, dim]`` table this returns broadcasts like Megatron's own ``[L, 1, 1, dim]`` one.
    """
    plain = rope.forward
    rope.position_ids = None

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if rope.position_ids is None:
            return plain(max_seq_len, offset, packed_seq, cp_group)
        table = rope.get_emb(int(rope.position_ids.max()) + 1)  # [P, 1, 1, dim]
        return table[rope.position_ids.t()][:, :, 0]  # [L, B, 1, dim]

    rope.forward = forward
