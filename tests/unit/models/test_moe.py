"""The engine's MoE specs (Mixtral, Qwen3-MoE): logits and router choices equal HF's, checkpoint mapping."""

import pytest
import torch

from miles_ray.models import build_engine_model
from miles_ray.models.moe import fuse_checkpoint_experts


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_prefill_decode_and_routes_match_hf(family, tiny_moe_path, tiny_qwen3_moe_path):
    """Qwen3-MoE's dense layer 1 records no route: routes are per MoE layer, as HF's routers are."""
    from transformers import AutoModelForCausalLM

    from miles_ray.backends.routing import find_routers

    path = tiny_moe_path if family == "mixtral" else tiny_qwen3_moe_path
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = build_engine_model(path)
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in hf.named_parameters()}  # sync names
    seen = []  # HF router choices, layer by layer
    hooks = [m.register_forward_hook(lambda _m, _a, out: seen.append(out[2])) for m in find_routers(hf)]
    assert len(hooks) == 2
    torch.manual_seed(0)
    prompt = torch.randint(0, 1000, (7,))
    cache = model.new_cache(num_slots=1, slot_len=16)
    with torch.no_grad():
        every = model.prefill(prompt[None], torch.tensor([7]), cache, first_slot=0, all_logits=True)
        prefill_routes = model.last_routes
        step = model.decode(torch.tensor([11]), torch.tensor([7]), cache)
        decode_routes = model.last_routes
        seq = torch.cat([prompt, torch.tensor([11])])[None]
        ref = hf(input_ids=seq).logits[0]
    for h in hooks:
        h.remove()
    torch.testing.assert_close(every[0], ref[:7], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[0], ref[7], atol=1e-5, rtol=1e-5)
    hf_routes = torch.stack(seen, dim=1)  # [8 tokens, layers, k]
    assert prefill_routes.shape == (1, 7, 2, 2) and decode_routes.shape == (1, 1, 2, 2)
    recorded = torch.cat([prefill_routes[0], decode_routes[0]]).long()
    assert torch.equal(recorded.sort(-1).values, hf_routes.sort(-1).values)


def test_checkpoint_experts_fuse_and_incomplete_ones_are_named():
    e, h, i = 3, 4, 5
    state = {"model.layers.0.block_sparse_moe.gate.weight": torch.randn(e, h)}
    for k in range(e):
        for w, shape in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i))):
            state[f"model.layers.0.block_sparse_moe.experts.{k}.{w}.weight"] = torch.randn(shape)
    fused = fuse_checkpoint_experts(state, e)
    assert set(fused) == {
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    }
    gate_up = fused["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (e, 2 * i, h)
    assert torch.equal(gate_up[1, :i], state["model.layers.0.block_sparse_moe.experts.1.w1.weight"])
    assert torch.equal(gate_up[1, i:], state["model.layers.0.block_sparse_moe.experts.1.w3.weight"])
    del state["model.layers.0.block_sparse_moe.experts.2.w2.weight"]
    with pytest.raises(ValueError, match="model.layers.0: checkpoint holds experts \\[0, 1\\] of down"):
        fuse_checkpoint_experts(state, e)


def test_sliding_window_mixtral_is_refused(tmp_path):
    import json

    from miles_ray.models.llama import LlamaArgs

    cfg = {"model_type": "mixtral", "sliding_window": 4096, "vocab_size": 8, "hidden_size": 8}
    with pytest.raises(ValueError, match="sliding_window=4096"):
        LlamaArgs.from_hf_config(cfg)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(ValueError, match="model_type 'deepseek_v3' has no embedded-engine model spec"):
        build_engine_model(tmp_path)
