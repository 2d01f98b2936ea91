"""Fault tolerance with real Ray and real torch: non-finite steps, killed engines, an engine whose stepping thread
died, killed trainer ranks, crashes during a checkpoint save. Faults are injected for real (``ray.kill`` on live
actors, a stepping thread ended inside a live actor, a hook that poisons the loss, a data source that raises while
being saved)."""

import math
import threading
import time

import pytest
import ray
from helpers import ShortResponseTask, SyntheticSource, stop_stepping, synthetic_group, tiny_stack, trainer_checksum
from transformers import AutoTokenizer

from miles_ray import placement
from miles_ray.actors import TrainerGroup, TrainerGroupConfig
from miles_ray.checkpoint import RunCheckpointer
from miles_ray.engines.requests import EngineDeadError, GenerateRequest, SamplingParams
from miles_ray.fault import heal_engines, restart_trainer
from miles_ray.rollout import generate_groups

pytestmark = pytest.mark.e2e


POISON = 7  # a prompt token that marks a batch for fault injection


def poison_rank_1(ctx, shard):
    """Fault injection: on a marked batch, rank 1 gets NaN advantages (so a non-finite loss and gradients)."""
    if ctx.rank == 1 and bool((shard.input_ids[:, 0] == POISON).any()):
        shard.advantages.fill_(float("nan"))


def test_non_finite_step_is_skipped_and_reported(make_placement, tiny_model_path):
    pl = make_placement(placement.colocated(2))
    cfg = TrainerGroupConfig(model_path=tiny_model_path, num_ranks=2, optimizer={"lr": 1e-3})
    poisoned = cfg.model_copy(update={"hooks": cfg.hooks.model_copy(update={"before_train_step": [poison_rank_1]})})
    trainer = TrainerGroup.remote(poisoned, pl)
    before = trainer_checksum(trainer)
    metrics = ray.get(trainer.train_step.remote(synthetic_group(0, first_token=POISON)))
    assert metrics["step_skipped"] == 1.0 and metrics["skipped_steps"] == 1
    assert not math.isfinite(metrics["grad_norm"])
    assert metrics["weight_version"] == 0  # no optimizer step was taken
    assert trainer_checksum(trainer) == before  # rank 0's clean gradients were dropped too: ranks stay equal
    # the optimizer state was not touched: the next clean step trains normally, with finite weights
    clean = ray.get(trainer.train_step.remote(synthetic_group(1)))
    assert clean["step_skipped"] == 0.0 and clean["weight_version"] == 1 and math.isfinite(clean["loss"])
    assert trainer_checksum(trainer) != before
    logprobs = ray.get(trainer.compute_logprobs.remote(synthetic_group(1)))
    assert all(math.isfinite(x) for row in logprobs for x in row)


def test_killed_engine_mid_rollout_loses_no_prompt_and_returns_with_current_weights(make_placement, tiny_model_path):
    """Disaggregated (broadcast transport): kill engine 0 with requests in flight, then heal it."""
    pl = make_placement(placement.disaggregated(1, 2))
    router = {"policy": "round_robin", "health_interval_s": 0.2, "max_health_failures": 1}
    stack = tiny_stack(pl, tiny_model_path, num_engines=2, router=router)
    trainer, pool, router, wb = stack.trainer, stack.pool, stack.router, stack.broadcaster
    engines, buffer = stack.engines, stack.buffer
    ray.get(trainer.train_step.remote(synthetic_group(0)))
    ray.get(wb.sync.remote(1))  # engines hold version 1; a respawned engine starts at 0 from disk
    task = ShortResponseTask(AutoTokenizer.from_pretrained(tiny_model_path))
    params = SamplingParams(n=4, max_new_tokens=96, ignore_eos=True)
    groups: list = []
    rollout = threading.Thread(target=lambda: groups.extend(generate_groups(router, task, params, num_prompts=12)))
    rollout.start()
    deadline = time.time() + 60
    while ray.get(router.stats.remote())["outstanding"][0] == 0:  # wait for requests in flight on engine 0
        assert time.time() < deadline, "no request reached engine 0"
        time.sleep(0.01)
    ray.kill(engines[0])
    rollout.join(timeout=300)
    stats = ray.get(router.stats.remote())
    assert stats["evicted"] == [0] and stats["retried"] >= 1  # in-flight requests were re-sent to engine 1
    ray.get(buffer.add.remote(groups))
    batch = ray.get(buffer.get_batch.remote(12))
    assert sorted(g.group_id for g in batch) == list(range(1, 13))  # every prompt once: none lost, none doubled
    samples = [s for g in ray.get([g.ref for g in batch]) for s in g]
    assert len(samples) == 48 and all(len(s.response_ids) == 96 for s in samples)

    assert heal_engines(pool, wb, router, version=1) == [0]
    new = ray.get(pool.engines.remote())[0]
    assert ray.get(new.weight_version.remote()) == 1
    assert ray.get(new.weights_checksum.remote()) == trainer_checksum(trainer)
    assert ray.get(router.stats.remote())["evicted"] == []
    assert heal_engines(pool, wb, router, version=1) == []  # nothing dead: nothing replaced
    # the run goes on: train on the rollout, sync over a re-formed broadcast group, both engines serve version 2
    ray.get(trainer.train_step.remote(batch))
    report = ray.get(wb.sync.remote(2))
    assert report["checksum"] == trainer_checksum(trainer)
    outs = ray.get(
        [router.generate.remote(GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4))) for _ in range(4)]
    )
    assert {o.engine_id for o in outs} == {0, 1} and {o.weight_version for o in outs} == {2}


