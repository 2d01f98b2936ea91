"""The default rollout function: prompts -> Router -> rewarded sample groups in the object store.

A rollout function has the signature ``(router, task, sampling_params, num_prompts, **kwargs) ->
list[GroupRef]``; ``RolloutFunctionConfig(fn=...)`` takes another callable or an import path, resolves it once
and checks every call's result against that contract, to change how samples are generated (multi-turn,
tools, agents). A data source (``task``, ``miles_ray.types.DataSource``) hands out prompts with ``next_prompt()``;
each one is checked (``miles_ray.types.check_prompt``) before it is sent, as request ``p<uid>``.

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

from miles_ray.algo.shaping import has_reward_variance
from miles_ray.callables import resolve_callable
from miles_ray.config import StrictConfig
from miles_ray.deprecation import moved
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.rewards.safe import SafeGroupReward, SafeReward
from miles_ray.types import GroupRef, Prompt, Sample
from miles_ray.types import check_prompt as _check_prompt

# the data-source contract moved to miles_ray.types (with the Prompt type it checks); the old names still resolve
# here, with a DeprecationWarning
__getattr__ = moved(
    __name__, {"check_prompt": "miles_ray.types:check_prompt", "PROMPT_FIELDS": "miles_ray.types:PROMPT_FIELDS"}
)


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


def request_id(prompt: Prompt) -> str:
    """The request id of a prompt's generation: ``p<uid>`` (unique in a run, so ``abort`` finds it)."""
    return f"p{prompt['uid']}"


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
    kept: list = []  # (samples, weight version, uid) of the groups the filter keeps
    generated, rounds = 0, 0
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
    prompts = [_check_prompt(task.next_prompt(), task) for _ in range(num_prompts)]
    futures = [router.generate.remote(GenerateRequest(p["prompt_ids"], params, request_id(p))) for p in prompts]
    groups = []
    for prompt, out in zip(prompts, ray.get(futures)):
        groups.append((build_group(prompt, out, reward), first_version(out), prompt["uid"]))
    return groups


def build_group(prompt: Prompt, out, reward: SafeReward | SafeGroupReward) -> list[Sample]:
    """The rewarded samples of one prompt's ``GenerateOutput`` (a failed reward zeroes that sample's loss mask)."""
    if isinstance(reward, SafeGroupReward):  # one call scores the whole group
        scored = reward([c.text for c in out.completions], prompt["entry"])
    else:
        scored = [reward(c.text, prompt["entry"]) for c in out.completions]
    samples = []
    for c, (value, failure) in zip(out.completions, scored):
        metadata = {
            "answer": prompt["entry"].get("answer"),
            "engine_id": out.engine_id,
            "last_weight_version": out.weight_version,
        }
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
