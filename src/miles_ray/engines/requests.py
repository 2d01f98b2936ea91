"""What every rollout engine takes and returns: sampling params, requests, completions, pause modes.

An engine turns prompt token ids into sampled responses with per-token logprobs. The embedded engine does it
in-process (``engines/embedded.py``); vLLM and SGLang engines over HTTP (``engines/vllm.py``, ``engines/sglang.py``).
The engine *actors* that put them behind one interface for the Router, the pool and the weight broadcaster are
``miles_ray.actors.engine_actor``.

Logprob contract: ``logprobs[j]`` is ``log_softmax(logits / temperature)`` of response token ``j``, the
distribution the token was drawn from before top-p/top-k truncation. A trainer recomputes the same
quantity by dividing its logits by the same temperature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from pydantic import Field, field_validator, model_validator

from miles_ray.config import StrictConfig

# the model name OpenAI-compatible routes report and accept when none is configured
DEFAULT_MODEL_NAME = "default"
MAX_SEQ_LEN = 131072  # the longest prompt + response an engine config may allow

# how an engine pauses: `abort` ends running requests first (their callers get what was generated so far),
# `in_place` keeps them in their slots to continue after `resume` (weights may change meanwhile)
PauseMode = Literal["abort", "in_place"]
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)


def check_pause_mode(mode: str) -> None:
    """The one validation of a pause mode, for every engine and engine actor.

    Raises:
        ValueError: for a mode other than ``abort`` or ``in_place``.

    """
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")


class EngineDeadError(RuntimeError):
    """The engine can serve no more requests: its stepping thread died or its server process exited.

    Engine actors raise it from ``generate`` and ``health``; the Router evicts the engine and retries the request
    elsewhere, as for an actor that died, and ``RolloutPool.respawn_dead`` replaces it. A ``ValueError`` instead
    means the request was bad and the engine is fine.
    """


class SamplingParams(StrictConfig):
    """How to sample responses for one prompt."""

    n: int = Field(1, ge=1, le=1024, description="Number of responses sampled for the prompt (a GRPO group).")
    max_new_tokens: int = Field(
        64, ge=1, le=MAX_SEQ_LEN, description="Maximum generated tokens per response (the engine's context bounds it)."
    )
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="Softmax temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Sample among the k most likely tokens; -1 disables.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end a response (kept).")
    stop: list[str] = Field(default_factory=list, description="Strings that end a response when generated.")
    ignore_eos: bool = Field(False, description="Do not stop at the tokenizer's EOS token.")
    seed: int | None = Field(
        None,
        ge=-(2**63),
        lt=2**63,
        description="Seed for this request's sampling (a signed 64-bit integer); None draws from the engine RNG.",
    )

    @field_validator("stop")
    @classmethod
    def _nonempty_stop(cls, stop: list[str]) -> list[str]:
        if "" in stop:  # as vLLM refuses it: every text contains "", so each response would end at its first token
            raise ValueError("stop strings must not be empty ('' would end every response at its first token)")
        return stop

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        return self


@dataclass
class GenerateRequest:
    """One prompt to sample ``params.n`` responses for."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    # the last `resumed` prompt ids are a response generated so far (a request continued after an abort): a stop
    # string may start in them and end in the new tokens
    resumed: int = 0


@dataclass
class Completion:
    """One sampled response."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    text: str = ""
    # MoE models: the experts each token fed to the model was routed to, ``[P, num_layers, top_k]`` for the first
    # P tokens of prompt + response (P = prompt + response - 1: the last sampled token is never fed); else None
    routes: torch.Tensor | None = None
    # what ended a "stop" response, as vLLM reports it: the stop string, or the stop token id; None for EOS
    stop_reason: str | int | None = None


@dataclass
class GenerateOutput:
    """The ``n`` responses to one request, with the weight versions that generated them.

    ``weight_version`` is the version when the request finished, ``first_weight_version`` when it started;
    they differ only if weights were updated mid-request (a pause ``in_place``, a partial rollout).
    """

    request_id: str
    completions: list[Completion]
    weight_version: int
    engine_id: int = -1
    first_weight_version: int = -1
