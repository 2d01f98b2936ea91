"""Trainer hooks: user code at fixed points of every trainer rank, given as callables or import paths.

``TrainerHooksConfig`` lists hooks per point; each is resolved once when the rank starts (a bad import
path fails there, naming the field) and called on every rank with a ``HookContext``:

| field | called | arguments | may |
| --- | --- | --- | --- |
| ``after_init`` | once the model and optimizer exist | ``ctx`` | freeze layers, register forward hooks |
| ``before_logprobs`` | before ``compute_logprobs`` | ``ctx, batch`` | edit the batch in place |
| ``before_train_step`` | before each optimizer step | ``ctx, batch`` | edit rewards/advantages in place |
| ``after_train_step`` | after each step | ``ctx, metrics`` | return a dict merged into the metrics |
| ``after_save`` | after a checkpoint is written | ``ctx, path`` | export, upload |

``batch`` is this rank's ``RolloutBatch`` shard with advantages filled (with filler rows, ``batch.filler``, when the
samples do not split evenly over the ranks); ``ctx.model`` is the wrapped (FSDP2/DDP) model. Callables are pickled
to the rank actors (cloudpickle), so a function defined in a driver script or a notebook works.

Usage::

    def log_lr(ctx, metrics):
        return {"lr": ctx.optimizer.param_groups[0]["lr"]}

    TrainerGroupConfig(model_path=path, hooks={"after_train_step": [log_lr, "my_pkg.hooks:freeze_embeddings"]})
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import Field, model_validator

from miles_ray.callables import resolve_callable
from miles_ray.config import StrictConfig

HookSpec = str | Callable[..., Any]
POINTS = ("after_init", "before_logprobs", "before_train_step", "after_train_step", "after_save")


class TrainerHooksConfig(StrictConfig):
    """Hooks per point (see the module docstring for when each runs and what it gets)."""

    after_init: list[HookSpec] = Field(default_factory=list, description="Called once model and optimizer exist.")
    before_logprobs: list[HookSpec] = Field(default_factory=list, description="Called before compute_logprobs.")
    before_train_step: list[HookSpec] = Field(default_factory=list, description="Called before each train step.")
    after_train_step: list[HookSpec] = Field(
        default_factory=list, description="Called after each step; a returned dict joins the metrics."
    )
    after_save: list[HookSpec] = Field(default_factory=list, description="Called after a checkpoint is written.")

    @model_validator(mode="after")
    def _resolvable(self) -> TrainerHooksConfig:
        resolve_all(self)  # fail where the config is made, naming the hook, not later on a rank
        return self


def resolve_all(config: TrainerHooksConfig) -> dict[str, list[Callable]]:
    """Every hook resolved to a callable, per point.

    Raises:
        ValueError: naming the first hook that is neither callable nor an importable path.

    """
    resolved = {}
    for point in POINTS:
        specs = getattr(config, point)
        resolved[point] = [resolve_callable(h, f"hooks.{point}[{i}]") for i, h in enumerate(specs)]
    return resolved


@dataclass
class HookContext:
    """What a hook sees: this rank's place, the model and optimizer, the trainer config."""

    rank: int
    world_size: int
    model: Any
    optimizer: Any
    config: Any


class Hooks:
    """Resolved hooks of one rank."""

    def __init__(self, config: TrainerHooksConfig):
        self._hooks = resolve_all(config)

    def call(self, point: str, ctx: HookContext, *args) -> dict:
        """Run the hooks of ``point`` in order; returns the merged dicts they returned."""
        merged = {}
        for hook in self._hooks[point]:
            out = hook(ctx, *args)
            if isinstance(out, dict):
                merged.update(out)
        return merged
