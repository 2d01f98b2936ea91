"""The default rollout function: prompts -> Router -> rewarded sample groups in the object store.

A rollout function has the signature ``(router, task, sampling_params, num_prompts, **kwargs) ->
list[GroupRef]``; ``RolloutFunctionConfig(fn=...)`` takes another callable or an import path, resolves it once
and checks every call's result against that contract, to change how samples are generated (multi-turn,
tools, agents). A data source (``task``) hands out prompts with ``next_prompt()``; each one is checked
against ``PROMPT_FIELDS`` before it is sent.

Rewards run through ``SafeReward``: a reward function that raises, hangs past its timeout or returns NaN
yields a sample with zero weight (loss mask all 0), reward 0 and ``metadata["reward_failure"]`` set.

DAPO dynamic sampling is ``group_filter="miles_ray.rollout:has_reward_signal"`` with ``max_rounds > 1``:
groups whose samples all got the same reward are dropped and replaced by fresh prompts.

Usage::

    groups = generate_groups(router, task, SamplingParams(n=8, max_new_tokens=64), num_prompts=8)
    ray.get(buffer.add.remote(groups))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
import torch
from pydantic import Field, model_validator

from miles_ray.actors.replay_buffer import GroupRef
from miles_ray.algo.shaping import has_reward_variance
from miles_ray.config import StrictConfig
from miles_ray.engines.base import GenerateRequest, SamplingParams
from miles_ray.rewards.safe import SafeGroupReward, SafeReward, resolve_callable
from miles_ray.types import Sample


def apply_reward(reward: SafeReward, text: str, entry, loss_mask: list[int], metadata: dict) -> tuple[float, list[int]]:
    """Score ``text``; on a reward failure record why in ``metadata`` and zero the loss mask.

    Returns:
        ``(reward value, loss mask to train with)``.

    """
    return record_reward(*reward(text, entry), loss_mask, metadata)


def record_reward(value: float, failure, loss_mask: list[int], metadata: dict) -> tuple[float, list[int]]:
    """The reward-failure rule: a failed reward gives zero weight (loss mask all 0) and a recorded reason."""
    if failure is None:
        return value, loss_mask
    metadata["reward_failure"] = f"{failure.kind}: {failure.message}"
    return value, [0] * len(loss_mask)


# What a data source's next_prompt() must return (extra keys, e.g. "messages" for chat rollouts, are kept)
PROMPT_FIELDS: dict[str, type] = {"prompt_ids": list, "entry": dict, "index": int, "uid": int}


def check_prompt(prompt: Any, source: object) -> dict:
    """Validate one ``next_prompt()`` result against ``PROMPT_FIELDS``.

    Raises:
        ValueError: naming the data source's class and the missing or mistyped field.

    """
    name = f"{type(source).__name__}.next_prompt()"
    if not isinstance(prompt, dict):
        raise ValueError(f"{name} must return a dict with {sorted(PROMPT_FIELDS)}, got {type(prompt).__name__}")
    for key, kind in PROMPT_FIELDS.items():
        if key not in prompt:
            raise ValueError(f"{name} returned no {key!r} (needs {sorted(PROMPT_FIELDS)})")
        if not isinstance(prompt[key], kind) or isinstance(prompt[key], bool):
            raise ValueError(f"{name}[{key!r}] must be {kind.__name__}, got {type(prompt[key]).__name__}")
    ids = prompt["prompt_ids"]
    if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise ValueError(f"{name}['prompt_ids'] must be a non-empty list of token ids (ints >= 0)")
    return prompt


class RolloutFunctionConfig(StrictConfig):
    """Which rollout function a driver calls: ``fn(router, task, params, num_prompts, **kwargs) -> list[GroupRef]``."""

    fn: str | Callable[..., Any] = Field(
        "miles_ray.rollout:generate_groups", description="The rollout function: a callable or 'pkg.mod:fn'."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for every call.")

    @model_validator(mode="after")
    def _resolvable(self) -> RolloutFunctionConfig:
        resolve_callable(self.fn, "rollout.fn")  # fail where the config is made
        return self

    def resolve(self) -> Callable[..., list[GroupRef]]:
        """The function, wrapped so a result that breaks the contract fails with a message naming it."""
        fn, extra = resolve_callable(self.fn, "rollout.fn"), dict(self.kwargs)

        def rollout(router, task, params: SamplingParams, num_prompts: int, **kwargs) -> list[GroupRef]:
            out = fn(router, task, params, num_prompts, **extra, **kwargs)
            if not isinstance(out, list) or not all(
                isinstance(g, GroupRef) and isinstance(g.ref, ray.ObjectRef) for g in out
            ):
                kinds = sorted({type(g).__name__ for g in out}) if isinstance(out, list) else type(out).__name__
                raise TypeError(
                    f"rollout.fn {fn!r} must return a list of GroupRef (samples put in the object store), got {kinds}"
                )
            return out

        return rollout


def has_reward_signal(samples: list[Sample]) -> bool:
    """DAPO dynamic-sampling filter: keep a group only if its rewards are not all equal."""
    rewards = torch.tensor([s.reward for s in samples])
    return bool(has_reward_variance(rewards, torch.zeros(len(samples), dtype=torch.long)).any())


def generate_groups(
    router,
    task,
    params: SamplingParams,
    num_prompts: int,
    reward: SafeReward | None = None,
    group_filter: str | Callable[[list[Sample]], bool] | None = None,
    max_rounds: int = 1,
    stats: dict | None = None,
) -> list[GroupRef]:
    """Generate ``num_prompts`` groups of ``params.n`` samples, reward them, and put each group in the store.

    Args:
        router: a ``Router`` actor handle.
        task: a data source + reward with ``next_prompt()`` and ``reward(text, entry)`` (``ReasoningGymTask``).
        params: sampling parameters; ``params.n`` is the group size.
        num_prompts: groups to return.
        reward: the reward function, run safely; defaults to ``SafeReward(task.reward)``. A
            ``SafeGroupReward`` scores each prompt's responses in one call.
        group_filter: keep a group only if ``group_filter(samples)`` is true (callable or import path, e.g.
            ``"miles_ray.rollout:has_reward_signal"`` for DAPO dynamic sampling); dropped groups are replaced
            by fresh prompts in the next round.
        max_rounds: generation rounds at most; with a filter, fewer than ``num_prompts`` groups come back
            when the rounds run out.
        stats: if given, filled with ``groups_generated``, ``groups_dropped`` and ``rounds``.

    Raises:
        ValueError: for ``max_rounds < 1`` or a ``group_filter`` that cannot be resolved.

    """
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
    keep = resolve_callable(group_filter, "group_filter") if group_filter is not None else None
    reward = reward or SafeReward(task.reward)
    kept, generated, rounds = [], 0, 0
    while len(kept) < num_prompts and rounds < max_rounds:
        rounds += 1
        batch = _generate_round(router, task, params, num_prompts - len(kept), reward)
        generated += len(batch)
        kept += [g for g in batch if keep is None or keep(g[0])]
    if stats is not None:
        stats.update(groups_generated=generated, groups_dropped=generated - len(kept), rounds=rounds)
    return [GroupRef(ray.put(samples), len(samples), version, uid) for samples, version, uid in kept]


def first_version(out) -> int:
    """The oldest weight version that generated ``out`` (the one staleness is counted from)."""
    return out.first_weight_version if out.first_weight_version >= 0 else out.weight_version


def _generate_round(router, task, params: SamplingParams, num_prompts: int, reward: SafeReward):
    """``num_prompts`` rewarded groups as ``(samples, weight_version, uid)``."""
    prompts = [check_prompt(task.next_prompt(), task) for _ in range(num_prompts)]
    futures = [
        router.generate.remote(GenerateRequest(p["prompt_ids"], params, request_id=f"p{p['index']}")) for p in prompts
    ]
    groups = []
    for prompt, out in zip(prompts, ray.get(futures)):
        groups.append((build_group(prompt, out, reward), first_version(out), prompt["uid"]))
    return groups


def build_group(prompt: dict, out, reward: SafeReward | SafeGroupReward) -> list[Sample]:
    """The rewarded samples of one prompt's ``GenerateOutput`` (a failed reward zeroes that sample's loss mask)."""
    if isinstance(reward, SafeGroupReward):  # one call scores the whole group
        scored = reward([c.text for c in out.completions], prompt["entry"])
    else:
        scored = [reward(c.text, prompt["entry"]) for c in out.completions]
    samples = []
    for c, (value, failure) in zip(out.completions, scored):
        metadata = {"answer": prompt["entry"].get("answer"), "engine_id": out.engine_id,
                    "last_weight_version": out.weight_version}  # fmt: skip
        value, loss_mask = record_reward(value, failure, [1] * len(c.token_ids), metadata)
        samples.append(
            Sample(
                prompt_ids=prompt["prompt_ids"],
                response_ids=c.token_ids,
                rollout_logprobs=c.logprobs,
                loss_mask=loss_mask,
                reward=value,
                group_id=prompt["uid"],
                weight_version=first_version(out),
                finish_reason=c.finish_reason,
                response_text=c.text,
                metadata=metadata,
                routes=c.routes,
            )
        )
    return samples
