"""The stack builder: trainer, rollout pool, router, buffer, weight broadcaster (PPO's critic, reference) in one call.

``build_stack`` checks the configs against each other and against the placement plan before any actor starts,
creates the actors in dependency order (critic and reference before the trainer that uses them; trainer and
engines load their models concurrently), and returns a frozen ``Stack`` of handles. Every actor stays usable on
its own: the stack only wires them, so a driver can still talk to ``stack.trainer`` or ``stack.engines[0]``, or
build any of them by hand.

Usage::

    pl = placement.create(placement.colocated(2))
    stack = build_stack(StackConfig(trainer=TrainerGroupConfig(model_path=p, num_ranks=2),
                                    pool=RolloutPoolConfig(num_engines=2, engine={"model_path": p})), pl)
    groups = generate_groups(stack.router, task, SamplingParams(n=8), num_prompts=8)
    metrics = ray.get(stack.trainer.train_step.remote(groups))
    ray.get(stack.broadcaster.sync.remote(metrics["weight_version"]))
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import ray
from pydantic import Field, model_validator
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from miles_ray.actors.critic_group import CriticGroup, CriticGroupConfig
from miles_ray.actors.reference import ReferenceGroup, ReferenceGroupConfig
from miles_ray.actors.replay_buffer import ReplayBuffer, ReplayBufferConfig
from miles_ray.actors.rollout_pool import RolloutPool, RolloutPoolConfig
from miles_ray.actors.router import Router, RouterConfig
from miles_ray.actors.trainer_group import TrainerGroup, TrainerGroupConfig
from miles_ray.actors.weight_broadcaster import WeightBroadcaster, WeightBroadcasterConfig
from miles_ray.config import StrictConfig
from miles_ray.health import HealthMonitor, HealthMonitorConfig
from miles_ray.placement.groups import Placement


class StackConfig(StrictConfig):
    """The configs of one stack; cross-checked here, so a mismatch fails before any actor starts."""

    trainer: TrainerGroupConfig = Field(..., description="The policy's trainer (TrainerGroup).")
    pool: RolloutPoolConfig = Field(..., description="The rollout engines (RolloutPool).")
    router: RouterConfig = Field(default_factory=RouterConfig, description="Load balancing over the engines.")
    buffer: ReplayBufferConfig = Field(default_factory=ReplayBufferConfig, description="The ReplayBuffer.")
    broadcaster: WeightBroadcasterConfig | None = Field(
        None,
        description="Trainer -> engine weight sync; None picks the transport from the placement: shared_memory when "
        "colocated, broadcast when disaggregated.",
    )
    critic: CriticGroupConfig | None = Field(None, description="PPO's critic (needs trainer.advantage.kind='gae').")
    reference: ReferenceGroupConfig | None = Field(
        None, description="The KL reference as ranks of its own (needs trainer.kl); None keeps it on the trainer ranks."
    )
    health: HealthMonitorConfig | None = Field(
        None,
        description="Start a HealthMonitor: every actor checked each interval_s, failed engines replaced with the "
        "current weights; None: none (the Router still evicts dead engines, fault.heal_engines replaces them).",
    )
    name_prefix: str | None = Field(
        None,
        description="Name every actor '<prefix>/<role>' (trainer, rollout_pool, router, replay_buffer, "
        "weight_broadcaster, critic, reference, health_monitor) so a notebook reaches it with ray.get_actor; None: "
        "unnamed.",
    )

    detached: bool = Field(
        False,
        description="Start the named actors detached: they outlive the driver (a notebook that disconnects) until "
        "Stack.shutdown; needs name_prefix (attach_stack finds them by name) and placement.create(..., detached=True).",
    )

    @model_validator(mode="after")
    def _check(self) -> StackConfig:
        if self.detached and not self.name_prefix:
            raise ValueError("detached=True needs name_prefix: a detached actor nobody can find by name is a leak")
        t = self.trainer
        if (t.advantage.kind == "gae") != (self.critic is not None):
            raise ValueError(
                "trainer.advantage.kind='gae' and critic go together: "
                f"advantage.kind={t.advantage.kind!r}, critic={'given' if self.critic is not None else 'None'}"
            )
        if self.reference is not None and t.kl is None:
            raise ValueError("reference is given but trainer.kl is None (nothing would use it)")
        if t.backend.kind == "megatron" and t.kl is not None and self.reference is None:
            raise ValueError("trainer.backend.kind='megatron' keeps no KL reference on its ranks: give reference")
        return self


@dataclass(frozen=True)
class Stack:
    """Handles of one stack's actors (``engines`` in engine-id order); keep it, the pool owns the engines."""

    placement: Placement
    trainer: Any
    pool: Any
    engines: tuple
    router: Any
    buffer: Any
    broadcaster: Any
    critic: Any = None
    reference: Any = None
    monitor: Any = None

    def actors(self) -> dict[str, Any]:
        """Every actor of the stack by role (engines as ``engine<i>``), for a driver that checks or kills them."""
        roles = {"trainer": self.trainer, "pool": self.pool, "router": self.router, "buffer": self.buffer}
        roles.update(broadcaster=self.broadcaster, critic=self.critic, reference=self.reference, monitor=self.monitor)
        roles.update({f"engine{i}": e for i, e in enumerate(self.engines)})
        return {role: actor for role, actor in roles.items() if actor is not None}

    def shutdown(self) -> None:
        """Kill every actor of the stack and remove its placement group (which stops whatever else runs there)."""
        if self.monitor is not None:  # first, so that it replaces nothing being shut down
            ray.kill(self.monitor, no_restart=True)
        for actor in self.actors().values():
            ray.kill(actor, no_restart=True)
        self.placement.remove()  # with the one-bundle groups of bundles moved to spares or added


