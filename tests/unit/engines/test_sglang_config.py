"""SGLangEngineConfig, the server command line and environment, and the CPU shim (no SGLang needed)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from server_commands import unstarted

from miles_ray.actors import RolloutPoolConfig
from miles_ray.engines.sglang import SITE_DIR, SGLangEngineConfig, SGLangLoRAConfig, SGLangServer, _first_values
from miles_ray.sync.checksum import probe_checksum, probe_rows


def test_sglang_args_may_not_override_what_the_engine_sets():
    with pytest.raises(ValueError, match=r"sglang_args may not set \['port', 'tp_size'\]"):
        SGLangEngineConfig(model_path="m", sglang_args={"port": 1, "tp_size": 2})
    with pytest.raises(ValueError, match="mem_fraction_static"):
        SGLangEngineConfig(model_path="m", mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="sglang_args keys must be flag names"):  # would be --host=0.0.0.0
        SGLangEngineConfig(model_path="m", sglang_args={"host=0.0.0.0": True})


def test_cpu_command_and_environment_apply_the_shim_and_gpu_ones_do_not():
    cfg = SGLangEngineConfig(model_path="/m", python="/py", tp_size=2, sglang_args={"chunked_prefill_size": 64})
    cpu, gpu = unstarted(SGLangServer, cfg, "cpu"), unstarted(SGLangServer, cfg, "cuda")
    cmd = cpu.command()
    assert cmd[:5] == ["/py", "-m", "sglang.launch_server", "--model-path", "/m"]
    for flag, value in [
        ("--port", "1234"),
        ("--tp-size", "2"),
        ("--device", "cpu"),
        ("--max-total-tokens", "4096"),
        ("--attention-backend", "torch_native"),
    ]:
        assert cmd[cmd.index(flag) + 1] == value
    assert cmd[cmd.index("--chunked-prefill-size") + 1] == "64" and "--disable-cuda-graph" in cmd
    assert "--enable-lora" not in cmd
    assert str(SITE_DIR) in cpu.env()["PYTHONPATH"] and cpu.env()["SGLANG_USE_CPU_ENGINE"] == "1"
    assert "--attention-backend" not in gpu.command() and gpu.env() == {}  # nothing of the shim on GPUs
    config = Path(cmd[cmd.index("--config") + 1])  # the server's key: in a private file, not on the command line
    assert config.read_text() == f"api-key: '{cpu.api_key}'\n" and config.stat().st_mode & 0o777 == 0o600
    assert not any(cpu.api_key in part for part in cmd)


def test_pool_config_selects_sglang():
    pool = RolloutPoolConfig(engine={"kind": "sglang", "model_path": "/m", "tp_size": 2})
    assert isinstance(pool.engine, SGLangEngineConfig) and pool.engine.tp_size == 2


def test_probe_matches_what_sglang_returns_for_a_row():
    weights = [("a.weight", torch.randn(40, 20)), ("norm.weight", torch.randn(20))]
    rows = probe_rows(weights)
    # SGLang's /get_weights_by_name answers tensor.tolist()[:truncate_size]
    served = {name: _first_values(t.tolist()[:1]) for name, t in weights}
    assert rows == served and len(rows["a.weight"]) == 16 and len(rows["norm.weight"]) == 1
    changed = [("a.weight", weights[0][1].clone().index_fill_(1, torch.tensor([3]), 0.0)), weights[1]]
    assert probe_checksum(probe_rows(changed)) != probe_checksum(rows)


def test_shim_supplies_sgl_kernel_only_when_missing():
    code = (
        "import sgl_kernel\n"
        "try:\n    sgl_kernel.rmsnorm_cpu(1)\nexcept NotImplementedError as e:\n    print('raised', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(SITE_DIR)}, capture_output=True, text=True, timeout=120
    )
    assert "raised sgl_kernel.rmsnorm_cpu was called" in out.stdout, out.stderr


def test_lora_config_sets_the_server_flags_and_checks_the_trainers_adapter():
    cfg = SGLangEngineConfig(model_path="/m", lora={"max_lora_rank": 8, "target_modules": ["q_proj", "v_proj"]})
    cpu, gpu = unstarted(SGLangServer, cfg, "cpu").command(), unstarted(SGLangServer, cfg, "cuda").command()
    assert cpu[cpu.index("--lora-target-modules") :][:3] == ["--lora-target-modules", "q_proj", "v_proj"]
    for flag, value in [("--max-lora-rank", "8"), ("--max-loras-per-batch", "2"), ("--lora-backend", "torch_native")]:
        assert cpu[cpu.index(flag) + 1] == value
    assert "--enable-lora" in gpu and "--lora-backend" not in gpu  # SGLang's own default kernels on GPUs
    with pytest.raises(ValueError, match=r"sglang_args may not set \['enable_lora'\]"):
        SGLangEngineConfig(model_path="/m", sglang_args={"enable_lora": True})  # the typed field does it
    with pytest.raises(ValueError, match="max_loras_per_batch"):
        SGLangLoRAConfig(max_lora_rank=8, target_modules=["q_proj"], max_loras_per_batch=1)

    lora = cfg.lora
    lora.check_adapter(8, ("q_proj",))
    with pytest.raises(ValueError, match="LoRA rank 16 exceeds SGLangEngineConfig.lora.max_lora_rank 8"):
        lora.check_adapter(16, ("q_proj",))
    with pytest.raises(ValueError, match=r"target modules \['o_proj'\] are not in"):
        lora.check_adapter(4, ("q_proj", "o_proj"))


def test_shim_drops_pinned_memory_only_without_an_accelerator():
    code = (
        "import sys, torch\n"
        "torch.empty(1, pin_memory=False)\n"
        "try:\n    torch.empty(1, pin_memory=True)\nexcept RuntimeError:\n    print('refused before')\n"
        "[f.find_spec('sglang.srt.lora') for f in sys.meta_path if type(f).__name__ == '_Fallbacks']\n"
        "t = torch.tensor([1, 2], pin_memory=True)\n"
        "print('after', t.tolist(), torch.empty(3, pin_memory=True).shape[0], t.pin_memory().tolist())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(SITE_DIR)}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    if torch.accelerator.is_available():  # pinning works there, and the shim leaves torch alone
        assert "refused before" not in out.stdout
    else:
        assert "refused before" in out.stdout and "after [1, 2] 3 [1, 2]" in out.stdout, out.stdout
