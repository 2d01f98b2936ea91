"""A data source over a user's own dataset: JSONL, JSON, Parquet or HF ``datasets`` rows as chat prompts.

``DatasetSource`` implements ``miles_ray.types.DataSource``: ``next_prompt()`` hands out rows as chat-formatted
prompt token ids in a seeded order reshuffled every epoch, ``reward(text, entry)`` scores a response with the
configured reward function (an import path, by default math equivalence through ``math-verify``), and
``state_dict()`` / ``load_state_dict()`` carry the position through run checkpoints.

Columns follow TRL's naming: ``prompt`` (a string, or a chat ``messages`` list of ``{"role", "content"}``) and
``answer``. The whole row is the ``entry`` the reward sees, so extra columns (a ``data_source`` name, test cases,
choices) reach the reward as they are. Everything is read, checked and tokenised when the source is built: a
missing column, a non-string prompt, an empty or malformed file fail then, never mid-run (as verl filters
over-long prompts up front); prompts over ``max_prompt_tokens`` are dropped and counted.

Usage::

    source = DatasetSource(DatasetSourceConfig(path="train.jsonl", max_prompt_tokens=512), tokenizer)
    prompt = source.next_prompt()             # {"prompt_ids", "messages", "entry", "index", "uid", "epoch"}
    source.reward(response_text, prompt["entry"])
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field

from miles_ray.callables import resolve_callable
from miles_ray.config import StrictConfig
from miles_ray.data.files import read_rows, rows_of


class DataExhausted(Exception):
    """``next_prompt()`` after the configured number of epochs."""


class DatasetSourceConfig(StrictConfig):
    """Where the rows are, which columns hold what, how prompts are formatted, ordered and scored."""

    path: str | None = Field(
        None, description="A .jsonl/.json/.parquet file or a save_to_disk directory; None when a Dataset is passed."
    )
    format: Literal["auto", "jsonl", "json", "parquet", "hf"] = Field("auto", description="auto: from the suffix.")
    split: str = Field("train", description="The split of a saved DatasetDict.")
    prompt_column: str = Field("prompt", min_length=1, description="A string or a list of chat messages.")
    answer_column: str | None = Field(
        "answer", description="The reference answer, given to the reward as entry['answer']; None: no answer column."
    )
    system_prompt: str | None = Field(None, description="A system message put first unless the row has one.")
    chat_template: str | None = Field(None, description="A Jinja chat template; None: the tokenizer's own.")
    use_chat_template: bool = Field(
        True, description="False: string prompts are tokenised as they are (base models); needs no system_prompt."
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Prompts longer than this (after the template) are dropped and counted."
    )
    shuffle: bool = Field(True, description="Reshuffle the rows every epoch (seeded by seed and epoch).")
    seed: int = Field(0, ge=0, description="Seed of the shuffle: the same seed gives the same order.")
    epochs: int | None = Field(None, ge=1, description="Passes over the data; None: repeat forever.")
    reward: str = Field(
        "miles_ray.rewards.verifiers:math_reward",
        min_length=1,
        description="Import path of the reward function (response_text, entry) -> float.",
    )


class DatasetSource:
    """Prompts of a user's dataset in a seeded per-epoch order, with a resumable position and a reward."""

    def __init__(self, config: DatasetSourceConfig, tokenizer, dataset: Any = None):
        """Read, check and tokenise every row.

        Args:
            config: the source's config.
            tokenizer: an HF tokenizer (with a chat template unless ``use_chat_template`` is False).
            dataset: an HF ``Dataset``/``DatasetDict`` or a list of dicts, instead of ``config.path``.

        Raises:
            ValueError: naming the field, column or row that is wrong (see the module docstring).

        """
        if (config.path is None) == (dataset is None):
            raise ValueError("DatasetSourceConfig.path or a dataset object is needed (exactly one of them)")
        if not config.use_chat_template and config.system_prompt is not None:
            raise ValueError("DatasetSourceConfig.system_prompt needs use_chat_template=True")
        self.config = config
        self.tokenizer = tokenizer
        self.reward_fn: Callable[[str, dict], float] = resolve_callable(config.reward, "DatasetSourceConfig.reward")
        where = config.path or type(dataset).__name__
        if config.path is not None:
            rows = read_rows(config.path, config.format, config.split)
        else:
            rows = list(dataset) if isinstance(dataset, list) else rows_of(dataset, config.split)
        if not rows:
            raise ValueError(f"dataset {where} has no rows")
        check_columns(rows, config, where)
        self.rows = rows
        self.messages = [to_messages(r[config.prompt_column], i, config) for i, r in enumerate(rows)]
        ids = self._tokenize(self.messages, [r[config.prompt_column] for r in rows])
        limit = config.max_prompt_tokens
        self.kept = [i for i, t in enumerate(ids) if limit is None or len(t) <= limit]
        self.num_dropped = len(rows) - len(self.kept)
        if not self.kept:
            raise ValueError(f"every prompt of {where} is over max_prompt_tokens={limit}")
        self.prompt_ids = ids
        self.epoch, self.offset, self.uid = 0, 0, 0
        self._order = self._epoch_order(0)

    def _tokenize(self, messages: list[list[dict]], prompts: list[Any]) -> list[list[int]]:
        c = self.config
        if not c.use_chat_template:
            return self.tokenizer(list(prompts))["input_ids"]
        texts = [
            self.tokenizer.apply_chat_template(
                m, tokenize=False, add_generation_prompt=True, chat_template=c.chat_template
            )
            for m in messages
        ]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]  # the template wrote the special tokens

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(self.kept)
        if self.config.shuffle:
            random.Random(self.config.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def __len__(self) -> int:
        """Prompts per epoch (rows kept after the length limit)."""
        return len(self.kept)

    @property
    def exhausted(self) -> bool:
        """True once every configured epoch has been handed out."""
        return self.config.epochs is not None and self.epoch >= self.config.epochs

    def next_prompt(self) -> dict:
        """The next row's prompt: ``{"prompt_ids", "messages", "entry", "index", "uid", "epoch"}``.

        Raises:
            DataExhausted: after ``epochs`` passes.

        """
        if self.exhausted:
            raise DataExhausted(f"all {self.config.epochs} epochs of {len(self)} prompts were handed out")
        index = self._order[self.offset]
        prompt = {
            "prompt_ids": list(self.prompt_ids[index]),
            "messages": self.messages[index],
            "entry": self.entry(index),
            "index": index,
            "uid": self.uid,
            "epoch": self.epoch,
        }
        self.uid += 1
        self.offset += 1
        if self.offset == len(self._order):  # the next epoch starts with a fresh order
            self.epoch, self.offset = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        return prompt

    def prompts(self) -> list[dict]:
        """Every kept prompt in file order, apart from the training order (an eval set); ``uid`` is the row index."""
        return [
            {
                "prompt_ids": list(self.prompt_ids[i]),
                "messages": self.messages[i],
                "entry": self.entry(i),
                "index": i,
                "uid": i,
            }
            for i in self.kept
        ]

    def entry(self, index: int) -> dict[str, Any]:
        """Row ``index`` as the reward sees it: every column, the answer also under ``answer``."""
        row = dict(self.rows[index])
        column = self.config.answer_column
        if column is not None and column != "answer":
            row["answer"] = row[column]
        return row

    def reward(self, response_text: str, entry: dict[str, Any]) -> float:
        """The configured reward function's score of one response."""
        return self.reward_fn(response_text, entry)

    def stats(self) -> dict[str, int]:
        """Rows read, prompts kept and dropped for length, and the position."""
        return {
            "num_rows": len(self.rows),
            "num_prompts": len(self.kept),
            "num_dropped_too_long": self.num_dropped,
            "epoch": self.epoch,
            "offset": self.offset,
            "uid": self.uid,
        }

    def state_dict(self) -> dict[str, int]:
        """The position (for a run checkpoint); the data and its order come back from the config."""
        return {"epoch": self.epoch, "offset": self.offset, "uid": self.uid, "num_prompts": len(self.kept)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Go back to a ``state_dict()`` position.

        Raises:
            ValueError: if the dataset now has another number of prompts (the position would mean other rows).

        """
        if state["num_prompts"] != len(self.kept):
            raise ValueError(
                f"the checkpoint's data position is for {state['num_prompts']} prompts, this dataset has "
                f"{len(self.kept)}: the data or max_prompt_tokens changed since it was saved"
            )
        self.epoch, self.offset, self.uid = int(state["epoch"]), int(state["offset"]), int(state["uid"])
        self._order = self._epoch_order(self.epoch)


def check_columns(rows: list[dict], config: DatasetSourceConfig, where: str) -> None:
    """Every row has the prompt column (and the answer column, if one is configured).

    Raises:
        ValueError: naming the missing column, the first row without it, and the columns that row has.

    """
    wanted = [c for c in (config.prompt_column, config.answer_column) if c is not None]
    for i, row in enumerate(rows):
        missing = [c for c in wanted if c not in row]
        if missing:
            field = "prompt_column" if missing[0] == config.prompt_column else "answer_column"
            raise ValueError(
                f"{where}: row {i} has no column {missing[0]!r} (DatasetSourceConfig.{field}); "
                f"its columns are {sorted(row)}"
            )


def to_messages(prompt: Any, row: int, config: DatasetSourceConfig) -> list[dict[str, Any]]:
    """The chat messages of one row's prompt: a string becomes a user turn; the system prompt goes first.

    Raises:
        ValueError: for anything but a non-empty string or a list of ``{"role": str, "content": str}``.

    """
    column = config.prompt_column
    if isinstance(prompt, str) and prompt.strip():
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(_is_message(m) for m in prompt):
        if not config.use_chat_template:
            raise ValueError(f"row {row}: column {column!r} holds chat messages, which need use_chat_template=True")
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError(
            f"row {row}: column {column!r} must be a non-empty string or a list of chat messages "
            f"{{'role': str, 'content': str}}, got {type(prompt).__name__}: {str(prompt)[:80]!r}"
        )
    if config.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": config.system_prompt})
    return messages


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