def test_an_engine_whose_stepping_thread_died_is_evicted_retried_and_replaced(make_placement, tiny_model_path):
    """Regression (#23): the actor lives but serves nothing; requests used to hang and health to answer healthy."""
    pl = make_placement(placement.disaggregated(1, 2))
    router_cfg = {"policy": "round_robin", "health_interval_s": 3600, "max_health_failures": 1}
    stack = tiny_stack(pl, tiny_model_path, num_engines=2, router=router_cfg)
    trainer, pool, router, wb, engines = stack.trainer, stack.pool, stack.router, stack.broadcaster, stack.engines
    ray.get(wb.sync.remote(0))  # the broadcaster is up (it asks every engine for its dtype when it starts)
    assert stop_stepping(engines[0]) is False
    with pytest.raises(EngineDeadError, match="stepping thread has died"):
        ray.get(engines[0].health.remote())
    request = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4))
    outs = ray.get([router.generate.remote(request) for _ in range(4)], timeout=120)  # round robin tries engine 0
    stats = ray.get(router.stats.remote())
    assert {o.engine_id for o in outs} == {1} and stats["evicted"] == [0] and stats["retried"] >= 1

    assert heal_engines(pool, wb, router, version=0) == [0]  # the live actor with a dead loop was replaced
    new = ray.get(pool.engines.remote())[0]
    assert ray.get(new.weights_checksum.remote()) == trainer_checksum(trainer)
    # the health check (not only a failed request) evicts a dead engine, and its round survives the error
    assert stop_stepping(new) is False
    assert ray.get(router.check_health.remote()) == {0: False, 1: True}
    assert ray.get(router.stats.remote())["evicted"] == [0]


class BrokenSource(SyntheticSource):
    def state_dict(self):
        raise OSError("disk full (injected)")


def train(trainer, source, steps):
    for _ in range(steps):
        ray.get(trainer.train_step.remote(source.next_batch()))


def test_killed_trainer_rank_resumes_from_checkpoint_like_an_uninterrupted_run(
    make_placement, tiny_model_path, tmp_path
):
    cfg = TrainerGroupConfig(model_path=tiny_model_path, num_ranks=2, optimizer={"lr": 1e-3}, seed=5)
    # uninterrupted: 4 steps
    trainer = TrainerGroup.remote(cfg, make_placement(placement.colocated(2)))
    source = SyntheticSource()
    train(trainer, source, 4)
    expected, expected_version = trainer_checksum(trainer), ray.get(trainer.weight_version.remote())
    ray.kill(trainer)

    # interrupted: checkpoint after step 2, a rank dies during step 3, restart and resume
    trainer = TrainerGroup.remote(cfg, make_placement(placement.colocated(2)))
    source, ckpt = SyntheticSource(), RunCheckpointer(tmp_path / "ckpt")
    train(trainer, source, 2)
    ckpt.save(2, trainer, data_source=source, extra={"note": "after step 2"})
    train(trainer, source, 1)  # step 3 happens, then is lost with the rank
    ray.kill(ray.get(trainer.workers.remote())[1])
    with pytest.raises(ray.exceptions.RayError):
        ray.get(trainer.train_step.remote(source.next_batch()))
    restart_trainer(trainer, None)
    meta = ckpt.load(None, trainer, data_source=source)
    assert meta["step"] == 2 and meta["extra"] == {"note": "after step 2"} and source.position == 2
    assert ray.get(trainer.weight_version.remote()) == 2 and ray.get(trainer.num_restarts.remote()) == 1
    train(trainer, source, 2)
    assert trainer_checksum(trainer) == expected  # bit-exact: weights, optimizer state, data position
    assert ray.get(trainer.weight_version.remote()) == expected_version and source.position == 4

    # a crash during a save leaves the previous checkpoint the latest, loadable
    latest = ckpt.latest()
    with pytest.raises(OSError, match="disk full"):
        ckpt.save(4, trainer, data_source=BrokenSource())
    assert ckpt.latest() == latest and list(tmp_path.glob("ckpt/.tmp-*"))  # the half-written one is not it
    ckpt.save(4, trainer, data_source=source)
    assert ckpt.latest().name == "step_00000004" and not list(tmp_path.glob("ckpt/.tmp-*"))
    assert [p.name for p in ckpt.complete()] == ["step_00000002", "step_00000004"]
    meta = ckpt.load(latest, trainer, data_source=source)  # and the older one still loads
    assert source.position == 2 and ray.get(trainer.weight_version.remote()) == 2


