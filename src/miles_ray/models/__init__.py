"""Model specs for the embedded engine, and offline model sources (``hub``).

``build_engine_model(path)`` reads ``config.json`` and dispatches on ``model_type`` through
``ENGINE_MODEL_SPECS``; a new architecture is one module plus one entry there. What the engine needs
from a model (see ``models/llama.py``): HF-named parameters, ``args.vocab_size``,
``new_cache(num_slots, slot_len)`` returning a cache with ``copy_slot(src, dst, length)``,
``kv_bytes_per_slot(slot_len)``, ``prefill(ids, lengths, cache, first_slot)`` and
``decode(ids, positions, cache)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from miles_ray.models.llama import LlamaModel

ENGINE_MODEL_SPECS: dict[str, Callable[[Path, torch.dtype], torch.nn.Module]] = {
    "llama": LlamaModel.from_hf_dir,
    "qwen2": LlamaModel.from_hf_dir,
    "mixtral": LlamaModel.from_hf_dir,
}


def build_engine_model(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Build the embedded engine's model for the HF directory ``path``.

    Raises:
        ValueError: if the directory's ``model_type`` has no registered spec.

    """
    path = Path(path)
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type not in ENGINE_MODEL_SPECS:
        raise ValueError(f"model_type {model_type!r} has no engine model spec; known: {sorted(ENGINE_MODEL_SPECS)}")
    return ENGINE_MODEL_SPECS[model_type](path, dtype)


__all__ = ["ENGINE_MODEL_SPECS", "LlamaModel", "build_engine_model"]
