"""Model specs as an extension point: a family registered from a module outside the package serves in the engine."""

import json
import shutil
import sys
import textwrap

import pytest
import torch

from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.models import EngineModel, build_engine_model

# A user's own family, written to a directory outside the package: Cohere-style scaled logits over the Llama layout,
# published under its own model_type (a family the engine does not ship).
USER_MODULE = """
import torch

from miles_ray.models.llama import LlamaModel

LOGIT_SCALE = 8.0


class ScaledLlama(LlamaModel):
    def _logits(self, hidden):
        return super()._logits(hidden) * LOGIT_SCALE


def build(path, dtype):
    return ScaledLlama.from_hf_dir(path, dtype, family="llama")
"""


@pytest.fixture
def user_family(tmp_path, tiny_model_path, monkeypatch):
    """``(model_dir, import path of its spec)``: the tiny Llama's weights under model_type 'scaled_llama'."""
    (tmp_path / "scaled_family.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_path, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "scaled_llama"}))
    yield str(model_dir), "scaled_family:build"
    sys.modules.pop("scaled_family", None)


def test_a_family_registered_from_outside_the_package_serves(user_family, tiny_model_path):
    """The engine builds the user's model from the import path, samples from its (scaled) distribution, and the
    logprobs it reports are the user's model's, token by token (teacher-forced through HF's Llama, scaled)."""
    from transformers import AutoModelForCausalLM

    model_dir, spec = user_family
    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=model_dir, model_specs={"scaled_llama": spec}))
    assert type(engine.model).__name__ == "ScaledLlama"
    prompt = [1, 50, 60, 70]
    [out] = engine.generate([GenerateRequest(prompt, SamplingParams(n=2, max_new_tokens=8, ignore_eos=True, seed=1))])
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    for c in out.completions:
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
        scaled = torch.log_softmax(8.0 * logits, -1)
        ref = scaled.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=1e-5)
        plain = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert (plain - ref).abs().max() > 0.1  # the scale really changed the distribution

    # a callable works as well as its import path, and a user spec overrides a built-in family
    built = []

    def traced(path, dtype):
        built.append(str(path))
        return build_engine_model(path, dtype, {"scaled_llama": spec})

    model = build_engine_model(tiny_model_path, torch.float32, {"llama": traced, "scaled_llama": spec})
    assert built == [tiny_model_path] and type(model).__name__ == "LlamaModel"


def test_an_unknown_family_fails_where_the_config_is_made(tmp_path, tiny_model_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_path, model_dir)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(ValueError, match="model_type 'deepseek_v3' has no embedded-engine model spec") as err:
        EmbeddedEngineConfig(model_path=str(model_dir))
    for hint in ("'qwen3'", "'qwen3_moe'", "model_specs", "'vllm'", "'sglang'"):
        assert hint in str(err.value)
    with pytest.raises(ValueError, match="model_specs\\['deepseek_v3'\\] 'no_such_pkg:build' cannot be imported"):
        EmbeddedEngineConfig(model_path=str(model_dir), model_specs={"deepseek_v3": "no_such_pkg:build"})


def test_a_spec_whose_model_is_no_engine_model_is_refused(tiny_model_path):
    class Half(torch.nn.Module):  # a model without the engine's cache and decode methods
        args = None
        last_routes = None

        def prefill(self, input_ids, lengths, cache, first_slot, all_logits=False):
            return input_ids

    with pytest.raises(ValueError, match="built a Half that is no EngineModel: .*new_cache: method missing"):
        build_engine_model(tiny_model_path, torch.float32, {"llama": lambda path, dtype: Half()})
    with pytest.raises(ValueError, match="no EngineModel: \\['not an nn.Module'\\]"):
        build_engine_model(tiny_model_path, torch.float32, {"llama": lambda path, dtype: object()})
    assert EngineModel.__name__ == "EngineModel"
