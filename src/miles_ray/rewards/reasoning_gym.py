"""Verifiable-reward tasks from ``reasoning-gym`` (offline procedural datasets with ``score_answer``).

``ReasoningGymTask`` is both the data source (chat-formatted prompt token ids, in a fixed seeded order,
with a resumable position) and the reward function (extract the answer from the response, score it
with the dataset's own ``score_answer``).

Answer extraction: the text inside the last ``<answer>...</answer>`` if present, else the last number
in the response (for numeric tasks), else the stripped response.

Usage::

    task = ReasoningGymTask(ReasoningGymTaskConfig(dataset="basic_arithmetic"), tokenizer)
    prompt = task.next_prompt()          # {"prompt_ids": [...], "entry": {...}}
    reward = task.reward(response_text, prompt["entry"])
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field

from miles_ray.config import StrictConfig

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class ReasoningGymTaskConfig(StrictConfig):
    """Which reasoning-gym dataset, and how prompts are phrased."""

    dataset: str = Field(
        "basic_arithmetic", description="reasoning-gym dataset name (e.g. basic_arithmetic, countdown)."
    )
    dataset_kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed to reasoning_gym.create_dataset.")
    size: int = Field(10_000, ge=1, le=10_000_000, description="Number of distinct problems.")
    seed: int = Field(0, description="Dataset seed (the same seed gives the same problems in the same order).")
    instruction: str = Field("", description="Text appended to every question.")
    system_prompt: str | None = Field(None, description="System message; None keeps the chat template's default.")


def extract_answer(text: str) -> str:
    """The answer a response commits to (see module docstring)."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else text.strip()


class ReasoningGymTask:
    """Prompts and rewards of one reasoning-gym dataset."""

    def __init__(self, config: ReasoningGymTaskConfig, tokenizer):
        import reasoning_gym

        self.config = config
        self.tokenizer = tokenizer
        try:
            self.dataset = reasoning_gym.create_dataset(
                config.dataset, size=config.size, seed=config.seed, **config.dataset_kwargs
            )
        except Exception as exc:
            raise ValueError(
                f"ReasoningGymTaskConfig.dataset={config.dataset!r} with {config.dataset_kwargs}: {exc}"
            ) from exc
        self.position = 0

    def messages(self, entry: dict) -> list[dict]:
        """The chat messages of a dataset entry (system prompt if set, then the question)."""
        question = entry["question"] + (" " + self.config.instruction if self.config.instruction else "")
        messages = [{"role": "user", "content": question}]
        if self.config.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        return messages

    def prompt_ids(self, entry: dict) -> list[int]:
        """Chat-formatted prompt token ids of a dataset entry."""
        text = self.tokenizer.apply_chat_template(self.messages(entry), tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def next_prompt(self) -> dict:
        """The next problem, in order, wrapping around: ``{"prompt_ids", "messages", "entry", "index", "uid"}``.

        ``uid`` counts every prompt handed out and never repeats (the GRPO group id).
        """
        index = self.position % self.config.size
        self.position += 1
        entry = self.dataset[index]
        return {
            "prompt_ids": self.prompt_ids(entry),
            "messages": self.messages(entry),
            "entry": entry,
            "index": index,
            "uid": self.position - 1,
        }

    def state_dict(self) -> dict:
        """The data position (for a run checkpoint; the dataset itself is rebuilt from the config's seed)."""
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Go back to a ``state_dict()`` position."""
        self.position = int(state["position"])

    def reward(self, response_text: str, entry: dict) -> float:
        """Score in [0, 1] from the dataset's own ``score_answer``."""
        return float(self.dataset.score_answer(extract_answer(response_text), entry))


def one_digit_arithmetic(seed: int = 1) -> ReasoningGymTaskConfig:
    """The quick-start task: one-digit sums and differences, non-negative, no parentheses, answer only."""
    digits = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"]}
    return ReasoningGymTaskConfig(
        dataset="basic_arithmetic",
        seed=seed,
        dataset_kwargs={**digits, "allow_negation": False, "allow_parentheses": False},
        system_prompt="You are a calculator. Reply with only the result.",
        instruction="Reply with just the number.",
    )
