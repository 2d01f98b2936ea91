"""The Megatron-core backend through TrainerGroup, for real on CPU (gloo): TP=2 vs TP=1, dist-checkpoint
resharding, HF export, and GRPO where the engines receive the Megatron-trained weights."""

import pytest
import ray
import torch
from installs import import_or_missing

import_or_missing("megatron.core", "megatron")

from helpers import grpo_in_step, synthetic_group, tiny_stack  # noqa: E402

from miles_ray import placement  # noqa: E402
from miles_ray.actors import TrainerGroup, TrainerGroupConfig  # noqa: E402
from miles_ray.models.hub import tiny_qwen3_moe_dir  # noqa: E402
from miles_ray.types import GroupRef, Sample  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.megatron]


def _megatron(path, tp, num_ranks=None, lr=1e-2, ep=1, sp=False, max_tokens=None, pp=1):
    parallel = {"tensor_model_parallel_size": tp, "expert_model_parallel_size": ep, "sequence_parallel": sp}
    parallel["pipeline_model_parallel_size"] = pp
    backend = {"kind": "megatron", "parallel": parallel, "max_tokens_per_micro_batch": max_tokens}
    num_ranks = num_ranks or tp * ep * pp
    return TrainerGroupConfig(model_path=path, num_ranks=num_ranks, optimizer={"lr": lr}, backend=backend)


def _uneven_groups() -> list[GroupRef]:
    """Two groups of unlike lengths: on 2 data-parallel ranks, one each; with max_tokens=32 the rank with the long
    responses (49 packed tokens) cuts them into 2 micro-batches, the other has 11 tokens for one."""
    long = [Sample([7, 2, 3], [4 + i] * (10 + i), [-1.0] * (10 + i), reward=float(i), group_id=1) for i in range(4)]
    return synthetic_group(0) + [GroupRef(ray.put(long), 4, 0, 1)]


def _flat(lists):
    return torch.tensor([x for row in lists for x in row])


def _same_step_and_export(one, many, tmp_path, export_tolerance: float, batch=None) -> torch.Tensor:
    """One train step of ``one`` (a single rank) and ``many`` (a parallel layout) on the same batch (default: two
    synthetic groups): equal metrics, equal logprobs after, and HF exports with the same names and weights; returns
    ``many``'s logprobs after."""
    from safetensors.torch import load_file

    batch = batch or synthetic_group(0) + synthetic_group(1, first_token=7)
    m1, m_many = ray.get([one.train_step.remote(batch), many.train_step.remote(batch)])
    for key in ("loss", "grad_norm", "entropy", "num_tokens"):
        assert m_many[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key  # the GRPO loss is ~0 at ratio 1
    after1, after_many = ray.get([one.compute_logprobs.remote(batch), many.compute_logprobs.remote(batch)])
    torch.testing.assert_close(_flat(after_many), _flat(after1), atol=1e-5, rtol=1e-5)
    ray.get([g.export_hf.remote(str(tmp_path / n), "float32") for g, n in ((one, "one"), (many, "many"))])
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "many" / "model.safetensors")
    assert set(a) == set(b) and max((a[n] - b[n]).abs().max().item() for n in a) < export_tolerance
    return _flat(after_many)


