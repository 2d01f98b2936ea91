"""HF <-> Megatron GPT weight conversion: per-TP-rank shards, a bit-exact round trip, named errors (no megatron)."""

import pytest
import torch

from miles_ray.backends.megatron_convert import GPTShape, hf_to_megatron, megatron_to_hf


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
        for name, rows, cols in (
            ("self_attn.q_proj", q, hidden),
            ("self_attn.k_proj", kv, hidden),
            ("self_attn.v_proj", kv, hidden),
            ("self_attn.o_proj", hidden, q),
            ("mlp.gate_proj", inter, hidden),
            ("mlp.up_proj", inter, hidden),
            ("mlp.down_proj", hidden, inter),
        ):
            hf[p + name + ".weight"] = torch.randn(rows, cols, generator=g)
        if shape.qkv_bias:
            for name, rows in (("q", q), ("k", kv), ("v", kv)):
                hf[f"{p}self_attn.{name}_proj.bias"] = torch.randn(rows, generator=g)
        hf[p + "input_layernorm.weight"] = torch.randn(hidden, generator=g)
        hf[p + "post_attention_layernorm.weight"] = torch.randn(hidden, generator=g)
    return hf


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_round_trip_is_bit_exact(tp, arch):
    """Qwen2 (q/k/v biases, untied head) and Llama (GQA, tied head), each split over 1 and 2 TP ranks."""
    shape = GPTShape(
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=arch == "llama",
        qkv_bias=arch == "qwen2",
    )
    hf = _random_hf(shape, untied=arch == "qwen2")
    shards = [hf_to_megatron(hf, shape, tp, r) for r in range(tp)]
    assert set(shards[0]) == set(shards[-1])
    assert ("output_layer.weight" in shards[0]) == (arch == "qwen2")
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


def test_errors_name_the_cause():
    shape = GPTShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True, qkv_bias=False)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4 must divide num_key_value_heads=2"):
        hf_to_megatron(_random_hf(shape), shape, 4, 0)
    with pytest.raises(ValueError, match="model_type must be 'llama' or 'qwen2' for the Megatron backend"):
        GPTShape.from_hf_config({"model_type": "mixtral"})
    with pytest.raises(ValueError, match="unknown tensor 'decoder.layers.0.mlp.router.weight'"):
        megatron_to_hf({"decoder.layers.0.mlp.router.weight": [torch.zeros(1)]}, shape)
