"""The default rollout function: prompts -> Router -> rewarded sample groups in the object store.

A rollout function has the signature ``(router, task, sampling_params, num_prompts) -> list[GroupRef]``;
pass another callable (or an import path, resolved with ``miles_ray.rewards.safe.resolve_callable``) to
change how samples are generated (multi-turn, tools, agents).

Rewards run through ``SafeReward``: a reward function that raises, hangs past its timeout or returns NaN
yields a sample with zero weight (loss mask all 0), reward 0 and ``metadata["reward_failure"]`` set.

Usage::

    groups = generate_groups(router, task, SamplingParams(n=8, max_new_tokens=64), num_prompts=8)
    ray.get(buffer.add.remote(groups))
"""

from __future__ import annotations

import ray

from miles_ray.actors.replay_buffer import GroupRef
from miles_ray.engines.base import GenerateRequest, SamplingParams
from miles_ray.rewards.safe import SafeReward
from miles_ray.types import Sample


def generate_groups(
    router, task, params: SamplingParams, num_prompts: int, reward: SafeReward | None = None
) -> list[GroupRef]:
    """Generate ``num_prompts`` groups of ``params.n`` samples, reward them, and put each group in the store.

    Args:
        router: a ``Router`` actor handle.
        task: a data source + reward with ``next_prompt()`` and ``reward(text, entry)`` (``ReasoningGymTask``).
        params: sampling parameters; ``params.n`` is the group size.
        num_prompts: prompts (groups) to generate.
        reward: the reward function, run safely; defaults to ``SafeReward(task.reward)``.

    """
    reward = reward or SafeReward(task.reward)
    prompts = [task.next_prompt() for _ in range(num_prompts)]
    futures = [
        router.generate.remote(GenerateRequest(p["prompt_ids"], params, request_id=f"p{p['index']}")) for p in prompts
    ]
    groups = []
    for prompt, out in zip(prompts, ray.get(futures)):
        samples = []
        for c in out.completions:
            value, failure = reward(c.text, prompt["entry"])
            metadata = {"answer": prompt["entry"].get("answer"), "engine_id": out.engine_id}
            if failure is not None:
                metadata["reward_failure"] = f"{failure.kind}: {failure.message}"
            samples.append(
                Sample(
                    prompt_ids=prompt["prompt_ids"],
                    response_ids=c.token_ids,
                    rollout_logprobs=c.logprobs,
                    loss_mask=[0 if failure else 1] * len(c.token_ids),
                    reward=value,
                    group_id=prompt["uid"],
                    weight_version=out.weight_version,
                    finish_reason=c.finish_reason,
                    response_text=c.text,
                    metadata=metadata,
                )
            )
        groups.append(GroupRef(ray.put(samples), len(samples), out.weight_version, prompt["uid"]))
    return groups
