"""TrainerGroup: N trainer ranks as Ray actors forming one ``torch.distributed`` group (gloo on CPU, NCCL on GPU).

``TrainerGroup`` is the actor a driver talks to; it creates one ``TrainerWorker`` per trainer slot of the
placement plan and fans calls out to all of them (every call is collective). Each worker fetches the
sample groups it is given from the object store and runs the RL step (``backends.rl_step.RLStep``: shaping,
advantages, the loss) through its backend (torch or Megatron) on its shard.
The group owns the weight version: it goes up by one with every optimizer step.

Usage::

    trainer = TrainerGroup.options(name="miles_ray/trainer").remote(TrainerGroupConfig(model_path=p), placement)
    metrics = ray.get(trainer.train_step.remote(group_refs))
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import ray
import torch
from pydantic import Field, model_validator

from miles_ray.actors.workers import Worker, from_masked_lists, masked_lists, start_workers
from miles_ray.backends import rl_step
from miles_ray.backends.megatron_model import MegatronBackendConfig
from miles_ray.backends.objectives import ObjectiveConfig
from miles_ray.backends.optimizer import OptimizerConfig
from miles_ray.backends.torch_parallel import TorchBackendConfig
from miles_ray.config import StrictConfig, kind_union
from miles_ray.hooks import HookContext, Hooks, TrainerHooksConfig
from miles_ray.placement.groups import Placement
from miles_ray.sync.buckets import SyncPlan
from miles_ray.sync.checksum import sent_checksums
from miles_ray.sync.digest import TensorDigests
from miles_ray.sync.shm import BucketBuffers, fill_buckets, handle_of, hash_buckets, put_bucket, shared_buffer

logger = logging.getLogger(__name__)


class ProfilerConfig(StrictConfig):
    """torch profiler capture of chosen train steps, one Chrome trace per rank and step."""

    steps: list[int] = Field(..., min_length=1, description="Train steps to capture (0 = the first train_step call).")
    out_dir: str = Field(..., description="Directory of the traces: trace_step<k>_rank<r>.json (chrome://tracing).")
    record_shapes: bool = Field(False, description="Record operator input shapes.")
    with_stack: bool = Field(False, description="Record Python stacks (larger traces).")
    profile_memory: bool = Field(False, description="Record tensor memory allocation.")


BackendConfig = kind_union(TorchBackendConfig, MegatronBackendConfig, default="torch")


class TrainerGroupConfig(ObjectiveConfig):
    """The trainer: model, ranks, backend and optimizer, plus the RL objective (``ObjectiveConfig``'s fields)."""

    model_path: str = Field(..., description="HF model directory the policy starts from.")
    num_ranks: int = Field(
        1, ge=1, le=65536, description="Trainer ranks: data-parallel ranks, times the TP size with Megatron."
    )
    backend: BackendConfig = Field(
        default_factory=TorchBackendConfig, description="Training backend: torch (default) or megatron (kind)."
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer settings.")
    hooks: TrainerHooksConfig = Field(
        default_factory=TrainerHooksConfig, description="User callables run on every rank at fixed points."
    )
    seed: int = Field(0, description="torch seed on every rank.")
    profile: ProfilerConfig | None = Field(None, description="Capture torch profiler traces of some train steps.")

    @model_validator(mode="after")
    def _check_parallel(self) -> TrainerGroupConfig:
        tp = self.backend.parallel.tensor_model_parallel_size if self.backend.kind == "megatron" else 1
        if self.num_ranks % tp:
            raise ValueError(
                f"num_ranks={self.num_ranks} must be a multiple of backend.parallel.tensor_model_parallel_size={tp}"
            )
        return self


class TrainerWorker(Worker):
    """One trainer rank (apply ``ray.remote`` via ``TrainerGroup``): a backend and the RL step that drives it."""

    def __init__(self, rank: int, world_size: int, config: TrainerGroupConfig, external_reference: bool = False):
        super().__init__(rank, world_size, config)
        self.external_reference = external_reference
        self.step = None
        self._sync_group = None
        self._sync_store = None  # rank 0: the broadcast group's rendezvous store, between host_ and join_sync_group
        self._sync_buffers: dict[bool, BucketBuffers] = {}  # rank 0: persistent bucket buffers, private and shared
        self._shared: tuple[SyncPlan, list[torch.Tensor]] | None = None  # rank 0: the last shared sync's buckets
        self._steps = 0  # train_step calls on this rank, for ProfilerConfig.steps

    def setup(self) -> None:
        """Build the backend (model, optimizer, on-rank reference unless a ReferenceGroup serves it), step and hooks."""
        c = self.config
        if c.backend.kind == "megatron":
            from miles_ray.backends.megatron_backend import MegatronBackend as Backend
        else:
            from miles_ray.backends.torch_backend import TorchBackend as Backend
        reference = c.kl is not None and not self.external_reference
        self.backend = Backend(c.backend, c.optimizer, c.model_path, reference=reference)
        self.step = rl_step.RLStep(self.backend, c)
        self.hooks = Hooks(c.hooks)
        self.ctx = HookContext(self.rank, self.world_size, self.backend.model, self.backend.optimizer, c)
        self.hooks.call("after_init", self.ctx)

    def train_step(
        self, group_refs: list, values: list[list[float]] | None = None, ref_logprobs: list[list[float]] | None = None
    ) -> tuple[dict[str, float], list[list[float]] | None]:
        """Train one optimizer step on this rank's shard of the groups' samples.

        Args:
            group_refs: the whole batch's groups (every rank gets all of them).
            values: the critic's values per sample (trained tokens), for GAE.
            ref_logprobs: a ``ReferenceGroup``'s logprobs per sample, for the KL terms.

        Returns:
            ``(metrics, returns)``: with GAE, rank 0 also returns the critic's targets per sample.

        """
        p, step = self.config.profile, self._steps
        self._steps += 1
        if p is None or step not in p.steps:
            return self._train_step(group_refs, values, ref_logprobs)
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        opts = {"record_shapes": p.record_shapes, "with_stack": p.with_stack, "profile_memory": p.profile_memory}
        with profile(activities=activities, **opts) as prof:
            out = self._train_step(group_refs, values, ref_logprobs)
        os.makedirs(p.out_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(p.out_dir, f"trace_step{step}_rank{self.rank}.json"))
        return out

    def _train_step(self, group_refs: list, values, ref_logprobs):
        batch, samples = self.batch(group_refs)
        mask = batch.response_mask
        values = None if values is None else from_masked_lists(values, mask, "values")
        ref = None if ref_logprobs is None else from_masked_lists(ref_logprobs, mask, "ref_logprobs")
        returns, batch_metrics = self.step.prepare(batch, samples, values, ref)
        shard = batch.shard(*self.data_shard)
        self.hooks.call("before_train_step", self.ctx, shard)
        metrics = self.step.update(shard, None if ref is None else batch.shard_rows(ref, *self.data_shard))
        metrics.update(batch_metrics)
        metrics.update(self.hooks.call("after_train_step", self.ctx, metrics))
        if returns is None or self.rank != 0:
            return metrics, None
        return metrics, masked_lists(returns, mask)

    def compute_logprobs(self, group_refs: list) -> list[list[float]] | None:
        """Every sample's response-token logprobs under the current weights (rank 0 returns them).

        The ``before_logprobs`` hooks see the shard with rewards shaped and advantages filled where they need no
        critic values (GAE) or KL penalty.
        """
        batch, samples = self.batch(group_refs)
        if self.config.advantage.kind != "gae":
            self.step.advantages(batch, samples)
        shard = batch.shard(*self.data_shard)
        self.hooks.call("before_logprobs", self.ctx, shard)
        return self.gather_masked(batch, rl_step.logprobs(self.backend, shard, self.config.temperature))

    # --- weight sync ----------------------------------------------------------------------------
    def sync_plan(self, dtype: str, bucket_bytes: int) -> SyncPlan:
        """The bucket plan of this model's parameters in ``dtype``."""
        return self.backend.sync_plan(getattr(torch, dtype), bucket_bytes)

    def host_sync_group(self, world_size: int) -> tuple[str, int]:
        """Rank 0: open the weight-broadcast group's rendezvous store (``open_store``: no port race); host and port."""
        from miles_ray.sync.broadcast import open_store

        host = ray.util.get_node_ip_address()
        self._sync_store = open_store(host, world_size)
        return host, self._sync_store.port

    def join_sync_group(self, world_size: int, collective: str) -> None:
        """Rank 0 joins the weight-broadcast group as its root, on the store ``host_sync_group`` opened."""
        from miles_ray.sync.broadcast import BroadcastGroup

        store, self._sync_store = self._sync_store, None
        if self._sync_group is not None:  # a re-formed group (respawned engine): leave the old one first
            self._sync_group.close()
        self._sync_group = BroadcastGroup.create(store.host, store.port, 0, world_size, collective, store=store)

    def _gather(self, plan: SyncPlan, shared: bool | None = None, published: bool = False):
        """Collective: each bucket gathered on rank 0, as ``(bucket, flat, source)``.

        A bucket the parameters already hold in its layout (``bucket_in_place``) comes with that memory as
        ``source``, and as ``flat`` too (nothing packed; nothing writes it until the sync returns); unless ``shared``
        (engines map the buffers and compute on them while the parameters change) and not ``published``
        (``publish_in_place``: the memory stays unwritten while engines compute on it): then ``flat`` is the bucket's
        buffer of ``_buffers(plan, True)``, which the caller fills from ``source``. Other buckets are packed into
        ``flat``, a buffer of ``_buffers(plan, shared)`` (made only if some bucket needs one) or a new tensor where
        ``shared`` is None, with ``source`` None.
        """
        buffers = None
        for i, bucket in enumerate(plan.buckets):
            source = self.backend.bucket_in_place(bucket)
            if source is not None and (not shared or published):
                yield bucket, source, source
                continue
            if buffers is None and shared is not None:
                buffers = self._buffers(plan, shared)
            if source is not None:
                yield bucket, buffers[i].view(bucket.dtype), source
                continue
            out = None if buffers is None else buffers[i].view(bucket.dtype)
            yield bucket, self.backend.gather_bucket(bucket, bucket.dtype, out), None

    def _publish(self, plan: SyncPlan) -> bool:
        """Rank 0: whether engines may compute on the memory the plan's buckets lie in (``publish_in_place``)."""
        dtypes = {bucket.dtype for bucket in plan.buckets}
        return len(dtypes) == 1 and self.backend.publish_in_place(dtypes.pop(), lambda n: shared_buffer(n)[0])

    def _buffers(self, plan: SyncPlan, shared: bool) -> list[torch.Tensor] | None:
        """Rank 0's persistent bucket buffers: shared ones alternate (engines compute on the last set)."""
        if self.rank != 0:
            return None
        if shared not in self._sync_buffers:
            self._sync_buffers[shared] = BucketBuffers(shared=shared, alternate=shared)
        return self._sync_buffers[shared].next(plan)

    def broadcast_weights(
        self, plan: SyncPlan, verify: bool, kinds: tuple[str, ...] = ("full",), sample: int | None = None
    ) -> dict | None:
        """Collective: gather each bucket; rank 0 broadcasts it and returns the ``kinds`` checksums if ``verify``.

        ``sample``: the ``full`` checksum reads every byte (None) or is sampled (``sync.digest``).

        Rank 0 queues each bucket's broadcast as soon as it is gathered (gloo's or NCCL's own thread sends them in
        order, so the wire never waits for this thread), then hashes it and gathers the next meanwhile; buckets are
        gathered into buffers kept from sync to sync, or sent from the parameters' memory (``_gather``).
        """
        sent, works = [], []
        digests = TensorDigests(sample) if verify and "full" in kinds else None
        for bucket, flat, _ in self._gather(plan, shared=False):
            if self.rank == 0:
                works.append(self._sync_group.broadcast(flat.view(torch.uint8), async_op=True))  # SGLang's layout
                if digests is not None:  # hashed while on the wire
                    digests.add_bucket(bucket, flat)
                sent.append(flat)
        for work in works:
            work.wait()
        if self.rank != 0 or not verify:
            return None
        checksums = sent_checksums(plan, sent, [k for k in kinds if k != "full"])
        return {**checksums, "full": digests.hexdigest()} if digests is not None else checksums

    def share_weight_buckets(
        self, plan: SyncPlan, to_store: bool, verify: bool, sample: int | None = None
    ) -> dict | None:
        """Collective: gather each bucket into rank 0's shared-memory buffers (colocated sync).

        Where the backend publishes the memory the buckets lie in (``publish_in_place``: a bf16 weight copy), engines
        get that memory itself and nothing is copied.

        Returns:
            On rank 0 ``{"shared": [SharedBucket], "refs": [ObjectRef] | None, "digests", "full"}``: the buckets'
            handles, for every engine on this node; object-store copies for the others (``to_store``); if
            ``verify``, the per-tensor digests (of a bucket the parameters hold in its layout taken as it is copied,
            ``fill_buckets``; of a packed one on a second thread while the next is gathered) and the ``full``
            checksum they combine to (``sample``: sampled digests, ``sync.digest``). None on the other ranks.
            ``shared_checksums`` gives any other checksum kind of what was sent.

        """
        digests = TensorDigests(sample) if verify and self.rank == 0 else None
        published = self.rank == 0 and self._publish(plan)
        flats, hashed, copies, in_place = [], [], [], []
        with ThreadPoolExecutor(1, thread_name_prefix="digest") as helper:  # xxhash and copies release the GIL
            for bucket, flat, source in self._gather(plan, shared=True, published=published):
                flats.append(flat)
                if source is flat:  # published: engines map the parameters' copy itself; hashed below, two threads
                    in_place.append((bucket, flat))
                elif source is not None:  # the parameters hold it in its layout: copied below, hashed as it is copied
                    copies.append((bucket, source, flat))
                elif digests is not None:  # packed: hashed on the helper while the next bucket is gathered
                    hashed.append(helper.submit(digests.add_bucket, bucket, flat))
            for done in hashed:
                done.result()  # re-raises a failed hash
            fill_buckets(copies, digests, helper)
            if digests is not None and in_place:
                hash_buckets(in_place, digests, helper)
        if self.rank != 0:
            return None
        self._shared = (plan, flats)
        out = {
            "shared": [handle_of(f) for f in flats],
            "refs": [put_bucket(f) for f in flats] if to_store else None,
        }
        if digests is not None:
            out.update(digests=digests.by_name(), full=digests.hexdigest())
        return out

    def shared_checksums(self, kinds: tuple[str, ...]) -> dict[str, str]:
        """Rank 0: the ``kinds`` checksums of the buckets the last ``share_weight_buckets`` sent."""
        plan, flats = self._shared
        return sent_checksums(plan, flats, kinds)

    def put_weight_buckets(self, plan: SyncPlan) -> list | None:
        """Collective: gather each bucket; rank 0 puts it in the object store and returns the refs."""
        refs = [put_bucket(flat) for _, flat, _ in self._gather(plan) if self.rank == 0]
        return refs if self.rank == 0 else None

    def save(self, path: str) -> None:
        """Collective checkpoint save."""
        self.backend.save(path)
        self.hooks.call("after_save", self.ctx, path)

    def export_hf(self, path: str, dtype: str) -> None:
        """Collective: gather the full weights; rank 0 writes ``model.safetensors`` and the HF config/tokenizer.

        A LoRA policy is written merged, and its adapter in peft's format under ``adapter/``.
        """
        from miles_ray.backends.lora import write_peft_adapter
        from miles_ray.models.export import write_hf_dir

        weights, adapters = self.backend.hf_state(getattr(torch, dtype))
        if self.rank != 0:
            return
        c = self.config
        also = (
            None
            if adapters is None
            else lambda tmp: write_peft_adapter(tmp / "adapter", c.backend.lora, c.model_path, adapters)
        )
        write_hf_dir(c.model_path, path, weights, also)

    def load(self, path: str) -> None:
        """Collective checkpoint load."""
        self.backend.load(path)


@ray.remote(num_cpus=0)
class TrainerGroup:
    """The driver-facing trainer: owns the rank actors and the weight version.

    PPO: pass ``critic`` (a ``CriticGroup``; needs ``advantage.kind="gae"``): every ``train_step`` asks it for
    values first, computes GAE on the trainer ranks, then trains the critic on the returns. A ``reference``
    (``ReferenceGroup``; needs ``kl``) serves the reference logprobs instead of a copy on the trainer ranks.
    """

    def __init__(self, config: TrainerGroupConfig, placement: Placement, critic=None, reference=None):
        if config.backend.kind == "megatron" and config.kl is not None and reference is None:
            raise ValueError("backend.kind='megatron' keeps no KL reference on its ranks: pass a ReferenceGroup")
        if (config.advantage.kind == "gae") != (critic is not None):
            raise ValueError(
                "TrainerGroupConfig.advantage.kind='gae' and a critic go together: "
                f"advantage.kind={config.advantage.kind!r}, critic={'given' if critic is not None else 'None'}"
            )
        if reference is not None and config.kl is None:
            raise ValueError("a reference actor was given but TrainerGroupConfig.kl is None (nothing would use it)")
        self.config = config
        self._critic = critic
        self._reference = reference
        self._placement = placement
        self._workers = self._start_workers()
        self._version = 0
        self._skipped = 0
        self._restarts = 0

    def _start_workers(self) -> list:
        external_reference = self._reference is not None
        count_field = "TrainerGroupConfig.num_ranks"
        return start_workers(self._placement, TrainerWorker, "trainer", count_field, self.config, external_reference)

    def workers(self) -> list:
        """Rank actor handles, rank order (the WeightBroadcaster drives them directly)."""
        return list(self._workers)

    def weight_version(self) -> int:
        """Number of optimizer steps taken (the version engines should hold after a sync)."""
        return self._version

    def train_step(self, group_refs: list) -> dict[str, float]:
        """One optimizer step on all ranks over the given sample groups; returns metrics and the new version.

        With a critic, its metrics join as ``critic/<name>``. A step whose loss or gradients are not finite
        (on any rank) is skipped: ``step_skipped`` is 1, the weights, optimizer state and weight version stay
        as they were, and ``skipped_steps`` counts such steps over the run.
        """
        start = time.perf_counter()
        # critic values and reference logprobs run concurrently; the ranks receive the refs (Ray resolves them)
        values = self._critic.compute_values.remote(group_refs) if self._critic is not None else None
        ref = None
        if self._reference is not None:
            ref = self._reference.compute_logprobs.remote(group_refs, self.config.temperature)
        metrics, returns = ray.get([w.train_step.remote(group_refs, values, ref) for w in self._workers])[0]
        if self._critic is not None:
            critic_metrics = ray.get(self._critic.train_step.remote(group_refs, values, returns))
            metrics.update({f"critic/{k}": v for k, v in critic_metrics.items()})
        if metrics["step_skipped"]:  # non-finite loss or gradients: weights unchanged, so is the version
            self._skipped += 1
            logger.warning(
                "train step skipped (non-finite loss or grad norm %s); weight version stays %d",
                metrics["grad_norm"],
                self._version,
            )
        else:
            self._version += 1
        metrics["weight_version"] = self._version
        metrics["skipped_steps"] = self._skipped
        self._record(metrics, time.perf_counter() - start, sum(g.num_samples for g in group_refs))
        return metrics

    def _record(self, m: dict, seconds: float, num_samples: int) -> None:
        from miles_ray import metrics as mx

        skipped = "1" if m["step_skipped"] else "0"
        mx.counter("train_steps_total", "Trainer steps", ("skipped",)).inc(tags={"skipped": skipped})
        mx.seconds_histogram("train_step_seconds", "Seconds per trainer step").observe(seconds)
        mx.counter("train_samples_total", "Samples trained on").inc(num_samples)
        mx.gauge("trainer_weight_version", "The trainer's weight version").set(self._version)
        for name, key in (
            ("train_loss", "loss"),
            ("train_grad_norm", "grad_norm"),
            ("reward_mean", "shaped_reward_mean"),
        ):
            if math.isfinite(m[key]):
                mx.gauge(name, f"Last trainer step's {key}").set(m[key])

    def compute_logprobs(self, group_refs: list) -> list[list[float]]:
        """Response-token logprobs of every sample (in the groups' order) under the current weights."""
        return ray.get([w.compute_logprobs.remote(group_refs) for w in self._workers])[0]

    def export_hf(self, path: str, dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16") -> str:
        """Write the current policy as an HF model directory (``model.safetensors`` + config + tokenizer).

        ``AutoModelForCausalLM.from_pretrained(path)`` loads it, as do vLLM and SGLang. A LoRA policy is written
        merged, and its adapter alone under ``path/adapter`` (``peft.PeftModel.from_pretrained``). Returns ``path``.
        """
        ray.get([w.export_hf.remote(path, dtype) for w in self._workers])
        return path

    def restart(self, path: str | None = None) -> int:
        """Replace every rank actor (dead or alive) with a fresh one; then load the checkpoint at ``path``.

        After a rank dies its process group is broken, so the whole group is rebuilt on the same placement.
        ``path`` None leaves the new ranks at the initial weights and version 0 (for a caller that restores a
        whole-run checkpoint next, ``RunCheckpointer.load``). The new rank handles differ: give them to the
        ``WeightBroadcaster`` (``set_trainer_workers``); ``miles_ray.fault.restart_trainer`` does both.

        Returns:
            The weight version now held.

        """
        for w in self._workers:
            ray.kill(w, no_restart=True)
        self._workers = self._start_workers()
        self._version = 0
        self._skipped = 0
        if path is not None:
            self.load(path)
        self._restarts += 1
        return self._version

    def num_restarts(self) -> int:
        """How many times ``restart`` rebuilt the ranks."""
        return self._restarts

    def save(self, path: str) -> None:
        """Checkpoint model and optimizer (torch DCP) and the weight version into directory ``path``."""
        ray.get([w.save.remote(path) for w in self._workers])
        with open(os.path.join(path, "miles_ray_trainer.json"), "w") as f:
            json.dump(
                {"weight_version": self._version, "num_ranks": len(self._workers), "skipped_steps": self._skipped}, f
            )

    def load(self, path: str) -> None:
        """Load a checkpoint written by ``save`` (any rank count); restores the weight version."""
        ray.get([w.load.remote(path) for w in self._workers])
        with open(os.path.join(path, "miles_ray_trainer.json")) as f:
            saved = json.load(f)
        self._version = saved["weight_version"]
        self._skipped = saved.get("skipped_steps", 0)
