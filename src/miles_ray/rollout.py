"""The default rollout function: prompts -> Router -> rewarded sample groups in the object store.

A rollout function has the signature ``(router, task, sampling_params, num_prompts) -> list[GroupRef]``;
pass another callable (or an import path, resolved with ``miles_ray.rewards.safe.resolve_callable``) to
change how samples are generated (multi-turn, tools, agents).

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

import ray
import torch

from miles_ray.actors.replay_buffer import GroupRef
from miles_ray.algo.shaping import has_reward_variance
from miles_ray.engines.base import GenerateRequest, SamplingParams
from miles_ray.rewards.safe import SafeReward, resolve_callable
from miles_ray.types import Sample


def apply_reward(reward: SafeReward, text: str, entry, loss_mask: list[int], metadata: dict) -> tuple[float, list[int]]:
    """Score ``text``; on a reward failure record why in ``metadata`` and zero the loss mask.

    Returns:
        ``(reward value, loss mask to train with)``.

    """
    value, failure = reward(text, entry)
    if failure is None:
        return value, loss_mask
    metadata["reward_failure"] = f"{failure.kind}: {failure.message}"
    return value, [0] * len(loss_mask)


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
        reward: the reward function, run safely; defaults to ``SafeReward(task.reward)``.
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


def _generate_round(router, task, params: SamplingParams, num_prompts: int, reward: SafeReward):
    """``num_prompts`` rewarded groups as ``(samples, weight_version, uid)``."""
    prompts = [task.next_prompt() for _ in range(num_prompts)]
    futures = [
        router.generate.remote(GenerateRequest(p["prompt_ids"], params, request_id=f"p{p['index']}")) for p in prompts
    ]
    groups = []
    for prompt, out in zip(prompts, ray.get(futures)):
        samples = []
        for c in out.completions:
            metadata = {"answer": prompt["entry"].get("answer"), "engine_id": out.engine_id}
            value, loss_mask = apply_reward(reward, c.text, prompt["entry"], [1] * len(c.token_ids), metadata)
            samples.append(
                Sample(
                    prompt_ids=prompt["prompt_ids"],
                    response_ids=c.token_ids,
                    rollout_logprobs=c.logprobs,
                    loss_mask=loss_mask,
                    reward=value,
                    group_id=prompt["uid"],
                    weight_version=out.weight_version,
                    finish_reason=c.finish_reason,
                    response_text=c.text,
                    metadata=metadata,
                )
            )
        groups.append((samples, out.weight_version, prompt["uid"]))
    return groups
