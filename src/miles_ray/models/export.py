"""Write trained weights as a Hugging Face model directory (safetensors), next to the base model's config."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

# what is not copied from the base model directory: its own weights (replaced) and conversion leftovers
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def write_hf_dir(
    base_model_path: str, out: str, tensors: dict[str, torch.Tensor], also: Callable[[Path], None] | None = None
) -> Path:
    """Write ``out/model.safetensors`` from ``tensors`` and copy every non-weight file of ``base_model_path``.

    The copied files are the config, tokenizer and generation config; ``also(tmp_dir)`` may write more (a LoRA
    adapter). Everything goes into ``out.tmp`` first, renamed to ``out`` at the end, so ``out`` is never
    half-written.

    Raises:
        FileExistsError: if ``out`` exists.

    """
    from safetensors.torch import save_file

    out_path = Path(out)
    if out_path.exists():
        raise FileExistsError(f"export path {out} exists; choose a new directory")
    tmp = out_path.with_name(out_path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in Path(base_model_path).iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(f, tmp / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"), {"format": "pt"})
    if also is not None:
        also(tmp)
    tmp.rename(out_path)
    return out_path