def test_checkpoints_verify_every_file_and_keep_the_most_recent_saves(make_placement, tiny_model_path, tmp_path):
    """Regression (#23): no integrity check on load; retention by step name deleted the step just saved after a
    rollback; an interrupted re-save left a directory nothing removed."""
    from miles_ray.checkpoint import CheckpointCorruptError

    cfg = TrainerGroupConfig(model_path=tiny_model_path, num_ranks=1, optimizer={"lr": 1e-3})
    trainer = TrainerGroup.remote(cfg, make_placement(placement.colocated(1)))
    source, ckpt = SyntheticSource(), RunCheckpointer(tmp_path, keep_last=1)
    ckpt.save(8, trainer, data_source=source)
    (tmp_path / ".tmp-old-step_00000008-deadbeef").mkdir()  # what a re-save interrupted mid-swap leaves
    ckpt.save(6, trainer, data_source=source)  # rolled back to an earlier step: this save is the one to keep
    assert [p.name for p in ckpt.complete()] == ["step_00000006"] and not list(tmp_path.glob(".tmp-*"))
    train(trainer, source, 1)
    ckpt.keep_last = 2
    ckpt.save(7, trainer, data_source=source)
    assert [p.name for p in ckpt.complete()] == ["step_00000006", "step_00000007"]

    step6 = tmp_path / "step_00000006"
    files = {p.relative_to(step6).as_posix() for p in step6.rglob("*") if p.is_file()}
    assert {"data.json", "driver_rng.json", "driver_rng.safetensors", "trainer/rng_rank0.json"} <= files
    assert not [f for f in files if f.endswith((".pkl", ".pt"))]  # no pickled state (#23)
    data = (step6 / "data.json").read_bytes()
    (step6 / "data.json").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one flipped bit
    with pytest.raises(CheckpointCorruptError, match="data.json does not match its sha256"):
        ckpt.load(step6, trainer, data_source=source)
    assert ray.get(trainer.weight_version.remote()) == 1 and source.position == 1  # nothing was restored
    (step6 / "data.json").write_bytes(data)
    shard = next(p for p in (step6 / "trainer").rglob("*") if p.is_file())
    shard.unlink()
    with pytest.raises(CheckpointCorruptError, match=f"missing {shard.relative_to(step6).as_posix()}"):
        ckpt.load(step6, trainer, data_source=source)
    assert ckpt.load(None, trainer, data_source=source)["step"] == 7  # the intact one loads


def test_export_hf_safetensors_loads_in_transformers(make_placement, tiny_model_path, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    trainer = TrainerGroup.remote(
        TrainerGroupConfig(model_path=tiny_model_path, num_ranks=2, optimizer={"lr": 1e-3}),
        make_placement(placement.colocated(2)),
    )
    group = synthetic_group(1)
    ray.get(trainer.train_step.remote(group))
    out = ray.get(trainer.export_hf.remote(str(tmp_path / "hf"), "float32"))
    assert (tmp_path / "hf" / "model.safetensors").exists() and (tmp_path / "hf" / "tokenizer.json").exists()
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    sample = ray.get(group[0].ref)[0]
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        lp = torch.log_softmax(hf(input_ids=ids).logits[0, :-1].float(), -1)
    n = len(sample.response_ids)
    hf_lp = lp[-n:].gather(1, torch.tensor(sample.response_ids)[:, None])[:, 0]
    trained = ray.get(trainer.compute_logprobs.remote(group))[0]
    assert torch.allclose(hf_lp, torch.tensor(trained), atol=1e-5)  # the exported weights are the trained ones
    with pytest.raises(ray.exceptions.RayTaskError, match="exists"):
        ray.get(trainer.export_hf.remote(out))
