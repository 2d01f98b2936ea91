import pytest
import torch

from miles_ray.models import build_engine_model
from miles_ray.models.llama import LlamaArgs


@pytest.fixture(scope="module")
def tiny_qwen2_path(tmp_path_factory):
    """A small random Qwen2 (q/k/v biases, untied lm_head): the second architecture of the registry."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:  # HF initialises biases to zero; make them count
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3-untied", "qwen3_moe"])
def test_prefill_and_ragged_decode_match_hf(arch, request):
    """Prompts of different lengths share one prefill (right-padded) and one decode call at different positions."""
    from transformers import AutoModelForCausalLM

    from miles_ray.models.hub import tiny_qwen3_dir

    if arch == "qwen3-untied":
        path = str(tiny_qwen3_dir(tie_word_embeddings=False))
    else:
        fixture = {"llama": "tiny_model_path", "qwen2": "tiny_qwen2_path", "qwen3": "tiny_qwen3_path"}
        path = request.getfixturevalue(fixture.get(arch, "tiny_qwen3_moe_path"))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    model = build_engine_model(path)
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in hf.named_parameters()}  # sync names
    prompts = [torch.randint(0, 1000, (9,)), torch.randint(0, 1000, (5,))]
    ids = torch.zeros(2, 9, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    lengths = torch.tensor([9, 5])
    cache = model.new_cache(num_slots=3, slot_len=16)
    with torch.no_grad():
        every = model.prefill(ids, lengths, cache, first_slot=0, all_logits=True)
        last = model.prefill(ids, lengths, cache, first_slot=0)
        nxt = torch.tensor([3, 4])
        step = model.decode(nxt, lengths, cache)
        for i, p in enumerate(prompts):
            ref = hf(input_ids=p[None]).logits[0]
            torch.testing.assert_close(every[i, : len(p)], ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(last[i], ref[-1], atol=1e-5, rtol=1e-5)
            full = hf(input_ids=torch.cat([p, nxt[i : i + 1]])[None]).logits[0, -1]
            torch.testing.assert_close(step[i], full, atol=1e-5, rtol=1e-5)
        # a copied slot decodes like the original (prefix sharing, compaction)
        cache.copy_slot(1, 0, 6)
        again = model.decode(torch.tensor([9]), torch.tensor([6]), cache)
        ref = hf(input_ids=torch.cat([prompts[1], nxt[1:], torch.tensor([9])])[None]).logits[0, -1]
        torch.testing.assert_close(again[0], ref, atol=1e-5, rtol=1e-5)


def test_kv_bytes_per_slot(tiny_model_path):
    model = build_engine_model(tiny_model_path)
    cache = model.new_cache(num_slots=1, slot_len=32)
    assert model.kv_bytes_per_slot(32) == sum(t.numel() * t.element_size() for t in cache.k + cache.v)


def test_family_fields_follow_transformers():
    """Biases, q/k norms and which layers are sparse, as transformers builds each family."""
    base = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 4}
    base |= {"num_attention_heads": 2, "rms_norm_eps": 1e-6}
    llama = LlamaArgs.from_hf_config({**base, "model_type": "llama", "attention_bias": True})
    assert (llama.attention_bias, llama.o_bias, llama.qk_norm, llama.moe_layers) == (True, True, False, ())
    qwen2 = LlamaArgs.from_hf_config({**base, "model_type": "qwen2"})
    assert (qwen2.attention_bias, qwen2.o_bias) == (True, False)
    qwen3 = LlamaArgs.from_hf_config({**base, "model_type": "qwen3", "sliding_window": 4096})  # unused window
    assert (qwen3.attention_bias, qwen3.qk_norm) == (False, True)
    moe = {**base, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4}
    a = LlamaArgs.from_hf_config({**moe, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert (a.moe_layers, a.num_experts, a.moe_intermediate_size, a.norm_topk_prob) == ((1,), 4, 4, False)
    with pytest.raises(ValueError, match="sliding_window=64"):
        LlamaArgs.from_hf_config({**moe, "use_sliding_window": True, "sliding_window": 64})


def test_unsupported_architecture_is_named():
    known = "\\['llama', 'mixtral', 'qwen2', 'qwen3', 'qwen3_moe'\\]"
    with pytest.raises(ValueError, match=f"model_type must be one of {known}"):
        LlamaArgs.from_hf_config({"model_type": "gpt2"})
    cfg = {"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}}
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        LlamaArgs.from_hf_config(cfg)
