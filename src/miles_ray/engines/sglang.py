"""SGLang as a rollout engine: a ``sglang.launch_server`` child process driven over its native HTTP API.

``SGLangServer`` starts the server (in any Python environment with SGLang: ``SGLangEngineConfig.python``), waits
for ``/health`` and speaks the routes the engine interface needs:

- generate: ``/generate`` with ``input_ids``, ``sampling_params`` and ``return_logprob``; each logprob is SGLang's
  ``output_token_logprobs`` entry, ``log_softmax(logits / temperature)`` as the trainer recomputes it (with
  top-p/top-k < 1 SGLang reports the renormalised distribution, unlike the embedded engine);
- ``/pause_generation`` (``in_place`` | ``abort``), ``/continue_generation``, ``/abort_request``, ``/flush_cache``;
- weights, disaggregated: ``/init_weights_update_group`` puts the server's TP ranks into the trainer's broadcast
  group (``miles_ray.sync.broadcast``, formed the same way), then per bucket ``/update_weights_from_distributed`` with
  ``load_format="flattened_bucket"`` while trainer rank 0 broadcasts the bucket's bytes; colocated:
  ``/update_weights_from_tensor`` (tensors passed by shared-memory handle); around them
  ``/begin_weight_update`` / ``/end_weight_update`` where the server has them, and ``/update_weight_version``;
- verification: ``/get_weights_by_name`` returns the first row of each HF-named tensor as SGLang holds it (it
  slices its fused qkv/gate-up parameters back into HF names); ``probe_checksum`` hashes the first values of
  those rows, and the trainer hashes the same values of what it sent;
- ``/release_memory_occupation`` / ``/resume_memory_occupation`` (colocated on GPUs, ``enable_memory_saver``),
  ``/load_lora_adapter`` / ``/unload_lora_adapter`` (``sglang_args={"enable_lora": True, ...}``).

CPU (measured with SGLang 0.5.23 from PyPI beside ``torch==2.13.0``, ``scripts/setup_sglang.sh``): SGLang's CPU
kernels (``sgl_kernel``) exist only as a source build for Intel AMX, and PyPI's ``torchvision`` does not load beside
a CPU torch. With ``device="cpu"`` the server runs with ``SGLANG_USE_CPU_ENGINE=1``, the ``torch_native``
attention backend and CUDA graphs off, and ``miles_ray/engines/sglang_site`` on its ``PYTHONPATH``: a
``sitecustomize`` that supplies a stand-in ``sgl_kernel`` only when none is installed (SGLang imports names
from it at module load; on a CPU without AMX every layer dispatches to its native torch forward and none is
called, the stand-in raises if one is) and declares torchvision's two operator schemas when torchvision's
CUDA-linked library cannot load (SGLang imports ``torchvision.transforms`` for multimodal models). Nothing of
this applies with ``device="cuda"``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from miles_ray.config import StrictConfig
from miles_ray.engines.requests import DEFAULT_MODEL_NAME, Completion, GenerateRequest
from miles_ray.engines.server_process import (
    ServerError,
    ServerProcess,
    check_passthrough,
    sampling_fields,
    server_flags,
)

SITE_DIR = Path(__file__).resolve().parent / "sglang_site"
# flags this module sets itself; sglang_args may not override them
_OWN_FLAGS = {
    "config",
    "api-key",
    "admin-api-key",
    "model-path",
    "host",
    "port",
    "served-model-name",
    "dtype",
    "tp-size",
    "device",
    "random-seed",
    "mem-fraction-static",
    "max-total-tokens",
    "context-length",
    "attention-backend",
    "enable-memory-saver",
    "enable-lora",
    "max-lora-rank",
    "lora-target-modules",
    "lora-backend",
    "max-loras-per-batch",
    "lora-paths",
}
PROBE_VALUES = 16  # values of each tensor's first row compared after a sync


class SGLangLoRAConfig(StrictConfig):
    """LoRA serving: the engine takes the adapter-only syncs of a LoRA trainer (``TorchBackendConfig.lora``).

    Each sync loads the trainer's adapter as a new SGLang adapter (``/load_lora_adapter_from_tensors``) that
    new requests use; requests already running finish on the adapter they started with, then the old one is
    unloaded. The base weights stay the checkpoint's.
    """

    max_lora_rank: int = Field(..., ge=1, le=1024, description="Largest adapter rank served (>= the trainer's).")
    target_modules: list[str] = Field(
        ..., min_length=1, description="Linear layers that may carry adapters (the trainer's must be among them)."
    )
    backend: Literal["auto", "torch_native", "triton", "csgmv", "triton_v2"] = Field(
        "auto", description="SGLang's LoRA kernels; auto: torch_native on the CPU, SGLang's default on GPUs."
    )
    max_loras_per_batch: int = Field(
        2, ge=2, le=64, description="Adapters one batch may mix (a sync's new adapter and the one before it)."
    )

    def check_adapter(self, rank: int, target_modules) -> None:
        """Raise ``ValueError`` unless this server can serve a trainer's adapter of ``rank`` on ``target_modules``."""
        if rank > self.max_lora_rank:
            raise ValueError(
                f"the trainer's LoRA rank {rank} exceeds SGLangEngineConfig.lora.max_lora_rank {self.max_lora_rank}"
            )
        missing = sorted(set(target_modules) - set(self.target_modules))
        if missing and "all" not in self.target_modules:
            raise ValueError(
                f"the trainer's LoRA target modules {missing} are not in "
                f"SGLangEngineConfig.lora.target_modules {self.target_modules}"
            )

    def flags(self, device: str) -> list[str]:
        """The server flags that turn LoRA serving on."""
        out = ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--lora-target-modules"]
        out += [*self.target_modules, "--max-loras-per-batch", str(self.max_loras_per_batch)]
        backend = "torch_native" if self.backend == "auto" and device == "cpu" else self.backend
        return out + ([] if backend == "auto" else ["--lora-backend", backend])


