"""WeightBroadcaster: pushes trainer weights to every engine, bucketed, versioned and verified.

Transports (one per module in ``miles_ray.sync``):
- ``broadcast``: trainer rank 0 and all engines form one collective group (gloo on CPU, NCCL on GPU);
  each bucket is one broadcast, sent while rank 0 gathers the next, received into buffers the engine keeps (its
  parameters then view them: no copy). For disaggregated placement.
- ``shared_memory``: rank 0 gathers each bucket into shared-memory buffers it keeps from sync to sync; engines on
  its node map them and compute on them in place, engines on other nodes get object-store copies. For colocated
  placement. A respawned engine gets its first weights through the object store whatever the transport.

Both verify with an XXH3-128 digest of every byte (``sync.digest``), so a check costs a fraction of moving the bytes;
``verify="sampled"`` reads 1/64 of them (every 4 KiB of every tensor on each sync, every byte within 64 syncs).

A LoRA trainer (``TorchBackendConfig.lora``) plans adapter tensors only (``SyncPlan.adapter``): the engines add
the adapters on the first sync and from then on receive a few MB per sync instead of the whole model.

After a sync every engine reports its weight version and a checksum of the weights it holds; the
broadcaster compares them with the trainer's version and the checksum of what was sent, and raises
``WeightSyncError`` on any mismatch, so a silent divergence can never reach the next rollout.

Usage::

    wb = WeightBroadcaster.options(name="miles_ray/weight_broadcaster").remote(
        WeightBroadcasterConfig(transport="shared_memory"), trainer_workers, engines)
    report = ray.get(wb.sync.remote(version=ray.get(trainer.weight_version.remote())))
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Literal

import ray
from pydantic import Field, model_validator

from miles_ray.actors.engine_actor import InFlight
from miles_ray.config import StrictConfig
from miles_ray.sync.checksum import sent_checksums
from miles_ray.sync.shm import as_tensor


class WeightSyncError(RuntimeError):
    """An engine does not hold the version or bytes the trainer sent."""


class WeightBroadcasterConfig(StrictConfig):
    """Transport, bucketing and verification of trainer -> engine weight sync."""

    transport: Literal["broadcast", "shared_memory"] = Field(
        "broadcast",
        description="broadcast (collective group, disaggregated) or shared_memory (object store, colocated).",
    )
    collective: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collective library of `broadcast`: auto (nccl with GPUs, else gloo), gloo or nccl."
    )
    bucket_bytes: int = Field(64 << 20, ge=1 << 10, le=16 << 30, description="Bytes per bucket at most.")
    engine_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="dtype the trainer casts to before sending. auto: the dtype every engine holds (half the bytes "
        "of float32 where they hold bfloat16), float32 where they differ or a server resolves its own.",
    )
    verify: bool | Literal["sampled"] = Field(
        True,
        description="Compare engine checksums with the sent weights after every sync. True: a digest of every byte; "
        "sampled: of every tensor's name, dtype, shape and one 64-byte window of every 4 KiB of its bytes, the window "
        "moving with the version so 64 syncs cover every byte (embedded engines; 1/64 of the hashing); False: off.",
    )
    in_flight: InFlight = Field(
        "continue",
        description="Requests generating during a sync: continue (kept in their slots, go on with the new weights), "
        "finish (engines admit nothing new and finish them on the old weights first) or abort_resume (aborted, then "
        "continued from their last token on the new weights). vLLM and SGLang engines: continue only.",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed_backend(cls, data: Any) -> Any:
        # `backend` named the collective library until "backend" came to mean the trainer's alone
        if isinstance(data, dict) and "backend" in data:
            warnings.warn(
                "WeightBroadcasterConfig.backend is deprecated: use collective", DeprecationWarning, stacklevel=2
            )
            data = {**data}
            if "collective" in data:
                raise ValueError("give collective only (backend is its deprecated name)")
            data["collective"] = data.pop("backend")
        return data


def sent_dtype(configured: str, held: list[str | None]) -> str:
    """The dtype a sync sends: ``configured``, or for ``auto`` the one dtype all engines hold (float32 otherwise).

    Sending what the engines hold halves the bytes for bfloat16 engines and lets them compute on the received
    buffers in place; float32 where they differ (or a server did not say) loses nothing any engine keeps.
    """
    if configured != "auto":
        return configured
    kinds = set(held)
    return kinds.pop() if len(kinds) == 1 and None not in kinds else "float32"


@ray.remote(num_cpus=0)
class WeightBroadcaster:
    """Coordinates weight sync between a trainer's rank actors and a list of engine actors."""

    def __init__(self, config: WeightBroadcasterConfig, trainer_workers: list, engines: list):
        if not trainer_workers or not engines:
            raise ValueError("WeightBroadcaster needs at least one trainer worker and one engine")
        self.config = config
        self._workers = list(trainer_workers)
        self._engines = list(engines)
        held = ray.get([e.weights_dtype.remote() for e in engines])
        self.engine_dtype = sent_dtype(config.engine_dtype, held)
        if config.verify and (other := [i for i, d in enumerate(held) if d not in (None, self.engine_dtype)]):
            raise ValueError(
                f"engine_dtype={config.engine_dtype!r} but engines {other} hold {held[other[0]]}: what they hold could "
                "never hash to what was sent; use engine_dtype='auto' (or verify=False to cast on load unchecked)"
            )
        self._plan = ray.get(self._workers[0].sync_plan.remote(self.engine_dtype, config.bucket_bytes))
        self._plan_ref = ray.put(self._plan)  # what each sync's calls pass: the plan pickled once, not per call
        adapters = self._plan.adapter is not None
        takes = ray.get([(e.takes_adapters if adapters else e.takes_full_weights).remote() for e in engines])
        refusing = [i for i, ok in enumerate(takes) if not ok]
        if refusing and adapters:
            raise ValueError(
                f"engines {refusing} cannot load LoRA adapters (the trainer has backend.lora set, so syncs send "
                "the adapters only): use embedded engines, SGLang engines with SGLangEngineConfig.lora, or train "
                "without LoRA"
            )
        if refusing:
            raise ValueError(
                f"engines {refusing} serve LoRA adapters only (SGLangEngineConfig.lora is set), but the trainer syncs "
                "full weights: set the trainer's backend.lora, or drop the engines' lora"
            )
        sampling = ray.get([e.takes_sampled_verify.remote() for e in engines]) if config.verify == "sampled" else []
        if refusing := [i for i, ok in enumerate(sampling) if not ok]:
            raise ValueError(
                f"verify='sampled' needs engines that hash what they hold themselves (embedded engines); engines "
                f"{refusing} hash every byte (vLLM) or probe rows (SGLang): use verify=True or False with them"
            )
        self._verify = bool(config.verify)  # what engines and trainer ranks are told: check, or not
        self._kinds = self._checksum_kinds(self._engines)
        self._same_node: list[bool] | None = None  # per engine: on trainer rank 0's node (shared_memory transport)
        self._group_ready = False
        self._last: dict = {}

    @staticmethod
    def _checksum_kinds(engines: list) -> list[str]:
        # "full": the engine hashes every byte it holds; "probe": the first values of each tensor (SGLang)
        return ray.get([e.checksum_kind.remote() for e in engines])

    def _setup_group(self) -> None:
        import torch

        collective = self.config.collective
        if collective == "auto":
            collective = "nccl" if torch.cuda.is_available() or ray.cluster_resources().get("GPU", 0) > 0 else "gloo"
        ranks = ray.get([e.sync_ranks.remote() for e in self._engines])  # an SGLang server joins with its TP ranks
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        world = 1 + sum(ranks)
        host, port = ray.get(self._workers[0].host_sync_group.remote(world))
        ray.get(
            [self._workers[0].join_sync_group.remote(world, collective)]
            + [e.join_sync_group.remote(host, port, off, world, collective) for off, e in zip(offsets, self._engines)]
        )
        self._group_ready = True

    def sync(self, version: int) -> dict:
        """Send the trainer's current weights to every engine as ``version`` and verify them.

        Returns:
            ``{"seconds", "transfer_seconds", "bytes", "dtype", "gb_per_s", "num_buckets", "version", "checksum",
            "drain_seconds"}``: ``seconds`` is the whole sync; ``transfer_seconds`` and ``gb_per_s`` leave out the
            engines' checksums and the wait for in-flight requests (``drain_seconds``, with ``in_flight="finish"``),
            not the sender's digest, which is taken while the bytes move.

        Raises:
            WeightSyncError: if an engine's version or checksum differs from the trainer's.

        """
        start = time.perf_counter()
        verify, sample = self._verify, self._sample(version)
        if self.config.transport == "broadcast":
            if not self._group_ready:
                self._setup_group()
            kinds, mode = tuple(sorted(set(self._kinds))), self.config.in_flight
            # receivers first: an engine's call takes longer to start receiving than rank 0's to start sending
            recvs = [e.receive_broadcast.remote(self._plan_ref, version, verify, mode, sample) for e in self._engines]
            sends = [w.broadcast_weights.remote(self._plan_ref, verify, kinds, sample) for w in self._workers]
            sent_checksum = ray.get(sends)[0]
            loaded = ray.get(recvs)
            put_s = 0.0  # engines' receive time covers the trainer's gather and send
        else:
            put_s, sent_checksum, loaded = self._push_shared(version)
        transfer_s = put_s + max(r["seconds"] for r in loaded)  # without the engines' hashing or draining
        self._check(self._engines, self._kinds, loaded, version, sent_checksum)
        total = self._plan.total_bytes
        self._last = {
            "seconds": time.perf_counter() - start,
            "transfer_seconds": transfer_s,
            "bytes": total,
            "dtype": self.engine_dtype,
            "gb_per_s": total / transfer_s / 1e9,
            "num_buckets": len(self._plan.buckets),
            "version": version,
            "checksum": (sent_checksum or {}).get("full", (sent_checksum or {}).get("probe")),
            "drain_seconds": max(r.get("drain_seconds", 0.0) for r in loaded),
        }
        from miles_ray import metrics as mx

        mx.seconds_histogram("weight_sync_seconds", "Seconds per weight sync").observe(self._last["seconds"])
        mx.counter("weight_sync_bytes_total", "Bytes sent per engine by weight syncs").inc(total)
        _record_versions(range(len(self._engines)), version)
        return dict(self._last)

    def _push_shared(self, version: int) -> tuple[float, dict | None, list]:
        """Colocated: rank 0 gathers into its shared-memory buffers; engines on its node map them.

        Engines on other nodes get object-store copies.

        Returns:
            ``(gather seconds, sent checksums by kind, load reports)``.

        """
        if self._same_node is None:  # which engines can map rank 0's shared memory (asked once per engine set)
            # by Ray node, not IP: simulated nodes share one; a node is what a placement and a failure are about
            trainer = ray.get(self._workers[0].node_id.remote())
            self._same_node = [h["node_id"] == trainer for h in ray.get([e.health.remote() for e in self._engines])]
        start = time.perf_counter()
        c = self.config
        hash_full, sample = self._verify and "full" in self._kinds, self._sample(version)  # SGLang: probe rows only
        to_store = not all(self._same_node)
        sends = [w.share_weight_buckets.remote(self._plan_ref, to_store, hash_full, sample) for w in self._workers]
        out = [r for r in ray.get(sends) if r][0]
        put_s = time.perf_counter() - start  # with the digest, taken while gathering
        loads = [
            e.load_buckets.remote(
                self._plan_ref,
                out["shared"] if same else out["refs"],
                version,
                self._verify,
                c.in_flight,
                digests=out.get("digests") if same else None,
                sample=sample,
            )
            for e, same in zip(self._engines, self._same_node)
        ]
        sent = None
        if self._verify:  # other kinds are hashed while the engines load
            other = tuple(sorted(set(self._kinds) - {"full"}))
            sent = {"full": out["full"]} if hash_full else {}
            sent |= ray.get(self._workers[0].shared_checksums.remote(other)) if other else {}
        return put_s, sent, ray.get(loads)

    def _push_through_store(self, engines: list, kinds: list[str], version: int) -> tuple[float, dict | None, list]:
        """Rank 0 puts the buckets in the object store, ``engines`` (checksum ``kinds``) load them.

        Returns:
            ``(put seconds, sent checksums by kind, load reports)``.

        """
        start = time.perf_counter()
        refs = [r for r in ray.get([w.put_weight_buckets.remote(self._plan_ref) for w in self._workers]) if r][0]
        put_s = time.perf_counter() - start
        c = self.config
        sample = self._sample(version)
        loads = [
            e.load_buckets.remote(self._plan_ref, refs, version, self._verify, c.in_flight, sample=sample)
            for e in engines
        ]
        # the object-store copies are the bytes the trainer sent: hash them here while engines load
        sent_checksum = self._checksum_refs(refs, kinds, sample) if self._verify else None
        loaded = ray.get(loads)
        del refs  # the buckets leave the object store once engines are done
        return put_s, sent_checksum, loaded

    def _check(self, engines: list, kinds: list[str], loaded: list[dict], version: int, sent_checksum: dict | None):
        versions = [r["version"] for r in loaded]  # each engine's, read as its load ended
        if any(v != version for v in versions):
            raise WeightSyncError(f"engines hold versions {versions} after syncing version {version}")
        if self._verify:
            pairs = [(r["engine_id"], r["checksum"], sent_checksum[k]) for r, k in zip(loaded, kinds)]
            bad = [(engine, held, sent) for engine, held, sent in pairs if held != sent]
            if bad:
                raise WeightSyncError(f"engines hold other weights than the trainer sent (engine, held, sent): {bad}")

    def replace_engine(self, engine_id: int, engine, version: int) -> dict:
        """Put ``engine`` in place of engine ``engine_id`` (a respawned one) and load the trainer's weights into it.

        The weights go through the object store whatever the transport (one engine; works across nodes), as
        ``version``, the trainer's current weight version, and are verified like a sync. With the broadcast
        transport the next ``sync`` re-forms the collective group with the new engine in it.

        Returns:
            ``{"engine_id", "version", "seconds", "checksum"}``.

        Raises:
            IndexError: for an engine id this broadcaster does not drive.
            WeightSyncError: if the new engine does not hold what was sent.

        """
        if not 0 <= engine_id < len(self._engines):
            raise IndexError(
                f"engine_id {engine_id} out of range: this broadcaster drives {len(self._engines)} engines"
            )
        self._engines[engine_id] = engine
        kinds = self._checksum_kinds([engine])
        self._kinds[engine_id] = kinds[0]  # and the next syncs compare it the same way
        self._group_ready = False  # the old group has a dead member
        self._same_node = None  # the new engine may sit on another node
        start = time.perf_counter()
        _, sent_checksum, loaded = self._push_through_store([engine], kinds, version)
        self._check([engine], kinds, loaded, version, sent_checksum)
        seconds = time.perf_counter() - start
        _record_versions([engine_id], version)
        return {"engine_id": engine_id, "version": version, "seconds": seconds, "checksum": loaded[0]["checksum"]}

    def add_engine(self, engine, version: int) -> dict:
        """Drive one more engine (``RolloutPool.add_engine``) as the next engine id; load and verify ``version`` in it.

        Returns:
            What ``replace_engine`` returns.

        """
        self._engines.append(engine)
        self._kinds.append("full")  # replace_engine asks the engine for its own kind
        return self.replace_engine(len(self._engines) - 1, engine, version)

    def set_trainer_workers(self, trainer_workers: list) -> None:
        """Drive new trainer rank actors (after ``TrainerGroup.restart``); the next sync re-forms the group."""
        if not trainer_workers:
            raise ValueError("set_trainer_workers needs at least one trainer worker")
        self._workers = list(trainer_workers)
        self._group_ready = False
        self._same_node = None

    def _checksum_refs(self, refs: list, kinds: list[str], sample: int | None) -> dict[str, str]:
        arrays = ray.get(refs)
        flats = [as_tensor(a, b.dtype) for b, a in zip(self._plan.buckets, arrays)]
        return sent_checksums(self._plan, flats, kinds, sample)

    def _sample(self, version: int) -> int | None:
        """The sampled digest's sample for syncing ``version`` (it moves the window each sync); None: every byte."""
        return version if self.config.verify == "sampled" else None

    def last_report(self) -> dict:
        """The report of the most recent sync."""
        return dict(self._last)


def _record_versions(engine_ids, version: int) -> None:
    """The verified weight version each engine holds, as a gauge per engine (the dashboard's metrics)."""
    from miles_ray import metrics as mx

    gauge = mx.gauge("engine_weight_version", "Weight version each engine holds (verified)", ("engine",))
    for engine_id in engine_ids:
        gauge.set(version, tags={"engine": str(engine_id)})
