"""Weight updates while engines generate (the fully async mode's sync), and the async rollout, for real."""

import pytest
import ray
from helpers import synthetic_group, tiny_stack, wait_until_decoding

from miles_ray import placement
from miles_ray.engines.requests import GenerateRequest, SamplingParams

pytestmark = pytest.mark.e2e

LONG = 400  # tokens per response: long enough that a sync lands mid-request


@pytest.mark.parametrize("in_flight", ["continue", "finish", "abort_resume"])
def test_sync_during_generation(make_placement, tiny_model_path, in_flight):
    pl = make_placement(placement.colocated(1))
    stack = tiny_stack(pl, tiny_model_path, broadcaster={"transport": "shared_memory", "in_flight": in_flight})
    trainer, engine, wb = stack.trainer, stack.engines[0], stack.broadcaster
    ray.get(wb.sync.remote(0))
    ray.get(trainer.train_step.remote(synthetic_group(0)))  # version 1 differs from what the engine holds
    params = SamplingParams(n=2, max_new_tokens=LONG, ignore_eos=True, seed=3)
    running = [engine.generate.remote(GenerateRequest([1, 2, 3], params, request_id=f"r{i}")) for i in range(2)]
    wait_until_decoding(engine)
    sync = wb.sync.remote(1)
    report = ray.get(sync)
    outs = ray.get(running)
    assert all(len(c.token_ids) == LONG and c.finish_reason == "length" for o in outs for c in o.completions)
    assert all(o.first_weight_version == 0 for o in outs)
    if in_flight == "finish":  # finished on the old weights; the sync waited for them
        assert all(o.weight_version == 0 for o in outs)
        assert report["drain_seconds"] > 0.01  # waited for 2 x 400-token requests, not only a bookkeeping round
        return
    assert all(o.weight_version == 1 for o in outs)  # went on with the new weights
    if in_flight == "abort_resume":  # the tail was generated from scratch on the new weights: same logprobs as
        # the trainer's at version 1 from some token on, different before it
        from miles_ray.types import GroupRef, Sample

        samples = [Sample([1, 2, 3], c.token_ids, c.logprobs) for o in outs for c in o.completions]
        trained = ray.get(trainer.compute_logprobs.remote([GroupRef(ray.put(samples), len(samples), 1, 0)]))
        for s, lp in zip(samples, trained):
            diffs = [abs(a - b) for a, b in zip(s.rollout_logprobs, lp)]
            cut = next(k for k in range(len(diffs)) if max(diffs[k:]) < 1e-4)
            assert 0 < cut < LONG, (cut, diffs[:3])
            assert max(diffs[:cut]) > 1e-3  # the prefix came from version 0


def test_fully_async_training_with_staleness_bound_and_resumable_rollout(make_placement, tiny_model_path):
    """The async rollout streams groups while the trainer trains and weights sync mid-generation; a stop/state/load
    round trip (what a run checkpoint does) resumes the data source with no prompt lost or repeated."""
    from helpers import ShortResponseTask
    from transformers import AutoTokenizer

    from miles_ray.actors import AsyncRollout, AsyncRolloutConfig, ReplayBuffer, ReplayBufferConfig

    pl = make_placement(placement.disaggregated(1, 2))
    stack = tiny_stack(
        pl, tiny_model_path, num_engines=2, broadcaster={"in_flight": "abort_resume"}, buffer={"max_staleness": 1}
    )
    trainer, router, buffer, wb = stack.trainer, stack.router, stack.buffer, stack.broadcaster
    ray.get(wb.sync.remote(0))
    task = ShortResponseTask(AutoTokenizer.from_pretrained(tiny_model_path))
    cfg = AsyncRolloutConfig(
        sampling=SamplingParams(n=4, max_new_tokens=32), prompts_in_flight=4, max_buffered_groups=6
    )
    worker = AsyncRollout.remote(cfg, router, buffer, task)
    ray.get(worker.start.remote())
    version, taken = 0, []
    for _ in range(4):
        batch = ray.get(buffer.get_batch.remote(3, current_version=version, timeout_s=120))
        assert batch is not None, ray.get(worker.stats.remote())
        assert all(version - g.weight_version <= 1 for g in batch)  # the staleness bound held
        taken += batch
        version = ray.get(trainer.train_step.remote(batch))["weight_version"]
        ray.get(wb.sync.remote(version))  # the rollout keeps generating meanwhile
    stats = ray.get(worker.stop.remote())
    buf = ray.get(buffer.stats.remote())
    assert stats["groups_added"] == buf["added"] >= 12 and not stats["running"] and stats["in_flight"] == 0
    assert buf["taken"] == 12 and sum(buf["staleness_hist"].values()) == 12
    assert buf["groups"] + buf["taken"] + buf["dropped_stale"] == buf["added"]
    assert any(h > 0 for h in buf["staleness_hist"]) or buf["dropped_stale"] > 0  # rollout ran ahead of training

    # checkpoint-style round trip into fresh actors: the data position and the buffered groups come back
    held, state = ray.get(buffer.state.remote()), ray.get(worker.state.remote())
    assert state["task"] == {"position": buf["added"]} and state["unsent"] == []  # every prompt handed out landed
    held_uids = [m[2] for m, _ in held["groups"]]
    seen = [g.group_id for g in taken] + held_uids
    assert len(set(seen)) == len(seen) and len(seen) + buf["dropped_stale"] == buf["added"]
    assert set(seen) <= set(range(1, buf["added"] + 1))  # ShortResponseTask uids count from 1
    buffer2 = ReplayBuffer.remote(ReplayBufferConfig())
    assert ray.get(buffer2.load_state.remote(held)) == len(held_uids)
    cfg2 = cfg.model_copy(update={"max_buffered_groups": len(held_uids) + 8})  # room above the restored groups
    worker2 = AsyncRollout.remote(
        cfg2, router, buffer2, ShortResponseTask(AutoTokenizer.from_pretrained(tiny_model_path))
    )
    ray.get(worker2.load_state.remote(state))
    ray.get(worker2.start.remote())
    more = ray.get(buffer2.get_batch.remote(len(held_uids) + 4, timeout_s=120))
    ray.get(worker2.stop.remote())
    assert [g.group_id for g in more[: len(held_uids)]] == held_uids  # restored groups first, in order
    assert all(ray.get(g.ref)[0].group_id == g.group_id for g in more[: len(held_uids)])  # payloads too
    new = [g.group_id for g in more[len(held_uids) :]]
    assert len(set(new)) == 4 and min(new) > buf["added"]  # the source went on from where it stopped
