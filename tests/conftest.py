import os
import socket
import subprocess
import sys
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray workers import test modules (for callables defined in them) and so need tests/e2e/helpers.py (and the other
# shared modules there) on their path
_E2E = os.path.join(os.path.dirname(__file__), "e2e")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_E2E, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from miles_ray.models.hub import tiny_llama_dir

    return str(tiny_llama_dir())


@pytest.fixture(scope="session")
def tiny_moe_path() -> str:
    """A small random Mixtral: 2 MoE layers, 8 experts, top-2 (the MoE model spec's test model)."""
    from miles_ray.models.hub import tiny_moe_dir

    return str(tiny_moe_dir())


@pytest.fixture(scope="session")
def tiny_qwen3_path() -> str:
    """A small random Qwen3 (per-head q/k norms drawn around 1, tied head)."""
    from miles_ray.models.hub import tiny_qwen3_dir

    return str(tiny_qwen3_dir())


@pytest.fixture(scope="session")
def tiny_qwen3_moe_path() -> str:
    """A small random Qwen3-MoE: MoE layers 0 and 2 around a dense layer 1, 8 experts, top-2, untied head."""
    from miles_ray.models.hub import tiny_qwen3_moe_dir

    return str(tiny_qwen3_moe_dir())


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The real SmolLM2-135M-Instruct (converted once from the offline GGUF package, ~20 s): for behaviour a random
    model cannot show, such as following a tool-calling format."""
    from miles_ray.models.hub import model_dir

    return str(model_dir("smollm2-135m"))


@pytest.fixture(scope="session")
def hf(tiny_model_path):
    """The tiny model as a plain HF module (the reference the engine's numerics are checked against)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


@pytest.fixture(scope="session")
def teacher_forced(hf):
    """``(prompt_ids, response_ids) -> [len(response_ids)]`` fp32 logprobs of the response under ``hf``."""
    import torch

    def logprobs(prompt: list[int], tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
        lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        return lp.gather(1, torch.tensor(tokens)[:, None])[:, 0]

    return logprobs


@pytest.fixture(scope="session")
def greedy_and_a_piece():
    """``(engine, width) -> (prompt, response, i, piece)``: a greedy response of an embedded engine (24 tokens,
    ``ignore_eos``) and the text of its tokens ``i..i+width-1`` (``i >= 2``), found once in its text: a stop string
    to end a second run at. A random model's greedy text often repeats itself: prompts are tried until one's has
    such a piece."""
    from miles_ray.engines.requests import GenerateRequest, SamplingParams

    def pick(engine, width: int):
        params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
        for prompt in ([1, 50, 60, 70, 80], [1000, 2000, 3000], [4321, 87, 9000, 1234], [300, 301, 302, 303]):
            [first] = engine.generate([GenerateRequest(prompt, params)])[0].completions
            for i in range(2, 20):
                piece = engine.tokenizer.decode(first.token_ids[i : i + width], skip_special_tokens=True)
                if piece.isascii() and len(piece.strip()) >= 2 and first.text.count(piece) == 1:
                    return prompt, first, i, piece
        raise AssertionError(f"no piece of {width} tokens to stop at in {first.text!r}")

    return pick


@pytest.fixture(scope="session")
def ray_cluster():
    """One real local Ray cluster for the whole session; 8 logical CPUs so fractional actors fit on 2 cores."""
    import ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    # metrics are exported to Prometheus on metrics_port (tests/e2e/test_observability.py scrapes it)
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    ray.miles_ray_metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def server(tiny_model_path):
    """One real engine HTTP server process (the CLI) on the tiny model, bearer token ``test-key`` (given by the
    environment, not the command line); yields its URL."""
    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "miles_ray.engines.http_server", "--model-path", tiny_model_path]
    cmd += ["--port", str(port), "--max-batch-size", "8", "--max-seq-len", "128", "--served-model-name", "tiny"]
    env = {**os.environ, "MILES_RAY_ENGINE_API_KEY": "test-key"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if requests.get(f"{url}/health", headers={"Authorization": "Bearer test-key"}, timeout=1).ok:
                break
        except requests.ConnectionError:
            time.sleep(0.3)
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
    yield url
    proc.terminate()
    proc.wait(timeout=30)
