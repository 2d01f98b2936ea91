"""The default rollout function: prompts -> Router -> rewarded sample groups in the object store.

A rollout function has the signature ``(router, task, sampling_params, num_prompts) -> list[GroupRef]``;
pass another callable (or an import path resolved with ``miles_ray.utils.resolve``) to change how
samples are generated (multi-turn, tools, agents).

Usage::

    groups = generate_groups(router, task, SamplingParams(n=8, max_new_tokens=64), num_prompts=8)
    ray.get(buffer.add.remote(groups))
"""

from __future__ import annotations

import ray

from miles_ray.actors.replay_buffer import GroupRef
from miles_ray.engines.base import GenerateRequest, SamplingParams
from miles_ray.types import Sample


def generate_groups(router, task, params: SamplingParams, num_prompts: int) -> list[GroupRef]:
    """Generate ``num_prompts`` groups of ``params.n`` samples, reward them, and put each group in the store.

    Args:
        router: a ``Router`` actor handle.
        task: a data source + reward with ``next_prompt()`` and ``reward(text, entry)`` (``ReasoningGymTask``).
        params: sampling parameters; ``params.n`` is the group size.
        num_prompts: prompts (groups) to generate.

    """
    prompts = [task.next_prompt() for _ in range(num_prompts)]
    futures = [
        router.generate.remote(GenerateRequest(p["prompt_ids"], params, request_id=f"p{p['index']}")) for p in prompts
    ]
    groups = []
    for prompt, out in zip(prompts, ray.get(futures)):
        samples = [
            Sample(
                prompt_ids=prompt["prompt_ids"],
                response_ids=c.token_ids,
                rollout_logprobs=c.logprobs,
                reward=task.reward(c.text, prompt["entry"]),
                group_id=prompt["uid"],
                weight_version=out.weight_version,
                finish_reason=c.finish_reason,
                response_text=c.text,
                metadata={"answer": prompt["entry"].get("answer"), "engine_id": out.engine_id},
            )
            for c in out.completions
        ]
        groups.append(GroupRef(ray.put(samples), len(samples), out.weight_version, prompt["uid"]))
    return groups
