"""The engine-actor contract: what the Router, the RolloutPool and the WeightBroadcaster call on a rollout engine actor.

Three actors implement it, one per engine: ``EmbeddedEngineActor`` (``actors/embedded_engine.py``),
``VLLMEngineActor`` and ``SGLangEngineActor`` (``actors/vllm_engine.py``, ``actors/sglang_engine.py``, on the
shared ``ServerEngineActor``). ``EngineInterface`` lists exactly what the stack calls:

=====================  ===================================================================================
caller                 methods
=====================  ===================================================================================
Router                 ``generate``, ``health``
RolloutPool            ``health`` (readiness, respawn), ``release_memory``, ``resume_memory``; ``start_http``
                       only on embedded engines (``RolloutPoolConfig.http``)
WeightBroadcaster      ``takes_adapters``, ``takes_full_weights``, ``weights_dtype``, ``checksum_kind``,
                       ``takes_sampled_verify``, ``sync_ranks``, ``join_sync_group``, ``receive_broadcast``,
                       ``load_buckets`` (their reports carry the version loaded)
miles_ray.fault        through the three above (respawn, replace, re-route)
=====================  ===================================================================================

``EngineControl`` is what drivers and tests use to steer one engine (pause, abort, cache, checksum, version).
``EngineActorBase`` holds what every engine actor shares: the in-flight and pause-mode checks (``InFlight``,
``check_in_flight``, one validation for all), the capability answers, and the weight-sync receive path
(buckets over the broadcast group or from the object store, applied inside the engine's ``_load``).
``miles_ray.contracts.protocol_gaps`` checks an actor class against both Protocols.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal, Protocol, get_args

import torch

from miles_ray.engines.requests import GenerateOutput, GenerateRequest, PauseMode, check_pause_mode
from miles_ray.sync.buckets import SyncPlan, unpack_plan
from miles_ray.sync.digest import Known, TensorDigests
from miles_ray.sync.shm import BucketBuffers, SharedBucket, as_tensor, open_buckets

# Requests generating while a weight sync lands: `continue` (kept in their slots, they go on with the new weights),
# `finish` (no new request is admitted; the running ones finish on the old weights first) or `abort_resume`
# (aborted, then continued from their last token on the new weights)
InFlight = Literal["continue", "finish", "abort_resume"]
IN_FLIGHT_MODES: tuple[str, ...] = get_args(InFlight)


def check_in_flight(mode: str, supported: tuple[str, ...] = IN_FLIGHT_MODES, engine: str = "these") -> None:
    """The one validation of an ``in_flight`` mode, for every engine actor.

    Raises:
        ValueError: for an unknown mode, or one the engine does not support (naming the engine kind).

    """
    if mode not in IN_FLIGHT_MODES:
        raise ValueError(f"in_flight must be one of {IN_FLIGHT_MODES}, got {mode!r}")
    if mode not in supported:
        raise ValueError(f"{engine} engines support in_flight in {supported} only, got {mode!r}")


class EngineInterface(Protocol):
    """What the Router, RolloutPool and WeightBroadcaster call on every engine actor (see the module table)."""

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sample ``request``'s ``n`` responses; a ``ValueError`` for an invalid request (the engine stays up)."""
        ...

    async def health(self) -> dict:
        """Liveness and load: ``engine_id``, ``outstanding``, ``version``, ``url``, ``node_ip``, ``node_id``, ...."""
        ...

    async def release_memory(self) -> bool:
        """Free accelerator memory while a colocated trainer trains; False if nothing is freed."""
        ...

    async def resume_memory(self, tags: str | list[str] | None = None) -> bool:
        """Take back what ``release_memory`` freed (``weights``, ``kv_cache``; None: all)."""
        ...

    async def takes_adapters(self) -> bool:
        """Whether an adapter-only (LoRA) sync can be loaded."""
        ...

    async def takes_full_weights(self) -> bool:
        """Whether a sync of all weights can be loaded."""
        ...

    async def weights_dtype(self) -> str | None:
        """The dtype name of the weights held (``bfloat16``...); None where the server resolves it itself."""
        ...

    async def checksum_kind(self) -> str:
        """``full`` (every byte held is hashed) or ``probe`` (the first values of each tensor)."""
        ...

    async def sync_ranks(self) -> int:
        """Ranks this engine adds to the broadcast group."""
        ...

    async def join_sync_group(self, host: str, port: int, rank: int, world_size: int, collective: str) -> None:
        """Join the weight-broadcast group (gloo or nccl) as ranks ``rank ..``."""
        ...

    async def receive_broadcast(
        self,
        plan: SyncPlan,
        version: int,
        verify: bool = True,
        in_flight: InFlight = "continue",
        sample: int | None = None,
    ) -> dict:
        """Receive and load every bucket of ``plan`` from group rank 0.

        Returns ``{"engine_id", "seconds", "checksum", "version"}``; ``sample``: the checksum is sampled.
        """
        ...

    async def takes_sampled_verify(self) -> bool:
        """Whether the engine can take ``sample`` (a sampled checksum, ``sync.digest``) in a sync."""
        ...

    async def load_buckets(
        self,
        plan: SyncPlan,
        bucket_refs: list,
        version: int,
        verify: bool = True,
        in_flight: InFlight = "continue",
        digests: dict[str, bytes] | None = None,
        sample: int | None = None,
    ) -> dict:
        """Load a colocated sync's buckets (shared-memory handles or object refs); as ``receive_broadcast``."""
        ...