def _untrained_export_is_the_original(two, path, out) -> None:
    """HF -> Megatron (TP=2 shards, or two pipeline stages with the tied embedding on both) -> HF without a step in
    between is the same bits."""
    from safetensors.torch import load_file

    ray.get(two.export_hf.remote(str(out), "float32"))
    original, exported = load_file(f"{path}/model.safetensors"), load_file(out / "model.safetensors")
    names = set(original) - {"lm_head.weight"}  # tied head: written or not, it is the embedding
    assert names <= set(exported) and all(torch.equal(original[n], exported[n]) for n in names)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tp2_equals_tp1_and_a_tp2_checkpoint_reloads_at_tp1(make_placement, family, request, tmp_path):
    """Qwen3: each TP rank normalises its own q/k heads, so the q/k norm grads are summed over the TP ranks. Llama:
    before the step, the TP=2 group's export is the original's bits."""
    tiny_model_path = request.getfixturevalue("tiny_model_path" if family == "llama" else "tiny_qwen3_path")
    tp1 = TrainerGroup.remote(_megatron(tiny_model_path, 1), make_placement(placement.colocated(1)))
    tp2 = TrainerGroup.remote(_megatron(tiny_model_path, 2), make_placement(placement.colocated(2)))
    if family == "llama":  # the round trip of TP=2 shards before any step (one family: the same code for both)
        _untrained_export_is_the_original(tp2, tiny_model_path, tmp_path / "untrained")
    batch = synthetic_group(0) + synthetic_group(1, first_token=7)
    before1, before2 = ray.get([tp1.compute_logprobs.remote(batch), tp2.compute_logprobs.remote(batch)])
    torch.testing.assert_close(_flat(before2), _flat(before1), atol=1e-5, rtol=1e-5)
    m1, m2 = ray.get([tp1.train_step.remote(batch), tp2.train_step.remote(batch)])
    for key in ("loss", "grad_norm", "entropy", "num_tokens"):  # same step: one model split in two, or not
        assert m2[key] == pytest.approx(m1[key], rel=1e-4), key
    after1, after2 = ray.get([tp1.compute_logprobs.remote(batch), tp2.compute_logprobs.remote(batch)])
    torch.testing.assert_close(_flat(after2), _flat(after1), atol=1e-5, rtol=1e-5)
    assert (_flat(after2) - _flat(before2)).abs().max() > 1e-3

    ray.get(tp2.save.remote(str(tmp_path / "ckpt")))  # dist_checkpointing, written by 2 TP ranks
    fresh = TrainerGroup.remote(_megatron(tiny_model_path, 1), make_placement(placement.colocated(1)))
    ray.get(fresh.load.remote(str(tmp_path / "ckpt")))  # resharded to TP=1, optimizer state included
    reloaded = _flat(ray.get(fresh.compute_logprobs.remote(batch)))
    torch.testing.assert_close(reloaded, _flat(after2), atol=1e-6, rtol=1e-6)
    # one more step from the reloaded state equals one more step of the TP=2 run
    m_fresh, m_tp2 = ray.get([fresh.train_step.remote(batch), tp2.train_step.remote(batch)])
    assert m_fresh["loss"] == pytest.approx(m_tp2["loss"], rel=1e-4)
    assert m_fresh["grad_norm"] == pytest.approx(m_tp2["grad_norm"], rel=1e-4)

    # HF export from TP=2 shards: transformers loads it and gives the trainer's logprobs
    from transformers import AutoModelForCausalLM

    ray.get(tp2.export_hf.remote(str(tmp_path / "hf"), "float32"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    samples = [s for g in ray.get([g.ref for g in batch]) for s in g]
    trained = ray.get(tp2.compute_logprobs.remote(batch))
    for s, lp in zip(samples, trained):
        with torch.no_grad():
            logits = hf(torch.tensor([s.prompt_ids + s.response_ids])).logits[0, len(s.prompt_ids) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp), ref, atol=1e-5, rtol=1e-5)


def test_two_data_parallel_tp2_groups_equal_one_rank(make_placement, tiny_model_path, tmp_path):
    """4 ranks = 2 DP x 2 TP: each TP group trains on its half of the batch; same step as one rank on all of it."""
    one = TrainerGroup.remote(_megatron(tiny_model_path, 1), make_placement(placement.colocated(1)))
    four = TrainerGroup.remote(_megatron(tiny_model_path, 2, num_ranks=4), make_placement(placement.colocated(4)))
    _same_step_and_export(one, four, tmp_path, export_tolerance=2e-4)  # the export: rank 0's TP group alone


def test_grpo_with_megatron_tp2_engines_get_the_weights(make_placement, tiny_model_path):
    pl = make_placement(placement.disaggregated(2, 1))
    trainer = _megatron(tiny_model_path, 2, lr=1e-3).model_dump()
    stack = tiny_stack(pl, tiny_model_path, num_ranks=2, trainer=trainer)  # disaggregated: broadcast transport

    def check(samples, metrics):  # TP peers share a data shard: tokens counted once
        assert metrics["num_tokens"] == sum(len(s.response_ids) for s in samples)

    checksums = grpo_in_step(stack.trainer, stack.router, stack.broadcaster, tiny_model_path, check=check)
    assert len(set(checksums)) == 2


def test_ep2_equals_ep1_and_an_ep2_checkpoint_reloads_at_ep1(make_placement, tiny_qwen3_moe_path, tmp_path):
    """Qwen3-MoE with its experts spread over 2 ranks (4 each; the ranks are data-parallel peers for the rest): the
    same step as one rank holding all 8; the EP=2 checkpoint reloads at EP=1 and takes the same next step; the HF
    export gathers every expert and transformers loads it with the trainer's logprobs. The ranks' shards differ in
    length and micro-batch count (megatron's dispatcher all-gathers tokens over the EP ranks: the backend evens
    both out)."""
    path = tiny_qwen3_moe_path
    ep1 = TrainerGroup.remote(_megatron(path, 1, max_tokens=32), make_placement(placement.colocated(1)))
    ep2 = TrainerGroup.remote(_megatron(path, 1, ep=2, max_tokens=32), make_placement(placement.colocated(2)))
    batch = _uneven_groups()
    before1, before2 = ray.get([ep1.compute_logprobs.remote(batch), ep2.compute_logprobs.remote(batch)])
    torch.testing.assert_close(_flat(before2), _flat(before1), atol=1e-5, rtol=1e-5)
    m1, m2 = ray.get([ep1.train_step.remote(batch), ep2.train_step.remote(batch)])
    for key in ("loss", "grad_norm", "entropy", "num_tokens"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key  # the GRPO loss is ~0 at ratio 1
    after1, after2 = ray.get([ep1.compute_logprobs.remote(batch), ep2.compute_logprobs.remote(batch)])
    torch.testing.assert_close(_flat(after2), _flat(after1), atol=1e-5, rtol=1e-5)
    assert (_flat(after2) - _flat(before2)).abs().max() > 1e-3

    ray.get(ep2.save.remote(str(tmp_path / "ckpt")))  # dist_checkpointing: each rank writes its experts
    fresh = TrainerGroup.remote(_megatron(path, 1), make_placement(placement.colocated(1)))
    ray.get(fresh.load.remote(str(tmp_path / "ckpt")))  # all 8 experts on one rank, optimizer state included
    torch.testing.assert_close(_flat(ray.get(fresh.compute_logprobs.remote(batch))), _flat(after2), atol=1e-6, rtol=0)
    m_fresh, m_ep2 = ray.get([fresh.train_step.remote(batch), ep2.train_step.remote(batch)])
    assert m_fresh["loss"] == pytest.approx(m_ep2["loss"], rel=1e-4, abs=1e-6)
    assert m_fresh["grad_norm"] == pytest.approx(m_ep2["grad_norm"], rel=1e-4)

    from transformers import AutoModelForCausalLM

    ray.get(ep2.export_hf.remote(str(tmp_path / "hf"), "float32"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    samples = [s for g in ray.get([g.ref for g in batch]) for s in g]
    for s, lp in zip(samples, ray.get(ep2.compute_logprobs.remote(batch))):
        with torch.no_grad():
            logits = hf(torch.tensor([s.prompt_ids + s.response_ids])).logits[0, len(s.prompt_ids) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["ep2", "pp2"])
def test_grpo_on_qwen3_moe_with_megatron_ep2_or_pp2_and_routing_replay(make_placement, layout):
    """Two GRPO steps: Megatron EP=2 (or PP=2: each stage replays its own layers' routes, micro-batches through the
    1F1B schedule) with routing replay, two embedded engines recording routes; before each step the trainer's fp32
    logprobs equal the engines' (< 1e-4), the replayed routes leave no mismatch, and each sync (experts gathered
    over the EP group, layers over the stages) is verified on both engines."""
    path = str(tiny_qwen3_moe_dir(num_layers=4))  # MoE layers 0, 2, 3: stage 0 holds one, stage 1 two
    pl = make_placement(placement.disaggregated(2, 2))
    ep, pp = (2, 1) if layout == "ep2" else (1, 2)
    trainer = _megatron(path, 1, lr=1e-3, ep=ep, pp=pp, max_tokens=64).model_dump()
    trainer["backend"]["routing_replay"] = True
    stack = tiny_stack(pl, path, num_ranks=2, num_engines=2, trainer=trainer)  # broadcast transport

    def check(samples, metrics):  # a route per fed token and per MoE layer (layer 1 is dense)
        assert all(s.routes.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, 3, 2) for s in samples)
        assert metrics["moe_route_mismatch_frac"] == 0.0

    checksums = grpo_in_step(stack.trainer, stack.router, stack.broadcaster, path, check=check)
    assert len(set(checksums)) == 2


def test_tp2_x_ep2_on_four_ranks_equals_one_rank(make_placement, tiny_qwen3_moe_path, tmp_path):
    """Qwen3-MoE on 4 ranks, TP=2 x EP=2 with sequence parallelism (which megatron requires for MoE under TP; rows
    padded to even lengths), each rank holding half of every dense matrix and a TP half of the experts of its EP
    block: the same step as one rank; the checkpoint reloads at TP=1 x EP=1 and takes the same next step; weight
    syncs gather every expert's slices (the export equals one rank's)."""
    path = tiny_qwen3_moe_path
    one = TrainerGroup.remote(_megatron(path, 1), make_placement(placement.colocated(1)))
    four = TrainerGroup.remote(_megatron(path, 2, ep=2, sp=True), make_placement(placement.colocated(4)))
    batch = synthetic_group(0) + synthetic_group(1, first_token=7)
    after4 = _same_step_and_export(one, four, tmp_path, export_tolerance=5e-4)  # Adam on tiny MoE grads

    ray.get(four.save.remote(str(tmp_path / "ckpt")))
    fresh = TrainerGroup.remote(_megatron(path, 1), make_placement(placement.colocated(1)))
    ray.get(fresh.load.remote(str(tmp_path / "ckpt")))
    torch.testing.assert_close(_flat(ray.get(fresh.compute_logprobs.remote(batch))), after4, atol=1e-6, rtol=0)
    m_fresh, m_four = ray.get([fresh.train_step.remote(batch), four.train_step.remote(batch)])
    assert m_fresh["loss"] == pytest.approx(m_four["loss"], rel=1e-4, abs=1e-6)
    assert m_fresh["grad_norm"] == pytest.approx(m_four["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_pp2_equals_pp1_and_a_pp2_checkpoint_reloads_at_pp1(make_placement, family, tiny_model_path, tmp_path):
    """Two pipeline stages (Llama: one layer each, the tied embedding on both ends; Qwen3-MoE: 4 layers, MoE 0, 2,
    3), two micro-batches through megatron's 1F1B schedule: the same step as one rank; the checkpoint reloads at
    PP=1 and takes the same next step; syncs gather the layers of both stages (the export equals one rank's, and for
    Llama, before the step, the original's bits)."""
    path = tiny_model_path if family == "llama" else str(tiny_qwen3_moe_dir(num_layers=4))
    one = TrainerGroup.remote(_megatron(path, 1, max_tokens=12), make_placement(placement.colocated(1)))
    two = TrainerGroup.remote(_megatron(path, 1, pp=2, max_tokens=12), make_placement(placement.colocated(2)))
    if family == "llama":  # the round trip of two stages, the tied embedding on both, before any step
        _untrained_export_is_the_original(two, path, tmp_path / "untrained")
    batch = synthetic_group(0) + synthetic_group(1, first_token=7)
    after2 = _same_step_and_export(one, two, tmp_path, export_tolerance=2e-4)

    ray.get(two.save.remote(str(tmp_path / "ckpt")))
    fresh = TrainerGroup.remote(_megatron(path, 1, max_tokens=12), make_placement(placement.colocated(1)))
    ray.get(fresh.load.remote(str(tmp_path / "ckpt")))
    torch.testing.assert_close(_flat(ray.get(fresh.compute_logprobs.remote(batch))), after2, atol=1e-6, rtol=0)
    m_fresh, m_two = ray.get([fresh.train_step.remote(batch), two.train_step.remote(batch)])
    assert m_fresh["loss"] == pytest.approx(m_two["loss"], rel=1e-4, abs=1e-6)
    assert m_fresh["grad_norm"] == pytest.approx(m_two["grad_norm"], rel=1e-4)


def test_pp2_x_ep2_on_four_ranks_equals_one_rank(make_placement, tmp_path):
    """Qwen3-MoE (4 layers: MoE 0, 2, 3) on 4 ranks, two pipeline stages each spreading its experts over 2 ranks that
    hold different data shards of unlike lengths: the same step as one rank, an export equal to one rank's (layers
    gathered over the stages, experts over the EP ranks of each), and the checkpoint reloads at one rank."""
    path = str(tiny_qwen3_moe_dir(num_layers=4))
    one = TrainerGroup.remote(_megatron(path, 1, max_tokens=32), make_placement(placement.colocated(1)))
    four = TrainerGroup.remote(_megatron(path, 1, ep=2, pp=2, max_tokens=32), make_placement(placement.colocated(4)))
    batch = _uneven_groups()
    after4 = _same_step_and_export(one, four, tmp_path, export_tolerance=5e-4, batch=batch)

    ray.get(four.save.remote(str(tmp_path / "ckpt")))
    fresh = TrainerGroup.remote(_megatron(path, 1, max_tokens=32), make_placement(placement.colocated(1)))
    ray.get(fresh.load.remote(str(tmp_path / "ckpt")))
    torch.testing.assert_close(_flat(ray.get(fresh.compute_logprobs.remote(batch))), after4, atol=1e-6, rtol=0)
