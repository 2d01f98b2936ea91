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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_and_ragged_decode_match_hf(arch, tiny_model_path, tiny_qwen2_path):
    """Prompts of different lengths share one prefill (right-padded) and one decode call at different positions."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_path if arch == "llama" else tiny_qwen2_path
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    model = build_engine_model(path)
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


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="model_type must be 'llama', 'qwen2' or 'mixtral'"):
        LlamaArgs.from_hf_config({"model_type": "gpt2"})
    cfg = {"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}}
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        LlamaArgs.from_hf_config(cfg)
