"""HF <-> Megatron GPT weight conversion: per-TP-rank shards, a bit-exact round trip, named errors (no megatron)."""

import pytest
import torch

from miles_ray.backends.megatron_convert import (
    GPTShape,
    expert_on_rank,
    from_stage,
    hf_to_megatron,
    megatron_sources,
    megatron_to_hf,
    on_stage,
    stage_layers,
    to_stage,
)


def _random_hf(shape: GPTShape, hidden=32, inter=48, vocab=64, untied=False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hf = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
        "model.norm.weight": torch.randn(hidden, generator=g),
    }
    if untied:
        hf["lm_head.weight"] = torch.randn(vocab, hidden, generator=g)
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        mlp = [("mlp.gate_proj", inter, hidden), ("mlp.up_proj", inter, hidden), ("mlp.down_proj", hidden, inter)]
        if i in shape.moe_layers:  # HF's in-memory MoE layout: router and fused experts
            e = shape.num_experts
            mlp = [("mlp.gate", e, hidden)]
            hf[p + "mlp.experts.gate_up_proj"] = torch.randn(e, 2 * inter, hidden, generator=g)
            hf[p + "mlp.experts.down_proj"] = torch.randn(e, hidden, inter, generator=g)
        for name, rows, cols in [
            ("self_attn.q_proj", q, hidden),
            ("self_attn.k_proj", kv, hidden),
            ("self_attn.v_proj", kv, hidden),
            ("self_attn.o_proj", hidden, q),
            *mlp,
        ]:
            hf[p + name + ".weight"] = torch.randn(rows, cols, generator=g)
        if shape.qkv_bias:
            for name, rows in (("q", q), ("k", kv), ("v", kv)):
                hf[f"{p}self_attn.{name}_proj.bias"] = torch.randn(rows, generator=g)
        if shape.qk_norm:
            for name in ("q_norm", "k_norm"):
                hf[f"{p}self_attn.{name}.weight"] = torch.randn(shape.head_dim, generator=g)
        hf[p + "input_layernorm.weight"] = torch.randn(hidden, generator=g)
        hf[p + "post_attention_layernorm.weight"] = torch.randn(hidden, generator=g)
    return hf


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_round_trip_is_bit_exact(tp, arch):
    """Qwen2 (q/k/v biases, untied head), Llama (GQA, tied head), Qwen3 (per-head q/k norms, untied) and Qwen3-MoE
    (MoE layers 0 and 2 around a dense one: router, fused experts), each split over 1 and 2 TP ranks."""
    moe = arch == "qwen3_moe"
    shape = GPTShape(
        num_layers=3 if moe else 2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=arch == "llama",
        qkv_bias=arch == "qwen2",
        qk_norm=arch.startswith("qwen3"),
        num_experts=4 if moe else 0,
        moe_layers=(0, 2) if moe else (),
    )
    hf = _random_hf(shape, untied=arch != "llama")
    shards = [hf_to_megatron(hf, shape, tp, r) for r in range(tp)]
    assert set(shards[0]) == set(shards[-1])
    assert ("output_layer.weight" in shards[0]) == (arch != "llama")
    assert ("decoder.layers.1.self_attention.k_layernorm.weight" in shards[0]) == shape.qk_norm
    if moe:  # rank r's expert 3 holds its gate and up rows of rank r, and its down columns of rank r
        expert = shards[-1]["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"]
        gate, up = hf["model.layers.2.mlp.experts.gate_up_proj"][3].chunk(2)
        assert torch.equal(expert, torch.cat([gate.chunk(tp)[-1], up.chunk(tp)[-1]]))
        down = shards[-1]["decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"]
        assert torch.equal(down, hf["model.layers.2.mlp.experts.down_proj"][3].chunk(tp, dim=1)[-1])
        assert "decoder.layers.1.mlp.router.weight" not in shards[0]  # the dense layer
        sources = megatron_sources("model.layers.0.mlp.experts.down_proj", shape)
        assert sources == [f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc2.weight" for e in range(4)]
        # at EP=2 expert 3 is local expert 1 of rank 1, and back
        assert expert_on_rank(sources[3], 2) == sources[1] and expert_on_rank(sources[1], 2, ep_rank=1) == sources[3]
        assert expert_on_rank("decoder.layers.0.mlp.router.weight", 2) == "decoder.layers.0.mlp.router.weight"
        ep_shards = [hf_to_megatron(hf, shape, 1, 0, ep=2, ep_rank=r) for r in range(2)]
        everything = hf_to_megatron(hf, shape, 1, 0)
        assert torch.equal(ep_shards[1][sources[1]], everything[sources[3]])  # EP rank 1 holds experts 2 and 3
        assert sources[3] not in ep_shards[1]
    assert shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (4 * 8 // tp * 2, 32)
    back = megatron_to_hf({n: [s[n] for s in shards] for n in shards[0]}, shape)
    assert set(back) == set(hf)
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_megatron_layouts_per_rank():
    """Rank 1 of 2 holds KV group 1 ([q heads 2-3, k1, v1]) and the second halves of gate and up."""
    shape = GPTShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True, qkv_bias=False)
    hf = _random_hf(shape)
    shard = hf_to_megatron(hf, shape, 2, 1)
    qkv = shard["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(qkv, torch.cat([q[16:32], k[8:16], v[8:16]]))
    fc1 = shard["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate[24:], up[24:]]))
    assert torch.equal(
        shard["decoder.layers.0.self_attention.linear_proj.weight"],
        hf["model.layers.0.self_attn.o_proj.weight"][:, 16:],
    )


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_stages_split_the_layers_and_rename_them(tied):
    """PP=2 on 4 layers: stage 0 holds the embedding and layers 0-1, stage 1 layers 2-3 (as its 0-1), the final norm
    and the output layer (a copy of the embedding when tied); together they hold every tensor once."""
    shape = GPTShape(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=tied, qkv_bias=False)
    full = hf_to_megatron(_random_hf(shape, untied=not tied), shape, 1, 0)
    first, last = (to_stage(full, shape, 2, r) for r in range(2))
    assert "embedding.word_embeddings.weight" in first and "decoder.final_layernorm.weight" in last
    assert torch.equal(last["decoder.layers.0.mlp.linear_fc1.weight"], full["decoder.layers.2.mlp.linear_fc1.weight"])
    assert torch.equal(
        last["output_layer.weight"], full["output_layer.weight" if not tied else "embedding.word_embeddings.weight"]
    )
    for r, stage in enumerate((first, last)):
        assert {from_stage(n, shape, 2, r) for n in stage} - {"output_layer.weight"} == {
            n for n in full if on_stage(n, shape, 2, r) is not None
        } - {"output_layer.weight"}
        assert all(on_stage(from_stage(n, shape, 2, r), shape, 2, r) == n for n in stage)
    assert len(first) + len(last) == len(full) + tied  # the tied head's copy
    assert to_stage(full, shape, 1, 0) == full
    assert list(stage_layers(4, 2, 1)) == [2, 3]
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=3 must divide the model's num_hidden_layers=4"):
        stage_layers(4, 3, 0)


def test_errors_name_the_cause():
    shape = GPTShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True, qkv_bias=False)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4 must divide num_key_value_heads=2"):
        hf_to_megatron(_random_hf(shape), shape, 4, 0)
    with pytest.raises(
        ValueError, match="model_type must be one of \\['llama', 'qwen2', 'qwen3', 'mixtral', 'qwen3_moe'\\]"
    ):
        GPTShape.from_hf_config({"model_type": "deepseek_v3"})
    cfg = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1}
    cfg |= {"num_attention_heads": 2, "rms_norm_eps": 1e-6, "model_type": "llama", "attention_bias": True}
    with pytest.raises(ValueError, match="attention_bias=True \\(an o_proj bias\\) is not supported"):
        GPTShape.from_hf_config(cfg)
    with pytest.raises(ValueError, match="unknown tensor 'decoder.layers.0.mlp.shared_experts.weight'"):
        megatron_to_hf({"decoder.layers.0.mlp.shared_experts.weight": [torch.zeros(1)]}, shape)
    moe = GPTShape(1, 4, 2, 8, True, False, num_experts=2, moe_layers=(0,))
    one_expert = {"decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight": [torch.zeros(2, 2)]}
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.down_proj needs experts 0..1, got \\[1\\]"):
        megatron_to_hf(one_expert, moe)
