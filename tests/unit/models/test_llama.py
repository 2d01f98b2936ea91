import pytest
import torch

from miles_ray.models import build_engine_model
from miles_ray.models.llama import LlamaArgs


def test_engine_model_matches_hf_prefill_and_decode(tiny_model_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    model = build_engine_model(tiny_model_path)
    ids = torch.randint(0, 1000, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :4] = False  # left padding
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    cache = model.new_cache(2, 16)
    with torch.no_grad():
        ours = model(ids, pos, cache, 0, mask, last_only=False)
        ref = hf(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
        torch.testing.assert_close(ours[0], ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours[1, 4:], ref[1, 4:], atol=1e-5, rtol=1e-5)
        nxt = torch.tensor([[3], [4]])
        key_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.bool)], 1)
        step = model(nxt, pos[:, -1:] + 1, cache, 9, key_mask)
        full = hf(
            input_ids=torch.cat([ids, nxt], 1),
            attention_mask=key_mask.long(),
            position_ids=torch.cat([pos, pos[:, -1:] + 1], 1),
        ).logits[:, -1]
        torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="model_type must be 'llama' or 'qwen2'"):
        LlamaArgs.from_hf_config({"model_type": "gpt2"})
    cfg = {"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}}
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        LlamaArgs.from_hf_config(cfg)