def build_stack(config: StackConfig, placement: Placement) -> Stack:
    """Start the stack's actors on ``placement`` and return their handles once every model is loaded.

    Raises:
        ValueError: when a rank or engine count differs from the placement plan's slots (before anything starts).

    """
    _check_slots(config, placement)
    # the control actors (no resources) run on the driver's node: a lost worker node takes its ranks and engines, which
    # the pool and the trainer group can replace, never the pool, router or buffer themselves
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)

    def name(role: str) -> dict:
        options = {"scheduling_strategy": here, "lifetime": "detached" if config.detached else None}
        return {**options, **({"name": f"{config.name_prefix}/{role}"} if config.name_prefix else {})}

    critic = reference = None
    if config.critic is not None:
        critic = CriticGroup.options(**name("critic")).remote(config.critic, placement)
    if config.reference is not None:
        reference = ReferenceGroup.options(**name("reference")).remote(config.reference, placement)
    trainer = TrainerGroup.options(**name("trainer")).remote(config.trainer, placement, critic, reference)
    pool = RolloutPool.options(**name("rollout_pool")).remote(config.pool, placement)  # loads while the trainer does
    engines = tuple(ray.get(pool.engines.remote()))
    router = Router.options(**name("router")).remote(config.router, list(engines))
    buffer = ReplayBuffer.options(**name("replay_buffer")).remote(config.buffer)
    sync = config.broadcaster or WeightBroadcasterConfig(
        transport="shared_memory" if placement.plan.mode == "colocated" else "broadcast"
    )
    workers = ray.get(trainer.workers.remote())
    broadcaster = WeightBroadcaster.options(**name("weight_broadcaster")).remote(sync, workers, list(engines))
    stack = Stack(placement, trainer, pool, engines, router, buffer, broadcaster, critic, reference)
    if config.health is None:
        return stack
    return replace(stack, monitor=HealthMonitor.options(**name("health_monitor")).remote(config.health, stack))


def attach_stack(name_prefix: str, namespace: str | None = None) -> Stack:
    """The ``Stack`` of a running stack's named actors (built with ``StackConfig.name_prefix``), from any driver.

    For a stack a notebook left running (``detached=True``), a later notebook, script or Ray job attaches with
    ``attach_stack("notebook", namespace="miles_ray")`` and trains on, or ends it with ``shutdown()``.

    Raises:
        ValueError: if an actor of the stack is not found (the message names it and the namespace).

    """

    def get(role: str, required: bool = True):
        try:
            return ray.get_actor(f"{name_prefix}/{role}", namespace=namespace)
        except ValueError:
            if not required:
                return None
            raise ValueError(
                f"no actor named {name_prefix}/{role} in namespace {namespace or ray.get_runtime_context().namespace}: "
                "was the stack built with this name_prefix (and detached=True, if its driver has exited)?"
            ) from None

    pool = get("rollout_pool")
    trainer, router, buffer, broadcaster = map(get, ("trainer", "router", "replay_buffer", "weight_broadcaster"))
    critic, reference, monitor = (get(r, required=False) for r in ("critic", "reference", "health_monitor"))
    placement, engines = ray.get([pool.placement.remote(), pool.engines.remote()])
    return Stack(placement, trainer, pool, tuple(engines), router, buffer, broadcaster, critic, reference, monitor)


def _check_slots(config: StackConfig, placement: Placement) -> None:
    """Every role's count equals the plan's slots for it (the actors would refuse later, from inside Ray)."""
    plan = placement.plan
    counts = {
        ("trainer", "trainer.num_ranks"): config.trainer.num_ranks,
        ("engine", "pool.num_engines"): config.pool.num_engines,
        ("critic", "critic.num_ranks"): config.critic.num_ranks if config.critic else 0,
        ("reference", "reference.num_ranks"): config.reference.num_ranks if config.reference else 0,
    }
    for (role, field), count in counts.items():
        slots = len(plan.slots(role))
        if count and count != slots:
            raise ValueError(f"StackConfig.{field}={count} but the placement plan has {slots} {role} slots")
