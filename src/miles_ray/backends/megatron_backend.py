"""Megatron-core training backend: a GPT built from an HF Llama/Qwen2/Qwen3 (or MoE), TP, Megatron's optimizer.

One trainer rank per process, as with the torch backend: ranks form ``TP x DP`` groups (``parallel_state``),
each TP group holds one model split across its ranks and trains on one data-parallel shard. The model is
megatron-core's ``GPTModel`` with the pure-PyTorch ("local") layer spec, so it runs on CPU with gloo as well
as on GPUs (Transformer Engine is not required); weights come in from the HF directory
(``megatron_convert.hf_to_megatron``), train under Megatron's DDP and optimizer (``get_megatron_optimizer``),
save to / load from ``dist_checkpointing`` checkpoints that reload under another TP size, and leave as
HF-named tensors (gathered from rank 0's TP group) for the weight broadcaster.

The loss, advantages, KL and mismatch corrections are ``backends.rl_step.RLStep``, the same as for the torch
backend: this class implements the ``TrainBackend`` primitives (``forward_logprobs`` with vocab-parallel logprobs
and entropy, gradient reduction, clipped step, sums over the data-parallel group). On a machine without CUDA
``megatron_cpu.apply()`` maps megatron's few ``torch.cuda`` calls to the CPU first.

Usage (inside a rank whose ``torch.distributed`` default group spans all trainer ranks)::

    backend = MegatronBackend(MegatronBackendConfig(parallel={"tensor_model_parallel_size": 2}),
                              OptimizerConfig(lr=1e-5), model_path)
    metrics = RLStep(backend, objective).update(batch.shard(backend.dp_rank, backend.dp_size))
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import Field, model_validator

from miles_ray.backends import megatron_cpu
from miles_ray.backends.megatron_convert import (
    GPTShape,
    expert_on_rank,
    hf_to_megatron,
    megatron_sources,
    megatron_to_hf,
)
from miles_ray.backends.optimizer import OptimizerConfig
from miles_ray.backends.packing import MicroBatchConfig, micro_batches_of, pack_rows
from miles_ray.backends.routing import MegatronRouteTracker, track_routes
from miles_ray.backends.torch_parallel import DataParallelOps, load_rng, save_rng
from miles_ray.config import StrictConfig
from miles_ray.devices import rank_device
from miles_ray.models.llama import LlamaArgs
from miles_ray.sync.buckets import Bucket, SyncPlan, pack, plan_buckets
from miles_ray.types import RolloutBatch

# TransformerConfig fields this backend sets itself (from the HF config or the typed fields below)
_OWNED = set(
    """num_layers hidden_size num_attention_heads num_query_groups ffn_hidden_size kv_channels normalization
    gated_linear_unit activation_func add_bias_linear add_qkv_bias qk_layernorm layernorm_epsilon
    tensor_model_parallel_size
    pipeline_model_parallel_size context_parallel_size expert_model_parallel_size sequence_parallel
    recompute_granularity recompute_method recompute_num_layers params_dtype bf16 use_cpu_initialization
    gradient_accumulation_fusion num_moe_experts moe_layer_freq moe_router_topk moe_ffn_hidden_size
    moe_router_pre_softmax moe_router_score_function moe_router_dtype""".split()
)


class MegatronParallelConfig(StrictConfig):
    """Megatron's parallel and recompute settings, passed to ``parallel_state`` and ``TransformerConfig``."""

    tensor_model_parallel_size: int = Field(1, ge=1, le=1024, description="TP: ranks one model is split across.")
    pipeline_model_parallel_size: int = Field(1, ge=1, le=1, description="PP: only 1 is supported yet.")
    context_parallel_size: int = Field(1, ge=1, le=1, description="CP: only 1 is supported yet.")
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
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
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
    """Megatron ``GPTModel`` shard of this TP rank with the HF weights at ``model_path`` (model parallel initialised).

    Returns:
        ``(model, shape, hf_shapes)``: the module, its ``GPTShape`` and the HF name -> shape of every weight.

    Raises:
        ValueError: for an unsupported architecture or a TP size the model does not split over.

    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from safetensors.torch import load_file

    from miles_ray.models.moe import fuse_checkpoint_experts

    hf = json.loads((Path(model_path) / "config.json").read_text())
    shape = GPTShape.from_hf_config(hf)  # refuses what the Megatron spec does not cover
    args = LlamaArgs.from_hf_config(hf)
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
    model = GPTModel(
        config=tconfig,
        transformer_layer_spec=spec,
        vocab_size=args.vocab_size,
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        rotary_base=args.rope_theta,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
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
    dtype = tconfig.params_dtype
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in shard.items()}, strict=False)
    missing = [m for m in missing if not m.endswith("._extra_state")]
    if missing or unexpected:
        raise ValueError(f"{model_path}: Megatron weights missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model, shape, hf_shapes


def _rope_at_positions(rope: torch.nn.Module) -> None:
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


def _sequence_pad(length: int, parallel: MegatronParallelConfig) -> int:
    """Tokens to add to a row of ``length`` so sequence parallelism splits it evenly over the TP ranks."""
    return -length % parallel.tensor_model_parallel_size if parallel.sequence_parallel else 0


def _pad_mask(blocked: torch.Tensor, pad: int) -> torch.Tensor:
    """A ``[N, 1, L, L]`` attention mask (True: blocked) grown by ``pad`` tokens that attend to themselves alone."""
    n, _, length, _ = blocked.shape
    size = length + pad
    out = (~torch.eye(size, dtype=torch.bool)).expand(n, 1, size, size).clone()
    out[:, :, :length, :length] = blocked
    return out


def _vocab_parallel_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Logprob of ``targets`` and entropy from vocab-sharded logits ``[B, K, V/tp]`` (differentiable, no gather)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region, vocab_parallel_cross_entropy

    logits = logits.float() / temperature
    with torch.no_grad():
        shift = logits.max(dim=-1, keepdim=True).values
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    z = logits - shift
    e = z.exp()
    total = reduce_from_tensor_model_parallel_region(torch.stack([e.sum(-1), (e * z).sum(-1)]))
    entropy = total[0].log() - total[1] / total[0]  # H = log sum e^z - sum e^z z / sum e^z
    # last: megatron's cross entropy works in place on the logits it is given (saves a [B, K, V/tp] copy)
    return -vocab_parallel_cross_entropy(logits, targets), entropy


def _megatron_optimizer(model, optim: OptimizerConfig, config: MegatronBackendConfig):
    from megatron.core.optimizer import OptimizerConfig as MOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    bf16 = config.dtype == "bfloat16"
    mconfig = MOptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.grad_clip,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=False,
    )
    return get_megatron_optimizer(mconfig, [model])


class MegatronBackend(DataParallelOps):
    """One rank of a Megatron-core policy: ``TP x DP`` ranks, Megatron DDP and optimizer, HF weights in and out.

    Sums, gathers and the backward's share come from ``DataParallelOps`` over Megatron's data-parallel group (TP
    peers hold the same data shard).

    Raises:
        ValueError: for a world size the TP size does not divide, an unsupported architecture, or an on-rank
            KL reference (serve it from a ``ReferenceGroup``).

    """

    def __init__(self, config: MegatronBackendConfig, optim: OptimizerConfig, model_path: str, reference: bool = False):
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        megatron_cpu.apply()
        tp, ep = config.parallel.tensor_model_parallel_size, config.parallel.expert_model_parallel_size
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if self.world_size % tp:
            raise ValueError(f"tensor_model_parallel_size={tp} must divide the trainer's num_ranks={self.world_size}")
        if self.world_size % (tp * ep):
            raise ValueError(
                f"expert_model_parallel_size={ep} x tensor_model_parallel_size={tp} must divide the trainer's "
                f"num_ranks={self.world_size}"
            )
        if reference:
            raise ValueError("the Megatron backend keeps no on-rank KL reference: give TrainerGroup a ReferenceGroup")
        torch.set_num_threads(config.num_threads)
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
        self.config = config
        self.optim_config = optim
        self.model_path = model_path
        self.device = rank_device()
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_size = tp
        module, self.shape, self.hf_shapes = build_gpt(model_path, config)
        for name, param in module.named_parameters():
            if ".mlp.experts." in name:
                # megatron marks experts "expert-parallel" (their own optimizer, grads over expert-DP ranks) only at
                # EP > 1; marked at EP = 1 too, the optimizer has the same parts at every EP size, so an EP=2
                # checkpoint's optimizer state loads at EP=1 (expert-DP = DP there: the same reduction)
                param.allreduce = False
        self.hf_model = module.to(self.device)
        _rope_at_positions(self.hf_model.rotary_pos_emb)  # packed rows give every token its own position
        self.routes = None  # MoE: the rollout's routes compared, or replayed with config.routing_replay
        if config.routing_replay or self.shape.moe_layers:
            shard = (self.tp_rank, tp) if config.parallel.sequence_parallel else None
            self.routes = MegatronRouteTracker(self.hf_model, replay=config.routing_replay, sequence_shard=shard)
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        self.model = DistributedDataParallel(config=module.config, ddp_config=ddp, module=self.hf_model)
        with megatron_cpu.cpu_devices():
            self.optimizer = _megatron_optimizer(self.model, optim, config)
        self.reference = None  # always served by a ReferenceGroup (refused above)
        self.model.zero_grad_buffer()

    # --- the primitives RLStep drives (backends.interface.TrainBackend) ----------------------------------------------
    def micro_batches(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """The batch's rows cut into micro-batches of whole shared-prefix segments (``backends.packing``)."""
        return micro_batches_of(batch, self.config)

    def train(self, mode: bool = True) -> None:
        """Training or evaluation mode."""
        self.model.train(mode)

    def micro_batch(self, batch: RolloutBatch):
        """Context for a forward (and its backward) over ``batch``: compare / replay its routes (MoE).

        Raises:
            ValueError: with ``routing_replay`` on and a batch that carries no routes.

        """
        p = self.config.packing
        packed = None if self.routes is None or p is None else pack_rows(batch, p.share_prefix, p.max_row_tokens)
        return track_routes(self.routes, batch, packed, self.config.routing_replay)

    def route_counts(self) -> tuple[float, float] | None:
        """MoE: ``(differing, recorded)`` (token, layer) expert sets since the last call, reset; else None."""
        return None if self.routes is None else self.routes.take_mismatch()

    def forward_logprobs(self, batch: RolloutBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T-1]`` next-token logprobs and entropies (vocab-parallel) of the trained tokens, 0 elsewhere.

        Packed (``config.packing``), a shared prompt is forwarded once for every sample that starts with it.
        """
        p = self.config.packing
        if p is None:
            return self._padded_logprobs(batch, temperature)
        packed = pack_rows(batch, p.share_prefix, p.max_row_tokens)
        blocked = ~packed.attention  # Megatron's masks are True where attention is not allowed
        logits = self._forward(packed.input_ids, packed.position_ids, blocked)  # [R, L, V/tp]
        targets = batch.input_ids[:, 1:][packed.source >= 0].to(self.device)
        lp, entropy = _vocab_parallel_logprobs_entropy(packed.needed(logits)[None], targets[None], temperature)
        return packed.scatter(lp[0]), packed.scatter(entropy[0])

    def _padded_logprobs(self, batch: RolloutBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_logprobs`` on one padded row per sample, 0 before the first trained position."""
        input_ids = batch.input_ids.to(self.device)
        bsz, seq = input_ids.shape
        positions = torch.arange(seq).expand(bsz, seq)
        # right padding and causal attention: padded keys only ever follow the real tokens
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
        logits = self._forward(batch.input_ids, positions, causal)  # [B, T, V/tp]
        start = batch.first_trained_position()
        lp, entropy = _vocab_parallel_logprobs_entropy(
            logits[:, start : seq - 1], input_ids[:, start + 1 :], temperature
        )
        pad = lp.new_zeros(bsz, start)
        return torch.cat([pad, lp], dim=1), torch.cat([pad, entropy], dim=1)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        """The model's ``[rows, L, V/tp]`` logits for ``[rows, L]`` tokens at per-token ``positions``.

        With sequence parallelism megatron splits the sequence over the TP ranks, so rows are padded to a multiple
        of TP first: pad tokens attend to themselves alone and no real token attends to them.
        """
        length = input_ids.shape[1]
        pad = _sequence_pad(length, self.config.parallel)
        if pad:
            input_ids, positions = F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad))
            blocked = _pad_mask(blocked, pad)
        rope = self.hf_model.rotary_pos_emb
        rope.position_ids = positions.to(self.device)
        try:
            logits = self.model(input_ids.to(self.device), rope.position_ids, attention_mask=blocked.to(self.device))
        finally:
            rope.position_ids = None
        return logits[:, :length]

    def grad_sync(self, enabled: bool) -> None:
        """Gradients accumulate in Megatron's grad buffers; they are reduced once, before the step."""

    def clip_and_step(self, loss_sum: float = 0.0) -> tuple[float, bool]:
        """Reduce the grads, then Megatron's optimizer clips and steps (skipped if not finite).

        ``finalize_model_grads`` reduces the grad buffers over DP and, over the TP ranks, the grads megatron computes
        per rank: q/k layernorms (each rank normalises its own heads), sequence-parallel norms and MoE routers.
        """
        from megatron.core.distributed import finalize_model_grads

        with megatron_cpu.cpu_devices():
            finalize_model_grads([self.model])
        bad = 0.0 if math.isfinite(loss_sum) else 1.0
        skipped = self.global_sum([bad])[0] > 0
        norm = float("nan")
        if not skipped:
            with megatron_cpu.cpu_devices():
                ok, grad_norm, _ = self.optimizer.step()
            norm = float(grad_norm) if grad_norm is not None else float("nan")
            skipped = not ok or not math.isfinite(norm)
        self.optimizer.zero_grad()
        self.model.zero_grad_buffer()
        return norm, skipped

    # --- weights out -----------------------------------------------------------------------------
    def _hf_tensors(self, dtype: torch.dtype, names=None) -> dict[str, torch.Tensor]:
        """On rank 0: HF tensors (all, or those named) rebuilt from its TP group's shards; elsewhere ``{}``.

        Collective over rank 0's TP group (a gather to rank 0) and, for MoE experts, over the expert-TP and expert-
        parallel ranks of rank 0's replica (each expert-parallel rank holds a block of the experts, each expert-TP
        rank a slice of them); the other replicas hold the same weights and do nothing.
        """
        from megatron.core import parallel_state as ps

        names = set(self.hf_shapes) if names is None else set(names)
        wanted = {source for n in names for source in megatron_sources(n, self.shape)}
        local = self.hf_model.state_dict()
        shards = {}
        if self.dp_rank == 0:
            for name in sorted(w for w in wanted if ".local_experts." not in w):  # the same order on every rank
                shards[name] = self._gather(local[name], self.tp_group, self.tp_size, self.tp_rank)
        num_local = self.shape.num_experts // self.config.parallel.expert_model_parallel_size
        experts = sorted({expert_on_rank(w, num_local) for w in wanted if ".local_experts." in w})
        if experts and ps.get_expert_data_parallel_rank() == 0:  # the expert-TP x EP ranks of rank 0's replica
            etp = ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size()
            etp_rank = ps.get_expert_tensor_parallel_rank()
            ep = ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_world_size()
            for name in experts:
                slices = self._gather(local[name], *etp, etp_rank)  # this block's expert, every TP slice
                if etp_rank != 0:
                    continue
                for part in slices:  # then each slice of the same local expert of every EP rank
                    for r, piece in enumerate(self._gather(part, *ep, ps.get_expert_model_parallel_rank()) or ()):
                        shards.setdefault(expert_on_rank(name, num_local, r), []).append(piece)
        if self.rank != 0:
            return {}
        full = megatron_to_hf(shards, self.shape)
        return {n: t.to(dtype) for n, t in full.items() if n in names}

    @staticmethod
    def _gather(tensor: torch.Tensor, group, size: int, rank: int) -> list[torch.Tensor] | None:
        """Every member's ``tensor`` on the group's first rank (a list in group-rank order); None elsewhere."""
        p = tensor.detach().contiguous()
        parts = [torch.empty_like(p) for _ in range(size)] if rank == 0 else None
        dist.gather(p, parts, group=group, group_dst=0)
        return parts

    def sync_plan(self, dtype: torch.dtype, bucket_bytes: int) -> SyncPlan:
        """Bucket plan over the HF-named, HF-shaped tensors (as the engines hold them), cast to ``dtype``.

        Not a collective (the broadcaster asks rank 0 alone): names and shapes are the HF checkpoint's.
        """
        return plan_buckets([(n, shape, dtype) for n, shape in self.hf_shapes.items()], bucket_bytes)

    def gather_bucket(self, bucket: Bucket, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Collective (the bucket's sources gathered to rank 0): one flat HF-layout tensor on rank 0 (into ``out``)."""
        full = self._hf_tensors(dtype, {m.name for m in bucket.tensors})
        return pack(bucket, full, out) if self.rank == 0 else None

    def hf_state(self, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor] | None, None]:
        """Collective: the HF-named weights on rank 0 (a tied head once), None elsewhere; no adapters."""
        full = self._hf_tensors(dtype)
        return (full if self.rank == 0 else None), None

    # --- checkpoints ----------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Collective: model + optimizer as a ``dist_checkpointing`` checkpoint (reloadable at another TP size)."""
        from megatron.core import dist_checkpointing

        Path(path).mkdir(parents=True, exist_ok=True)
        model_sd = self.hf_model.sharded_state_dict()
        with megatron_cpu.cpu_devices():
            state = {"model": model_sd, "optimizer": self.optimizer.sharded_state_dict(model_sd)}
            dist_checkpointing.save(state, path)
        save_rng(path, self.rank)

    def load(self, path: str) -> None:
        """Collective: load a ``save`` checkpoint (model + optimizer), resharding to this TP size."""
        from megatron.core import dist_checkpointing

        with megatron_cpu.cpu_devices():
            model_sd = self.hf_model.sharded_state_dict()
            wanted = {"model": model_sd, "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=True)}
            state = dist_checkpointing.load(wanted, path)
            self.hf_model.load_state_dict(state["model"], strict=False)
            self.optimizer.load_state_dict(state["optimizer"])
        load_rng(path, self.rank)
