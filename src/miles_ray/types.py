"""Data that flows between actors, and the data-source contract.

- ``Prompt``: what a data source's ``next_prompt()`` returns (checked by ``check_prompt``); its ``uid`` is the
  prompt's one identity: the GRPO group id, the request id (``p<uid>``), the key of prompts in flight.
- ``Sample``: one response and everything training needs about it, produced by a rollout function.
- ``GroupRef``: one prompt's samples put in the Ray object store, as the ``ReplayBuffer`` holds them.
- ``RolloutBatch``: samples padded into the tensors the trainer consumes (``RolloutBatch.from_samples``).

Shapes: ``B`` samples, ``T`` the longest prompt+response length in the batch. Nothing here imports Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from typing_extensions import NotRequired, TypedDict

if TYPE_CHECKING:
    from ray import ObjectRef


class Prompt(TypedDict):
    """One prompt from a data source: ``prompt_ids``, the ``entry`` the reward sees, the ``uid``.

    ``uid`` must never repeat within a run (count the prompts handed out). Extra keys are kept: ``messages``
    (the chat messages, for rollouts through an OpenAI chat API), a dataset ``index``, anything a custom
    rollout function reads.
    """

    prompt_ids: list[int]
    entry: dict[str, Any]
    uid: int
    messages: NotRequired[list[dict[str, Any]]]


# the required keys of a Prompt and their types, as check_prompt enforces them
PROMPT_FIELDS: dict[str, type] = {"prompt_ids": list, "entry": dict, "uid": int}


class DataSource(Protocol):
    """What the rollout functions and ``AsyncRollout`` need from a data source (``ReasoningGymTask`` is one).

    ``state_dict()`` / ``load_state_dict(state)`` (the data position) are optional: a run checkpoint needs them.
    """

    def next_prompt(self) -> Prompt:
        """The next prompt; called once per group."""
        ...

    def reward(self, response_text: str, entry: dict[str, Any], /) -> float:
        """The reward of one response (the default reward function of the rollout; called positionally)."""
        ...


def check_prompt(prompt: Any, source: object) -> Prompt:
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


@dataclass(frozen=True)
class GroupRef:
    """A reference to one stored group (a ``list[Sample]`` in the object store) and what is known without fetching it.

    ``group_id`` is the prompt's ``uid``; ``weight_version`` the oldest version that generated the group.
    """

    ref: ObjectRef
    num_samples: int
    weight_version: int
    group_id: int


@dataclass
class Sample:
    """One generated response and everything training needs about it.

    Attributes:
        prompt_ids: prompt token ids.
        response_ids: generated token ids (including a final stop token if one was sampled).
        rollout_logprobs: the engine's log-probability of each response token, ``len(response_ids)``.
        loss_mask: 1 for response tokens the policy generated and is trained on, 0 for tokens it did not
            (tool outputs in multi-turn rollouts); ``len(response_ids)``.
        reward: scalar reward, set by the reward function.
        group_id: the prompt's ``uid``: samples that answer the same prompt share it (GRPO groups).
        weight_version: the (oldest) engine weight version that generated the response; if weights were updated
            mid-response, ``metadata["last_weight_version"]`` holds the newest.
        finish_reason: ``"stop"`` (stop token/string), ``"length"`` (max tokens) or ``"abort"``.
        metadata: free-form task data (the reasoning-gym entry, the answer, ...).
        routes: MoE models: ``[P, num_layers, top_k]`` experts the engine routed each of the first ``P`` tokens of
            prompt + response to (``P <= len(prompt_ids) + len(response_ids)``), for routing replay; else None.

    """

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    loss_mask: list[int] | None = None
    reward: float = 0.0
    group_id: int = 0
    weight_version: int = 0
    finish_reason: str = "length"
    response_text: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    routes: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_ids)
        if not (len(self.response_ids) == len(self.rollout_logprobs) == len(self.loss_mask)):
            raise ValueError(
                "Sample: response_ids, rollout_logprobs and loss_mask must have the same length, got "
                f"{len(self.response_ids)}, {len(self.rollout_logprobs)}, {len(self.loss_mask)}"
            )
        total = len(self.prompt_ids) + len(self.response_ids)
        if self.routes is not None and (self.routes.dim() != 3 or self.routes.shape[0] > total):
            raise ValueError(
                f"Sample: routes must be [P <= {total} (prompt + response tokens), num_layers, top_k], "
                f"got {tuple(self.routes.shape)}"
            )


@dataclass
class RolloutBatch:
    """A right-padded batch of samples as tensors.

    Attributes:
        input_ids: ``[B, T]`` prompt followed by response, padded with ``pad_id``.
        attention_mask: ``[B, T]`` 1 on real tokens.
        response_mask: ``[B, T-1]`` 1 where position ``t+1`` is a trained response token; aligned with
            next-token logprobs (``logprobs[:, t]`` is the log-probability of ``input_ids[:, t+1]``).
        rollout_logprobs: ``[B, T-1]`` engine logprobs on the same alignment, 0 elsewhere.
        advantages: ``[B]`` per-sample advantage (filled by the algorithm).
        rewards: ``[B]``.
        weight_versions: ``[B]`` weight version each sample was generated with.
        routes: ``[B, T, num_layers, top_k]`` (int16) the rollout's expert choice for each token of an MoE model,
            -1 where none was recorded (padding, the last token); None when no sample carries routes.
        prompt_lengths: ``[B]`` prompt tokens of each sample (samples with equal prompts share them when packed,
            ``backends.packing``); None for a batch built without them.
        filler: ``[B]`` bool, True for the rows ``shard`` adds to fill a rank's shard (they train nothing); None
            when there are none.

    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    weight_versions: torch.Tensor
    routes: torch.Tensor | None = None
    prompt_lengths: torch.Tensor | None = None
    filler: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        """Number of rows ``B`` (filler rows included)."""
        return int(self.input_ids.shape[0])

    @property
    def num_real(self) -> int:
        """Number of samples, filler rows left out."""
        return self.num_samples - (0 if self.filler is None else int(self.filler.sum()))

    def first_trained_position(self) -> int:
        """The first logprob position (``[B, T-1]`` alignment) any sample trains on; the last position if none.

        Backends form logits only from here on: prompt positions carry no loss.
        """
        nonzero = self.response_mask.any(dim=0).nonzero()
        return int(nonzero[0]) if nonzero.numel() else self.response_mask.shape[1] - 1

    @classmethod
    def from_samples(cls, samples: list[Sample], pad_id: int, advantages: torch.Tensor | None = None) -> RolloutBatch:
        """Pad ``samples`` into a batch.

        Args:
            samples: the samples, in order.
            pad_id: token id used for padding (masked out everywhere).
            advantages: optional ``[B]`` advantages; zeros if omitted.

        """
        if not samples:
            raise ValueError("RolloutBatch.from_samples: need at least one sample")
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        num, width = len(samples), max(lengths)
        input_ids = torch.full((num, width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((num, width), dtype=torch.long)
        response_mask = torch.zeros((num, width - 1), dtype=torch.float32)
        rollout_logprobs = torch.zeros((num, width - 1), dtype=torch.float32)
        routes = _pad_routes(samples, width)
        for i, s in enumerate(samples):
            p, r = len(s.prompt_ids), len(s.response_ids)
            input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
            attention_mask[i, : p + r] = 1
            # logprob index t predicts token t+1, so response token j (at p+j) sits at index p+j-1.
            response_mask[i, p - 1 : p + r - 1] = torch.tensor(s.loss_mask, dtype=torch.float32)
            rollout_logprobs[i, p - 1 : p + r - 1] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            response_mask=response_mask,
            rollout_logprobs=rollout_logprobs,
            rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
            advantages=advantages if advantages is not None else torch.zeros(num),
            weight_versions=torch.tensor([s.weight_version for s in samples], dtype=torch.long),
            routes=routes,
            prompt_lengths=torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long),
        )

    @staticmethod
    def shard_slice(num_samples: int, rank: int, world_size: int) -> slice:
        """The contiguous slice of ``num_samples`` that data-parallel ``rank`` trains on.

        Each rank gets ``ceil(num_samples / world_size)`` of them, the last ranks fewer (or none) when they do not
        split evenly, as a multi-turn rollout's samples may not; ``shard`` fills those ranks up. Every rank's rows
        thus come first in the shards' concatenation (``gather_shards``), in order, and filler rows after them.
        """
        per = RolloutBatch.shard_size(num_samples, world_size)
        return slice(min(rank * per, num_samples), min((rank + 1) * per, num_samples))

    @staticmethod
    def shard_size(num_samples: int, world_size: int) -> int:
        """The rows of every rank's shard: ``ceil(num_samples / world_size)``."""
        return -(-num_samples // world_size)

    def shard(self, rank: int, world_size: int) -> RolloutBatch:
        """The samples data-parallel ``rank`` trains on (``shard_slice``), filled up to the ranks' common size.

        A filler row copies the first sample with no trained token, advantage or reward (``filler`` marks it): it
        adds nothing to a loss or its normalisation, and every rank runs the same micro-batches and collectives.
        """
        rows = self.shard_slice(self.num_samples, rank, world_size)
        part, missing = self.select(rows), self.shard_size(self.num_samples, world_size) - (rows.stop - rows.start)
        if not missing:
            return part
        fill = self.select(torch.zeros(missing, dtype=torch.long))
        fill.response_mask = torch.zeros_like(fill.response_mask)
        fill.advantages, fill.rewards = torch.zeros_like(fill.advantages), torch.zeros_like(fill.rewards)
        fill.filler = torch.ones(missing, dtype=torch.bool)
        part.filler = torch.zeros(part.num_samples, dtype=torch.bool) if part.filler is None else part.filler
        fields = {k: (getattr(part, k), getattr(fill, k)) for k in self.__dataclass_fields__}
        return RolloutBatch(**{k: None if a is None else torch.cat([a, b]) for k, (a, b) in fields.items()})

    @classmethod
    def shard_rows(cls, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        """Rank ``rank``'s rows of ``full`` (``[B, ...]``, aligned with a batch's samples), as ``shard`` takes them.

        Zeros stand where ``shard`` adds filler rows.
        """
        rows = cls.shard_slice(full.shape[0], rank, world_size)
        missing = cls.shard_size(full.shape[0], world_size) - (rows.stop - rows.start)
        return torch.cat([full[rows], full.new_zeros((missing, *full.shape[1:]))])

    def select(self, rows: slice | torch.Tensor) -> RolloutBatch:
        """The batch of the samples in ``rows`` (a slice, or a ``LongTensor`` of rows)."""
        return RolloutBatch(
            **{k: None if getattr(self, k) is None else getattr(self, k)[rows] for k in self.__dataclass_fields__}
        )


def _pad_routes(samples: list[Sample], width: int) -> torch.Tensor | None:
    """``[B, width, L, k]`` int16 routes of the samples, -1 where a sample recorded none.

    Raises:
        ValueError: if some samples carry routes of another shape (``L``, ``k``) than others.

    """
    shapes = {tuple(s.routes.shape[1:]) for s in samples if s.routes is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"samples carry routes of different [num_layers, top_k]: {sorted(shapes)}")
    out = torch.full((len(samples), width, *shapes.pop()), -1, dtype=torch.int16)
    for i, s in enumerate(samples):
        if s.routes is not None:
            out[i, : s.routes.shape[0]] = s.routes.to(torch.int16)
    return out
