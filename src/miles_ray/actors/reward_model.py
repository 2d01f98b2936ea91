"""RewardModelGroup: a learned reward model (an HF sequence classifier) serving batched scores to rollouts.

Classic RLHF scores responses with a model trained on preferences instead of a rule. The group holds
``num_replicas`` actors, each with the model (``AutoModelForSequenceClassification``, one label: the score) in
eval mode; ``score(prompts, responses)`` splits the pairs over the replicas, which format each pair as a chat
(the prompt's messages, then the response as the assistant turn, through the reward model's own chat template)
and score them in padded batches of ``batch_size``. ``ModelReward`` adapts the group to the reward contract of
the rollouts: a group reward ``(texts, entry) -> list[float]`` (one call per prompt's responses), reading the
prompt from ``entry[prompt_key]``, so ``SafeGroupReward(ModelReward(group))`` is the reward of
``generate_groups`` and of PPO (``examples/ppo.py --reward-model DIR``).

Usage::

    rm = RewardModelGroup.remote(RewardModelConfig(model_path="my-rm"))
    generate_groups(router, task, params, 8, reward=SafeGroupReward(ModelReward(rm, prompt_key="question")))
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import ray
from pydantic import Field

from miles_ray.config import StrictConfig


class RewardModelConfig(StrictConfig):
    """Which reward model, how many replicas, how it batches."""

    model_path: str = Field(..., description="HF directory of a sequence-classification model with num_labels=1.")
    num_replicas: int = Field(1, ge=1, le=1024, description="Actors holding the model; pairs are split over them.")
    batch_size: int = Field(16, ge=1, le=4096, description="Pairs per forward pass.")
    max_length: int = Field(1024, ge=8, description="Formatted pairs are cut to this many tokens (from the left).")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Weights dtype of the reward model.")
    num_cpus: float = Field(0.5, ge=0, description="CPUs per replica (fractional on a laptop).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica.")
    num_threads: int = Field(1, ge=1, description="torch threads per replica.")


class RewardModelWorker:
    """One replica (apply ``ray.remote`` via ``RewardModelGroup``)."""

    def __init__(self, config: RewardModelConfig):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = "cuda" if torch.cuda.is_available() and config.num_gpus > 0 else "cpu"
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.tokenizer.truncation_side = "left"  # keep the response, which sits at the end
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype = getattr(torch, config.dtype)
        model = AutoModelForSequenceClassification.from_pretrained(config.model_path, dtype=dtype)
        if model.config.num_labels != 1:
            raise ValueError(f"RewardModelConfig.model_path: the model has {model.config.num_labels} labels; needs 1")
        model.config.pad_token_id = self.tokenizer.pad_token_id  # the score is read at the last non-pad token
        self.model = model.to(self.device).eval()

    def text(self, prompt: str | list[dict], response: str) -> str:
        """One pair as the reward model reads it: the chat with the response as the assistant's turn."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        messages.append({"role": "assistant", "content": response})
        if self.tokenizer.chat_template is None:
            return "\n".join(m["content"] for m in messages)
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def score(self, prompts: list, responses: list[str]) -> list[float]:
        """Scores of ``(prompt, response)`` pairs, in order."""
        import torch

        texts = [self.text(p, r) for p, r in zip(prompts, responses)]
        scores: list[float] = []
        for start in range(0, len(texts), self.config.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.config.batch_size],
                padding=True,
                truncation=True,
                max_length=self.config.max_length,
                return_tensors="pt",
                add_special_tokens=False,  # the chat template wrote them
            ).to(self.device)
            with torch.no_grad():
                scores += self.model(**batch).logits[:, 0].float().tolist()
        return scores


@ray.remote(num_cpus=0)
class RewardModelGroup:
    """The driver-facing reward model: replicas behind one ``score`` call."""

    def __init__(self, config: RewardModelConfig):
        worker = ray.remote(RewardModelWorker).options(num_cpus=config.num_cpus, num_gpus=config.num_gpus)
        self.config = config
        self._replicas = [worker.remote(config) for _ in range(config.num_replicas)]
        ray.get([r.__ray_ready__.remote() for r in self._replicas])  # a bad model fails here, at start

    async def score(self, prompts: list, responses: list[str]) -> list[float]:
        """Scores of ``(prompt, response)`` pairs (a prompt: a string or chat messages), split over the replicas.

        Raises:
            ValueError: if the two lists differ in length.

        """
        if len(prompts) != len(responses):
            raise ValueError(f"score got {len(prompts)} prompts and {len(responses)} responses")
        if not prompts:
            return []
        n = len(self._replicas)
        size = -(-len(prompts) // n)  # one contiguous part per replica, in order
        parts = [(prompts[i : i + size], responses[i : i + size]) for i in range(0, len(prompts), size)]
        results = await asyncio.gather(*[self._replicas[i % n].score.remote(p, r) for i, (p, r) in enumerate(parts)])
        return [s for part in results for s in part]


class ModelReward:
    """A ``RewardModelGroup`` as a group reward ``(texts, entry) -> list[float]`` (wrap in ``SafeGroupReward``).

    The prompt is ``entry[prompt_key]`` (a string or chat messages): ``prompt`` for ``DatasetSource`` rows,
    ``question`` for reasoning-gym entries.
    """

    def __init__(self, group, prompt_key: str = "prompt"):
        self.group = group
        self.prompt_key = prompt_key

    def __call__(self, texts: list[str], entry: dict[str, Any]) -> list[float]:
        """The reward model's score of each response to the entry's prompt."""
        if self.prompt_key not in entry:
            raise KeyError(f"ModelReward.prompt_key={self.prompt_key!r} is not in the entry (keys {sorted(entry)})")
        return ray.get(self.group.score.remote([entry[self.prompt_key]] * len(texts), list(texts)))
