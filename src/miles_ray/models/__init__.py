"""Model specs for the embedded engine, and offline model sources (``hub``).

A *model spec* is a function ``(hf_dir, dtype) -> EngineModel`` registered under an HF ``model_type``.
``build_engine_model(path)`` reads ``config.json`` and dispatches on ``model_type`` through the built-in
``ENGINE_MODEL_SPECS`` and the caller's own specs (``EmbeddedEngineConfig.model_specs``: callables or import paths,
so a family from the user's package reaches engine actors in other processes). What the engine calls on a model is
the ``EngineModel`` Protocol; ``models/llama.py`` implements it for the Llama family (Llama, Qwen2, Qwen3, Mixtral,
Qwen3-MoE).

Usage::

    model = build_engine_model(path, torch.float32, {"my_arch": "my_pkg.my_arch:from_hf_dir"})
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from miles_ray.callables import resolve_callable
from miles_ray.contracts import protocol_gaps
from miles_ray.models.llama import FAMILIES, LlamaModel


class EngineModel(Protocol):
    """What the embedded engine needs from its model (an ``nn.Module`` with HF-named parameters, so syncs load).

    ``args`` carries ``vocab_size`` and ``tie_word_embeddings``; ``last_routes`` is None for a dense model, else the
    experts of every token of the latest forward, ``[rows, S, moe_layers, top_k]``. The cache ``new_cache`` returns
    must offer ``copy_slot(src, dst, length)`` (prefix sharing and compaction copy a sequence's keys and values).
    """

    args: Any
    last_routes: torch.Tensor | None

    def new_cache(self, num_slots: int, slot_len: int) -> Any:
        """A KV cache of ``num_slots`` sequences of up to ``slot_len`` tokens."""
        ...

    def kv_bytes_per_slot(self, slot_len: int) -> int:
        """Cache bytes of one sequence of ``slot_len`` tokens (the engine sizes its slots by it)."""
        ...

    def prefill(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: Any, first_slot: int, all_logits: bool = False
    ) -> torch.Tensor:
        """Write right-padded prompts ``[P, S]`` into slots ``first_slot..``; fp32 logits at each last token."""
        ...

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """One token for each sequence in slots ``0..B-1`` at ``positions``; fp32 next-token logits ``[B, V]``."""
        ...


ModelSpec = Callable[[Path, torch.dtype], EngineModel]

ENGINE_MODEL_SPECS: dict[str, ModelSpec] = dict.fromkeys(FAMILIES, LlamaModel.from_hf_dir)


def model_type_of(path: str | Path) -> str | None:
    """The ``model_type`` of the HF directory ``path`` (None when its config.json does not name one)."""
    return json.loads((Path(path) / "config.json").read_text()).get("model_type")


def model_spec(model_type: str | None, specs: Mapping[str, str | Callable] | None = None) -> ModelSpec:
    """The spec for ``model_type``: the caller's ``specs`` first (import paths resolved), then the built-in ones.

    Raises:
        ValueError: for a model type no spec covers, naming the supported ones and the other engines.

    """
    families = {**ENGINE_MODEL_SPECS, **(specs or {})}
    if model_type not in families:
        raise ValueError(
            f"model_type {model_type!r} has no embedded-engine model spec; supported: {sorted(families)}. Register "
            f"one with EmbeddedEngineConfig(model_specs={{{model_type!r}: 'my_pkg.module:build'}}) "
            "(docs/extending.md), or serve the model with a vLLM or SGLang engine "
            "(RolloutPoolConfig(engine={'kind': 'vllm' | 'sglang', ...}))"
        )
    return resolve_callable(families[model_type], f"model_specs[{model_type!r}]")


def build_engine_model(
    path: str | Path, dtype: torch.dtype = torch.float32, specs: Mapping[str, str | Callable] | None = None
) -> torch.nn.Module:
    """Build the embedded engine's model for the HF directory ``path`` (see ``model_spec`` for ``specs``).

    Raises:
        ValueError: if no spec covers the directory's ``model_type``, or the spec's model lacks part of
            ``EngineModel``.

    """
    model_type = model_type_of(path)
    model = model_spec(model_type, specs)(Path(path), dtype)
    gaps = protocol_gaps(type(model), EngineModel) if isinstance(model, torch.nn.Module) else ["not an nn.Module"]
    if gaps:
        built = type(model).__name__
        raise ValueError(f"the model spec for {model_type!r} built a {built} that is no EngineModel: {gaps}")
    return model


__all__ = [
    "ENGINE_MODEL_SPECS",
    "EngineModel",
    "LlamaModel",
    "ModelSpec",
    "build_engine_model",
    "model_spec",
    "model_type_of",
]
