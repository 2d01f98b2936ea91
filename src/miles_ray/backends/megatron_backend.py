"""Megatron-core training backend: a GPT built from an HF Llama/Qwen2/Qwen3 (or MoE), TP/EP/PP, Megatron's optimizer.

One trainer rank per process, as with the torch backend: ranks form ``TP x PP x DP`` groups (``parallel_state``;
MoE layers spread their experts over EP of the DP ranks), each TP x PP group holds one model split across its
ranks and trains on one data-parallel shard. The model is megatron-core's ``GPTModel`` with the pure-PyTorch
("local") layer spec (``megatron_model.build_gpt``), so it runs on CPU with gloo as well as on GPUs (Transformer
Engine is not required); it trains under Megatron's DDP and optimizer (``get_megatron_optimizer``), its
micro-batches go through megatron's pipeline schedule under PP, it saves to / loads from ``dist_checkpointing``
checkpoints that reload under another layout, and leaves as HF-named tensors (gathered on rank 0) for the weight
broadcaster.

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

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles_ray.backends import megatron_cpu
from miles_ray.backends.megatron_convert import (
    expert_on_rank,
    from_stage,
    megatron_sources,
    megatron_to_hf,
    on_stage,
)
from miles_ray.backends.megatron_model import (
    MegatronBackendConfig,
    MegatronParallelConfig,
    build_gpt,
    rope_at_positions,
)
from miles_ray.backends.optimizer import OptimizerConfig
from miles_ray.backends.packing import micro_batches_of, pack_rows
from miles_ray.backends.routing import MegatronRouteTracker, track_routes
from miles_ray.backends.torch_parallel import (
    DataParallelOps,
    forward_backward_in_turn,
    load_rng,
    mark_fresh_optimizer,
    save_rng,
    saved_fresh,
)
from miles_ray.devices import configure_host, rank_device
from miles_ray.sync.buckets import Bucket, SyncPlan, pack, plan_buckets
from miles_ray.types import RolloutBatch

__all__ = ["MegatronBackend", "MegatronBackendConfig", "MegatronParallelConfig"]


def _sequence_pad(length: int, parallel: MegatronParallelConfig) -> int:
    """Tokens to add to a row of ``length`` so sequence parallelism splits it evenly over the TP ranks."""
    return -length % parallel.tensor_model_parallel_size if parallel.sequence_parallel else 0


def _grow_mask(blocked: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """A ``[N, 1, L, L]`` attention mask (True: blocked) grown to ``rows x length``: new tokens attend to themselves."""
    n, _, size, _ = blocked.shape
    out = (~torch.eye(length, dtype=torch.bool)).expand(rows, 1, length, length).clone()
    out[:n, :, :size, :size] = blocked
    return out


def _split_to(rows: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """``rows`` (micro-batches) cut into ``count``: the largest halved until there are as many.

    Raises:
        ValueError: if that needs more micro-batches than this rank has samples.

    """
    rows = list(rows)
    while len(rows) < count:
        i = max(range(len(rows)), key=lambda j: len(rows[j]), default=None)
        if i is None or len(rows[i]) < 2:
            raise ValueError(
                f"expert parallelism runs the forwards of the ranks exchanging tokens together: a peer has {count} "
                f"micro-batches, this rank {sum(len(r) for r in rows)} samples; give each rank more samples per step "
                "or raise micro_batch_size"
            )
        half = len(rows[i]) // 2
        rows[i : i + 1] = [rows[i][:half], rows[i][half:]]
    return rows


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
        p = config.parallel
        tp, ep, pp = p.tensor_model_parallel_size, p.expert_model_parallel_size, p.pipeline_model_parallel_size
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if self.world_size % (tp * pp):
            raise ValueError(
                f"tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} must divide the trainer's "
                f"num_ranks={self.world_size}"
            )
        if self.world_size % (tp * ep * pp):
            raise ValueError(
                f"expert_model_parallel_size={ep} x tensor_model_parallel_size={tp} x pipeline_model_parallel_size="
                f"{pp} must divide the trainer's num_ranks={self.world_size}"
            )
        if reference:
            raise ValueError("the Megatron backend keeps no on-rank KL reference: give TrainerGroup a ReferenceGroup")
        configure_host(config.num_threads, config.tune_malloc)
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
            )
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
        self.pp_group, self.pp_size = ps.get_pipeline_model_parallel_group(), pp
        self.pp_rank, self.pp_last = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_last_rank()
        self.last_stage = ps.is_pipeline_last_stage()
        self._step_shape: list[int] | None = None  # under PP: the [rows, length] every forward of a step runs at
        # the ranks whose MoE layers all-gather each other's tokens, when they hold different data
        self.token_group = ps.get_expert_tensor_and_model_parallel_group() if ep > 1 else None
        module, self.shape, self.hf_shapes = build_gpt(model_path, config)
        for name, param in module.named_parameters():
            if ".mlp.experts." in name:
                # megatron marks experts "expert-parallel" (their own optimizer, grads over expert-DP ranks) only at
                # EP > 1; marked at EP = 1 too, the optimizer has the same parts at every EP size, so an EP=2
                # checkpoint's optimizer state loads at EP=1 (expert-DP = DP there: the same reduction)
                param.allreduce = False
        self.hf_model = module.to(self.device)
        rope_at_positions(self.hf_model.rotary_pos_emb)  # packed rows give every token its own position
        self.routes = None  # MoE: the rollout's routes compared, or replayed with config.routing_replay
        if config.routing_replay or self.shape.moe_layers:
            if pp > 1 and p.recompute_granularity is not None:
                raise ValueError(
                    "an MoE model under pipeline_model_parallel_size > 1 takes no recompute_granularity: the 1F1B "
                    "schedule interleaves micro-batches, so a recomputed router would not see its own routes"
                )
            shard = (self.tp_rank, tp) if p.sequence_parallel else None
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
        """The batch's rows cut into micro-batches of whole shared-prefix segments (``backends.packing``).

        Under expert parallelism every rank exchanging tokens with this one runs as many forwards (megatron's
        dispatcher all-gathers tokens over them in each MoE layer), so the count is the largest of theirs: a
        collective over those ranks.
        """
        rows = micro_batches_of(batch, self.config)
        if self.token_group is None:
            return rows
        return _split_to(rows, self._token_group_max([len(rows)])[0])

    def _token_group_max(self, values: list[int]) -> list[int]:
        """``values`` maximised element-wise over the ranks exchanging MoE tokens with this one."""
        t = torch.tensor(values, dtype=torch.long, device=self._on())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.token_group)
        return t.tolist()

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
        if self.routes is None:
            return None
        counts = self.routes.take_mismatch()
        if self.pp_size > 1:  # each stage counts its own MoE layers
            t = torch.tensor(counts, dtype=torch.float64, device=self._on())
            dist.all_reduce(t, group=self.pp_group)
            counts = tuple(t.tolist())
        return counts

    def forward_logprobs(self, batch: RolloutBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T-1]`` next-token logprobs and entropies (vocab-parallel) of the trained tokens, 0 elsewhere.

        Packed (``config.packing``), a shared prompt is forwarded once for every sample that starts with it. Under
        pipeline parallelism, without gradients only (a step's forwards run in ``forward_backward``), the batch goes
        through megatron's schedule and the last stage's logprobs are broadcast to every stage.

        Raises:
            RuntimeError: under pipeline parallelism with gradients enabled.

        """
        if self.pp_size == 1:
            inputs, finish = self._inputs(batch, temperature)
            return finish(self._forward(*inputs))
        if torch.is_grad_enabled():
            raise RuntimeError("under pipeline parallelism a forward with gradients runs in forward_backward alone")
        out = torch.zeros(2, *batch.response_mask.shape, device=self.device)

        def keep(i: int, mb: RolloutBatch, lp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
            out.copy_(torch.stack([lp, entropy]))
            return lp.new_zeros(())

        self._schedule([batch], temperature, keep, forward_only=True)
        dist.broadcast(out, src=self.pp_last, group=self.pp_group)
        return out[0], out[1]

    def _inputs(self, batch: RolloutBatch, temperature: float):
        """``((input_ids, positions, blocked), finish)`` of a forward over ``batch``.

        ``finish(logits)`` turns the forward's logits into ``forward_logprobs``'s ``(logprobs, entropy)``.
        """
        p = self.config.packing
        if p is None:
            return self._padded_inputs(batch, temperature)
        packed = pack_rows(batch, p.share_prefix, p.max_row_tokens)
        targets = batch.input_ids[:, 1:][packed.source >= 0].to(self.device)

        def finish(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [R, L, V/tp]
            lp, entropy = _vocab_parallel_logprobs_entropy(packed.needed(logits)[None], targets[None], temperature)
            return packed.scatter(lp[0]), packed.scatter(entropy[0])

        # Megatron's masks are True where attention is not allowed
        return (packed.input_ids, packed.position_ids, ~packed.attention), finish

    def _padded_inputs(self, batch: RolloutBatch, temperature: float):
        """``_inputs`` of one padded row per sample: logprobs 0 before the first trained position."""
        input_ids = batch.input_ids.to(self.device)
        bsz, seq = input_ids.shape
        positions = torch.arange(seq).expand(bsz, seq)
        # right padding and causal attention: padded keys only ever follow the real tokens
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
        start = batch.first_trained_position()

        def finish(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [B, T, V/tp]
            lp, entropy = _vocab_parallel_logprobs_entropy(
                logits[:, start : seq - 1], input_ids[:, start + 1 :], temperature
            )
            pad = lp.new_zeros(bsz, start)
            return torch.cat([pad, lp], dim=1), torch.cat([pad, entropy], dim=1)

        return (batch.input_ids, positions, causal), finish

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        """The model's ``[rows, L, V/tp]`` logits for ``[rows, L]`` tokens at per-token ``positions``.

        With sequence parallelism megatron splits the sequence over the TP ranks, so rows are padded to a multiple
        of TP first; under expert parallelism, rows and length are padded to the largest of the ranks exchanging
        MoE tokens. Pad tokens attend to themselves alone and no real token attends to them.
        """
        rows, length = input_ids.shape
        shape = self._step_shape or self._forward_shape(rows, length)
        if shape != [rows, length]:
            input_ids = F.pad(input_ids, (0, shape[1] - length, 0, shape[0] - rows))
            positions = F.pad(positions, (0, shape[1] - length, 0, shape[0] - rows))
            blocked = _grow_mask(blocked.expand(rows, -1, -1, -1), *shape)
        if self.routes is not None:
            self.routes.layout(*shape)
        rope = self.hf_model.rotary_pos_emb
        rope.position_ids = positions.to(self.device)
        try:
            logits = self.model(input_ids.to(self.device), rope.position_ids, attention_mask=blocked.to(self.device))
        finally:
            rope.position_ids = None
        return logits[:rows, :length] if self.last_stage else logits  # earlier stages: [L, rows, hidden] activations

    def _forward_shape(self, rows: int, length: int) -> list[int]:
        """The ``[rows, length]`` a forward of ``rows x length`` tokens runs at.

        A multiple of TP long under sequence parallelism and, under expert parallelism, the largest of the ranks
        exchanging MoE tokens (which all-gather them: a collective over those ranks).
        """
        shape = [rows, length + _sequence_pad(length, self.config.parallel)]
        if self.token_group is not None:
            shape = self._token_group_max(shape)
        return shape

    def forward_backward(self, batches, temperature: float, loss_of, total_units: float) -> list[dict[str, float]]:
        """The micro-batches in turn (``torch_parallel.forward_backward_in_turn``), or through the pipeline schedule.

        Under pipeline parallelism the last stage computes each micro-batch's loss and its stats are broadcast to
        the other stages.
        """
        if self.pp_size == 1:
            return forward_backward_in_turn(self, batches, temperature, loss_of, total_units)
        stats: list = [None] * len(batches)

        def loss(i: int, mb: RolloutBatch, lp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
            value, units, stats[i] = loss_of(i, mb, lp, entropy)
            # its share of the global batch, as DataParallelOps.backward; the schedule divides by the micro-batches
            return value * (units / total_units * self.dp_size * len(batches))

        self._schedule(batches, temperature, loss, forward_only=False)
        box = [stats]
        dist.broadcast_object_list(box, src=self.pp_last, group=self.pp_group)
        return box[0]

    def _schedule(self, batches: list[RolloutBatch], temperature: float, on_logprobs, forward_only: bool) -> None:
        """``batches`` through megatron's pipeline schedule (1F1B; forwards only with ``forward_only``).

        Each stage runs its layers; the last one calls ``on_logprobs(i, batch, logprobs, entropy)`` for micro-batch
        ``i``'s loss, which the schedule backwards through every stage. Stages exchange activations of one shape, so
        every micro-batch is padded to the step's largest. Routes are followed around the forwards only: with no
        recompute (refused for MoE under PP) the backward does not run the routers again.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        prepared = [self._inputs(mb, temperature) for mb in batches]
        sizes = torch.tensor([inputs[0].shape for inputs, _ in prepared]).amax(dim=0).tolist()
        rows, length = self._forward_shape(*sizes)

        def step(data, model):
            i, mb = next(data)
            inputs, finish = prepared[i]
            with self.micro_batch(mb):
                out = self._forward(*inputs)
            return out, lambda logits: (on_logprobs(i, mb, *finish(logits)), {})

        self._step_shape = [rows, length]
        try:  # on CPU: the schedule counts tokens in a tensor it puts on "cuda" (each op pays the shim's dispatch)
            with megatron_cpu.cpu_devices():
                get_forward_backward_func()(
                    forward_step_func=step,
                    data_iterator=iter(enumerate(batches)),
                    model=[self.model],
                    num_microbatches=len(batches),
                    seq_length=length,
                    micro_batch_size=rows,
                    forward_only=forward_only,
                )
        finally:
            self._step_shape = None

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
        bad = 0.0 if math.isfinite(loss_sum) else 1.0  # the same on every pipeline stage (the stats are broadcast)
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
    def _hf_tensors(self, dtype: torch.dtype | None, names=None) -> dict[str, torch.Tensor]:
        """On rank 0: HF tensors (all, or those named) rebuilt from its TP group's shards; elsewhere ``{}``.

        In ``dtype``, or the model's where None. Collective over rank 0's TP group (a gather to rank 0) and, for MoE
        experts, over the expert-TP and expert-parallel ranks of rank 0's replica (each expert-parallel rank holds a
        block of the experts, each expert-TP rank a slice of them); the other replicas hold the same weights and do
        nothing. Under pipeline parallelism each stage gathers its own tensors so, then sends them to rank 0.
        """
        from megatron.core import parallel_state as ps

        names = set(self.hf_shapes) if names is None else set(names)
        stage = self.shape, self.pp_size, self.pp_rank  # names: model-wide layer numbers, this stage's tensors
        wanted = {w for n in names for w in megatron_sources(n, self.shape) if on_stage(w, *stage) is not None}
        local = {from_stage(name, *stage): t for name, t in self.hf_model.state_dict().items()}
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
        if self.pp_size > 1:
            shards = self._from_stages(shards)
        if self.rank != 0:
            return {}
        full = megatron_to_hf(shards, self.shape)
        return {n: t if dtype is None else t.to(dtype) for n, t in full.items() if n in names}

    def _from_stages(self, shards: dict[str, list[torch.Tensor] | None]) -> dict[str, list[torch.Tensor]]:
        """Every pipeline stage's gathered ``shards`` on rank 0 (from each stage's first rank: where they landed)."""
        if self.rank % (self.world_size // self.pp_size):  # not a stage's first rank: rank 0's pipeline group
            return {}
        mine = {name: [t.cpu() for t in parts] for name, parts in shards.items() if parts is not None}
        stages = [None] * self.pp_size if self.rank == 0 else None
        dist.gather_object(mine, stages, dst=0, group=self.pp_group)
        return {} if stages is None else {name: parts for stage in stages for name, parts in stage.items()}

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
        full = self._hf_tensors(None, {m.name for m in bucket.tensors})  # pack casts as it copies: one pass
        return pack(bucket, full, out) if self.rank == 0 else None

    def bucket_in_place(self, bucket: Bucket) -> None:
        """None: Megatron's parameters are never in the HF layout (fused QKV, TP shards), so a sync packs them."""
        return None

    def publish_in_place(self, dtype: torch.dtype, make_buffer: Callable[[int], torch.Tensor]) -> bool:
        """False: no bucket is in place (``bucket_in_place``)."""
        return False

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
        fresh = len(self.optimizer.state) == 0  # no step taken: Megatron would save no moments, which load then wants
        with megatron_cpu.cpu_devices():
            state = {"model": model_sd}
            if not fresh:
                state["optimizer"] = self.optimizer.sharded_state_dict(model_sd)
            dist_checkpointing.save(state, path)
        mark_fresh_optimizer(path, fresh)
        save_rng(path, self.rank)

    def load(self, path: str) -> None:
        """Collective: load a ``save`` checkpoint (model + optimizer), resharding to this TP size."""
        from megatron.core import dist_checkpointing

        fresh = saved_fresh(path)
        with megatron_cpu.cpu_devices():
            model_sd = self.hf_model.sharded_state_dict()
            wanted = {"model": model_sd}
            if not fresh:
                wanted["optimizer"] = self.optimizer.sharded_state_dict(model_sd, is_loading=True)
            state = dist_checkpointing.load(wanted, path)
            self.hf_model.load_state_dict(state["model"], strict=False)
            if fresh:  # the optimizer as before its first step
                for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                    opt.state.clear()
            else:
                self.optimizer.load_state_dict(state["optimizer"])
        load_rng(path, self.rank)