class SGLangEngineConfig(StrictConfig):
    """One SGLang server per engine actor."""

    kind: Literal["sglang"] = "sglang"
    model_path: str = Field(..., description="HF model directory.")
    python: str = Field(
        sys.executable, description="Python interpreter of an environment with SGLang (e.g. .venv-sglang)."
    )
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="auto: cuda when the actor sees a GPU (CUDA_VISIBLE_DEVICES), else cpu."
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("float32", description="Weights dtype.")
    tp_size: int = Field(1, ge=1, le=64, description="Tensor-parallel ranks of the server (GPUs of the bundle).")
    context_length: int = Field(1024, ge=16, le=1_048_576, description="Prompt + response tokens at most.")
    max_total_tokens: int | None = Field(
        4096, ge=64, description="KV-cache size in tokens; None: SGLang sizes it from mem_fraction_static (GPUs)."
    )
    mem_fraction_static: float | None = Field(
        None, gt=0.0, lt=1.0, description="GPU memory share for weights + KV cache; None: SGLang's default."
    )
    enable_memory_saver: bool = Field(
        False, description="Colocated on GPUs: allow release/resume_memory_occupation around training."
    )
    seed: int = Field(0, description="Server seed (per-request seeds come from SamplingParams.seed).")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the server.")
    startup_timeout_s: float = Field(600.0, gt=0.0, description="How long the server may take to become healthy.")
    request_timeout_s: float = Field(
        1800.0, gt=0.0, description="A request (generation, weight load) whose server sends nothing this long fails."
    )
    lora: SGLangLoRAConfig | None = Field(
        None, description="Serve the LoRA adapters of a LoRA trainer (adapter-only syncs). None: full weights."
    )
    sglang_args: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="Extra server flags without '--' (e.g. {'chunked_prefill_size': 4096}); True is a bare flag.",
    )

    @model_validator(mode="after")
    def _check_args(self) -> SGLangEngineConfig:
        check_passthrough(self.sglang_args, _OWN_FLAGS, "sglang_args", "SGLangEngineConfig")
        return self

    def resolved_device(self) -> str:
        """``device`` with ``auto`` resolved in this process."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


class SGLangError(ServerError):
    """The SGLang server failed to start or answered an error."""


class SGLangServer(ServerProcess):
    """An SGLang server as a child process, and an async client for its native API."""

    name, error = "SGLang", SGLangError

    def __init__(self, config: SGLangEngineConfig, served_model_name: str = DEFAULT_MODEL_NAME):
        self.config, self.model_name = config, served_model_name
        self.device = config.resolved_device()
        super().__init__(config.startup_timeout_s, config.request_timeout_s)

    def command(self) -> list[str]:
        """The server's command line."""
        c = self.config
        cmd = [c.python, "-m", "sglang.launch_server", "--model-path", c.model_path, "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--served-model-name", self.model_name, "--dtype", c.dtype]
        cmd += ["--tp-size", str(c.tp_size), "--random-seed", str(c.seed), "--context-length", str(c.context_length)]
        cmd += ["--device", self.device]
        if c.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(c.max_total_tokens)]
        if c.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(c.mem_fraction_static)]
        if c.enable_memory_saver:
            cmd += ["--enable-memory-saver"]
        if self.device == "cpu":  # SGLang's CPU path without AMX kernels (see the module docstring)
            cmd += ["--attention-backend", "torch_native", "--disable-cuda-graph", "--skip-server-warmup"]
        if c.lora is not None:
            cmd += c.lora.flags(self.device)
        # the key from a private file (SGLang's --config YAML), not argv: `ps` shows every user the command line
        cmd += ["--config", self.secret_file("server.yaml", f"api-key: '{self.api_key}'\n")]
        return cmd + server_flags(c.sglang_args)

    def env(self) -> dict[str, str]:
        """CPU: the CPU engine switch and the ``sglang_site`` shim on ``PYTHONPATH``; then ``config.env``."""
        env = {}
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), os.environ.get("PYTHONPATH", "")) if p)
        return {**env, **self.config.env}

    async def generate(self, request: GenerateRequest, adapter: str | None = None) -> list[Completion]:
        """The ``n`` completions of one request (token ids, logprobs, text, finish reason), with LoRA ``adapter``.

        Raises:
            ValueError: for ``ignore_eos`` with ``stop_token_ids``: SGLang's ``ignore_eos`` turns off every stop
                token, where the other engines stop at them and ignore only EOS.

        """
        if request.params.ignore_eos and request.params.stop_token_ids:
            raise ValueError(
                "sampling_params.stop_token_ids cannot be combined with ignore_eos on SGLang engines (SGLang's "
                "ignore_eos also ignores stop_token_ids); send one of them, or use an embedded or vLLM engine"
            )
        sampling = sampling_fields(request.params, "max_new_tokens", "sampling_seed", keep_stop="no_stop_trim")
        body = {
            "input_ids": request.prompt_ids,
            "sampling_params": sampling,
            "return_logprob": True,
            "rid": request.request_id or None,
            "lora_path": adapter,
        }
        out = await self.post("/generate", {k: v for k, v in body.items() if v is not None})
        items = out if isinstance(out, list) else [out]
        completions = []
        for item in items:
            meta = item["meta_info"]
            finish = meta.get("finish_reason") or {}
            reason = {"stop": "stop", "length": "length"}.get(finish.get("type"), "abort")
            lps = [float(lp) for lp, _tok, _text in meta.get("output_token_logprobs") or []]
            # SGLang's `matched` is the EOS token too, where vLLM's stop_reason is None
            stop = finish.get("matched")
            stop = stop if isinstance(stop, str) or stop in request.params.stop_token_ids else None
            completions.append(
                Completion(list(item["output_ids"]), lps, reason, item.get("text", ""), stop_reason=stop)
            )
        return completions

    async def call(self, route: str, json: dict | None = None, method: str = "POST") -> dict:
        """A control route answering ``{"success", "message"}``; ``success: false`` raises ``SGLangError``."""
        try:
            out = await self.request(method, route, json)
        except ValueError as exc:  # SGLang answers 400 for a failed update
            raise SGLangError(str(exc)) from None
        if isinstance(out, dict) and out.get("success") is False:
            raise SGLangError(f"SGLang {route} failed: {out.get('message')}")
        return out

    async def weight_rows(self, names: list[str]) -> dict[str, list[float]]:
        """The first ``PROBE_VALUES`` values of each tensor's first row as the server holds it."""
        rows = {}
        for name in names:
            row = await self.post("/get_weights_by_name", {"name": name, "truncate_size": 1})
            rows[name] = _first_values(row)
        return rows


def _first_values(nested) -> list[float]:
    """The first ``PROBE_VALUES`` numbers of SGLang's ``tolist()[:1]`` (a list of one row, or one number)."""
    return np.asarray(nested, dtype=np.float64).reshape(-1)[:PROBE_VALUES].tolist()


__all__ = ["PROBE_VALUES", "SITE_DIR", "SGLangEngineConfig", "SGLangError", "SGLangLoRAConfig", "SGLangServer"]