class EngineControl(Protocol):
    """What drivers and tests call to steer one engine actor."""

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Pause generation: ``abort`` running requests, or keep them ``in_place``."""
        ...

    async def resume(self) -> None:
        """Continue after ``pause``."""
        ...

    async def abort(self, request_id: str | None = None) -> None:
        """Abort one request (all if None)."""
        ...

    async def flush_cache(self) -> None:
        """Drop any prefix cache (computed with older weights)."""
        ...

    async def weight_version(self) -> int:
        """The version of the weights loaded."""
        ...

    async def weights_checksum(self) -> str | None:
        """Checksum of the weights held (``checksum_kind``), comparable with the trainer's."""
        ...


class EngineActorBase:
    """What every engine actor shares (apply ``ray.remote`` via ``RolloutPool``).

    A subclass sets ``kind`` and what it supports, implements ``_pause`` and either ``_apply`` (one unpacked
    bucket, on a worker thread) plus ``_load(run, plan, version, verify, in_flight, known)`` (runs ``run`` and returns
    ``{"engine_id", "seconds", "checksum"}``; ``known``: ``sync.digest.Known`` digests of the received tensors by
    name), or its own ``_receive_broadcast`` / ``_load_flats``.
    """

    kind = "engine"
    engine_id: int
    in_flight_modes: tuple[str, ...] = IN_FLIGHT_MODES  # what `in_flight` values this engine can honour
    accepts_adapters = True  # takes LoRA-only syncs (SyncPlan.adapter)
    accepts_full_weights = True  # takes syncs of every weight
    samples_checksum = False  # can hash a sampled checksum of what it holds (``sync.digest``)
    _sync_group = None
    _receive_buffers: BucketBuffers | None = None  # where broadcast buckets land, two sets alternating

    def __repr__(self) -> str:
        # Ray shows an actor's repr in the dashboard's Actors tab and its log prefix, taken once after __init__:
        # what the engine is (its weight version changes; see the engine_weight_version metric)
        return f"{type(self).__name__}(engine_id={self.engine_id}, kind={self.kind})"

    # --- control ------------------------------------------------------------------------------------------------
    async def pause(self, mode: PauseMode = "abort") -> None:
        """Pause generation: ``abort`` running requests (their callers get what was generated), or ``in_place``."""
        check_pause_mode(mode)
        await self._pause(mode)

    async def _pause(self, mode: PauseMode) -> None:
        raise NotImplementedError

    # --- capabilities ---------------------------------------------------------------------------------------------
    async def checksum_kind(self) -> str:
        """``full``: the sync checksum covers every byte the engine holds (SGLang engines: ``probe``)."""
        return "full"

    async def sync_ranks(self) -> int:
        """Ranks this engine adds to the broadcast group (an SGLang server: its TP size)."""
        return 1

    async def takes_adapters(self) -> bool:
        """Whether this engine can load an adapter-only sync (the broadcaster asks before the first sync)."""
        return self.accepts_adapters

    async def takes_full_weights(self) -> bool:
        """Whether this engine can load a sync of all weights (an SGLang engine serving LoRA adapters cannot)."""
        return self.accepts_full_weights

    async def release_memory(self) -> bool:
        """Free the engine's accelerator memory while a colocated trainer trains; False: nothing to free here.

        Only SGLang engines started with ``enable_memory_saver`` free anything; other engines keep theirs.
        """
        return False

    async def resume_memory(self, tags: str | list[str] | None = None) -> bool:
        """Take the memory of ``release_memory`` back (``tags``: ``weights`` / ``kv_cache``; None: all)."""
        return False

    # --- weight sync ----------------------------------------------------------------------------------------------
    async def join_sync_group(self, host: str, port: int, rank: int, world_size: int, collective: str) -> None:
        """Join the broadcast group used for disaggregated weight sync."""
        from miles_ray.sync.broadcast import BroadcastGroup

        if self._sync_group is not None:  # a re-formed group (respawned engine or trainer): leave the old one first
            self._sync_group.close()
        self._sync_group = await asyncio.to_thread(BroadcastGroup.create, host, port, rank, world_size, collective)

    async def receive_broadcast(
        self,
        plan: SyncPlan,
        version: int,
        verify: bool = True,
        in_flight: InFlight = "continue",
        sample: int | None = None,
    ) -> dict:
        """Receive every bucket of ``plan`` from group rank 0 and load it; then set ``version``.

        ``in_flight`` says what happens to requests generating meanwhile (``WeightBroadcasterConfig.in_flight``).
        ``sample``: the checksum is the sampled digest with this sample (``sync.digest``; engines that
        ``takes_sampled_verify``), None: every byte.

        Returns:
            ``{"engine_id", "seconds", "checksum", "version"}``; the checksum (of the weights now held) only if
            ``verify``; the version the engine holds after the load.

        """
        check_in_flight(in_flight, self.in_flight_modes, self.kind)
        self._check_sample(sample)
        report = await self._receive_broadcast(plan, version, verify, in_flight, sample)
        return {**report, "version": await self.weight_version()}

    async def takes_sampled_verify(self) -> bool:
        """Whether the engine can take ``sample`` (a sampled checksum, ``sync.digest``) in a sync."""
        return self.samples_checksum

    def _check_sample(self, sample: int | None) -> None:
        if sample is not None and not self.samples_checksum:
            raise ValueError(
                f"{self.kind} engines cannot take a sampled checksum (sample={sample}): verify every byte instead "
                "(WeightBroadcasterConfig.verify=True)"
            )

    async def load_buckets(
        self,
        plan: SyncPlan,
        bucket_refs: list,
        version: int,
        verify: bool = True,
        in_flight: InFlight = "continue",
        digests: dict[str, bytes] | None = None,
        sample: int | None = None,
    ) -> dict:
        """Load the buckets of a colocated sync; then set ``version``.

        ``bucket_refs`` are ``SharedBucket`` handles of the sender's shared-memory buffers (an engine on the
        sender's node: mapped, and the engine may compute on them in place) or object-store refs (another node:
        mapped from the object store, then copied). ``digests``: the sender's per-tensor digests of the shared
        buckets, which parameters computing on them in place take as their own (``sync.digest``).

        Returns:
            As ``receive_broadcast``.

        """
        check_in_flight(in_flight, self.in_flight_modes, self.kind)
        self._check_sample(sample)
        shared = all(isinstance(r, SharedBucket) for r in bucket_refs)
        if shared:
            flats = open_buckets(bucket_refs)
        else:
            flats, digests = [as_tensor(a, torch.uint8) for a in await asyncio.gather(*bucket_refs)], None  # mapped
        report = await self._load_flats(plan, flats, shared, version, verify, in_flight, digests, sample)
        return {**report, "version": await self.weight_version()}

    async def _receive_broadcast(
        self, plan: SyncPlan, version: int, verify: bool, in_flight: InFlight, sample: int | None = None
    ) -> dict:
        if self._sync_group is None:
            raise RuntimeError("receive_broadcast before join_sync_group")
        if self._receive_buffers is None:
            self._receive_buffers = BucketBuffers(shared=False)
        flats = self._receive_buffers.next(plan)  # not the set the parameters may view now

        def receive() -> dict[str, bytes] | None:  # before pausing: generation goes on while the bytes arrive
            works = [self._sync_group.broadcast(flat, async_op=True) for flat in flats]  # received in order
            digests = TensorDigests(sample) if verify else None
            for bucket, flat, work in zip(plan.buckets, flats, works):
                work.wait()
                if digests is not None:  # bucket i is hashed while bucket i + 1 arrives
                    digests.add_bucket(bucket, flat.view(bucket.dtype))
            return None if digests is None else digests.by_name()

        start = time.perf_counter()
        digests = await asyncio.to_thread(receive)
        received = time.perf_counter() - start
        named = self._receive_buffers.unpacked(plan)  # the views of this set's last sync, if the plan is the same
        report = await self._load_flats(plan, flats, True, version, verify, in_flight, digests, sample, named)
        return {**report, "seconds": received + report["seconds"]}  # the bytes' arrival is the sync's transfer

    async def _load_flats(
        self,
        plan: SyncPlan,
        flats: list[torch.Tensor],
        own: bool,
        version: int,
        verify: bool,
        in_flight: InFlight,
        digests: dict[str, bytes] | None = None,
        sample: int | None = None,
        named: list[list[tuple[str, torch.Tensor]]] | None = None,
    ) -> dict:
        """Apply the received buckets (``uint8`` each) inside ``_load``.

        ``own``: the memory stays valid and unwritten until the next sync, so parameters may view it (no copy), and
        those that do take their tensor's entry of ``digests`` (taken with ``sample``) when the engine verifies.
        ``named``: the buckets already unpacked (``BucketBuffers.unpacked``), else ``unpack_plan`` here.
        """
        named = unpack_plan(plan, flats) if named is None else named
        known = {n: Known(t, digests[n]) for b in named for n, t in b if n in digests} if own and digests else None

        def run() -> None:
            for bucket_tensors in named:
                self._apply(bucket_tensors, alias=own)

        return await self._load(run, plan, version, verify, in_flight, known, sample)

    def _apply(self, named_tensors: list[tuple[str, torch.Tensor]], alias: bool = False) -> None:
        raise NotImplementedError

    async def _load(
        self,
        run: Any,
        plan: SyncPlan,
        version: int,
        verify: bool,
        in_flight: InFlight,
        known: dict | None = None,
        sample: int | None = None,
    ) -> dict:
        raise NotImplementedError
