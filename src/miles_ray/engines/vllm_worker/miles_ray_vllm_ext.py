"""vLLM worker extension (``--worker-extension-cls miles_ray_vllm_ext.WeightLoader``), run inside vLLM.

This directory is put on the vLLM server's ``PYTHONPATH``; the file imports nothing from miles_ray as a
package (the server's environment need not have it) and loads the weight digest by file path, so the
checksum it returns is computed exactly as the trainer computes its own.
"""

import hashlib
import hmac
import importlib.util
import os
from pathlib import Path

_DIGEST = Path(__file__).resolve().parents[2] / "sync" / "digest.py"


def _digest_module():
    spec = importlib.util.spec_from_file_location("miles_ray_digest", _DIGEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _repack_tied_heads(model) -> None:
    """CPU backend: re-pack every embedding-method GEMM from its current weight.

    On CPU, vLLM packs each LM head for its GEMM kernel after loading. A tied head shares the embedding's
    weight, receives no tensor of its own in a reload, and so would keep multiplying by the old packed
    copy (measured: logprobs off by ~1.3 after an embedding update). Re-packing it from the shared, updated
    weight fixes that; on GPUs the head reads the shared tensor directly and there is nothing to do.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if type(method).__name__ == "UnquantizedEmbeddingMethod" and hasattr(module, "cpu_linear"):
            method.process_weights_after_loading(module)


class WeightLoader:
    """Methods vLLM adds to every worker; called through the server's ``/collective_rpc`` route."""

    def miles_ray_load_weights(self, path: str, verify: str = "1") -> str:
        """Reload the model in place from the HF-named tensors in safetensors file ``path``.

        Returns:
            The digest of the tensors loaded (``""`` unless ``verify == "1"``): what reached this process.

        """
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        _repack_tied_heads(self.model_runner.get_model())
        return _digest_module().named_tensors_checksum(tensors.items()) if verify == "1" else ""


class RequireKey:
    """ASGI middleware (``--middleware miles_ray_vllm_ext.RequireKey``): a bearer key on every route but /health.

    The key is ``$MILES_RAY_SERVER_API_KEY``, sent as ``Authorization: Bearer <key>``.

    vLLM's own ``--api-key`` guards only ``/v1``-style routes, not the dev-mode ones miles_ray drives
    (``/collective_rpc`` runs code in the workers, ``/pause``, ``/resume``), which any local user could call.
    """

    def __init__(self, app):
        self.app = app
        key = os.environ.get("MILES_RAY_SERVER_API_KEY", "")
        if not key:
            raise RuntimeError("MILES_RAY_SERVER_API_KEY is not set: the server would be open to every local user")
        self._digest = hashlib.sha256(f"Bearer {key}".encode()).digest()

    async def __call__(self, scope, receive, send):
        """Pass authorised requests (and /health, for start-up polling) on; answer others 401."""
        if scope["type"] not in ("http", "websocket") or scope.get("path") == "/health":
            return await self.app(scope, receive, send)
        sent = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(hashlib.sha256(sent).digest(), self._digest):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = b'{"error": "missing or wrong bearer token"}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
