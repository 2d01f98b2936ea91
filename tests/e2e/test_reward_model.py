"""RewardModelGroup on real Ray: scores equal the HF model's own, a reward model trained here ranks as trained,
and it serves as the reward of generate_groups."""

import pytest
import ray
import torch
from helpers import engines_and_router
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from miles_ray import placement
from miles_ray.actors import ModelReward, RewardModelConfig, RewardModelGroup
from miles_ray.data import DatasetSource, DatasetSourceConfig
from miles_ray.engines import SamplingParams
from miles_ray.rewards.safe import SafeGroupReward
from miles_ray.rollout import generate_groups

pytestmark = pytest.mark.e2e
PROMPTS = ["Is the sky blue?", [{"role": "user", "content": "Is fire cold?"}], "Do fish swim?", "Is snow hot?", "Hi"]
RESPONSES = ["yes", "no", "yes, they do", "no it is not", "hello there, how are you today?"]


def reward_model_dir(tiny_model_path, path, trained: bool) -> str:
    """The tiny model with a one-label score head; trained: a few Bradley-Terry steps preferring 'yes' to 'no'."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    if trained:
        questions = ["Is it good?", "Can you help?", "Will it work?", "Is this right?"]
        chosen = [chat(tokenizer, q, "yes") for q in questions]
        rejected = [chat(tokenizer, q, "no") for q in questions]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(30):
            good, bad = (model(**encode(tokenizer, texts)).logits[:, 0] for texts in (chosen, rejected))
            loss = -torch.nn.functional.logsigmoid(good - bad).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def chat(tokenizer, prompt, response) -> str:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)


def encode(tokenizer, texts):
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)


def test_scores_are_the_hf_models_own_over_replicas_and_batches(ray_cluster, tiny_model_path, tmp_path):
    path = reward_model_dir(tiny_model_path, tmp_path / "rm", trained=False)
    group = RewardModelGroup.remote(RewardModelConfig(model_path=path, num_replicas=2, batch_size=2))
    scores = ray.get(group.score.remote(PROMPTS, RESPONSES))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():  # one at a time, unpadded: what batching and padding must not change
        expected = [
            model(**encode(tokenizer, [chat(tokenizer, p, r)])).logits[0, 0].item() for p, r in zip(PROMPTS, RESPONSES)
        ]
    assert scores == pytest.approx(expected, abs=1e-4)
    assert len(set(round(s, 4) for s in scores)) == len(scores)  # distinct pairs, distinct scores: order is kept
    with pytest.raises(ray.exceptions.RayTaskError, match="score got 2 prompts and 1 responses"):
        ray.get(group.score.remote(PROMPTS[:2], RESPONSES[:1]))


def test_a_classifier_with_two_labels_is_refused_at_start(ray_cluster, tiny_model_path, tmp_path):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=2)
    model.save_pretrained(tmp_path / "two")
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path / "two")
    with pytest.raises(ray.exceptions.ActorDiedError, match="the model has 2 labels; needs 1"):
        ray.get(RewardModelGroup.remote(RewardModelConfig(model_path=str(tmp_path / "two"))).score.remote([], []))


def test_a_trained_reward_model_ranks_and_rewards_rollouts(make_placement, tiny_model_path, tmp_path):
    path = reward_model_dir(tiny_model_path, tmp_path / "rm", trained=True)
    group = RewardModelGroup.remote(RewardModelConfig(model_path=path))
    held_out = ["Is it late?", "Shall we go?", "Is that true?"]
    yes, no = (ray.get(group.score.remote(held_out, [answer] * 3)) for answer in ("yes", "no"))
    assert all(y > n for y, n in zip(yes, no))  # the preference it was trained on, on prompts it never saw

    _pool, _engines, router = engines_and_router(make_placement(placement.colocated(1)), tiny_model_path, 1)
    rows = [{"prompt": q} for q in held_out]
    config = DatasetSourceConfig(answer_column=None, shuffle=False)  # uid i is row i; the source's reward is unused
    source = DatasetSource(config, AutoTokenizer.from_pretrained(tiny_model_path), rows)
    reward = SafeGroupReward(ModelReward(group))
    refs = generate_groups(router, source, SamplingParams(n=3, max_new_tokens=6), num_prompts=2, reward=reward)
    for ref in refs:
        samples = ray.get(ref.ref)
        prompt = rows[samples[0].group_id]["prompt"]
        direct = ray.get(group.score.remote([prompt] * 3, [s.response_text for s in samples]))
        assert [s.reward for s in samples] == pytest.approx(direct, abs=1e-5)
