"""Real Ray, real torch, tiny real model: the five actors run GRPO steps in both topologies.

Checked after every sync: weights changed, every engine holds the trainer's version, engine checksums
equal the checksum of what the trainer sent, and engine logprobs equal the trainer's for the same tokens.
"""

import pytest
import ray
from helpers import ShortResponseTask, engines_and_router, synthetic_group, trainer_checksum  # noqa: E402
from transformers import AutoTokenizer

from miles_ray import placement
from miles_ray.actors import RouterConfig, TrainerGroup, TrainerGroupConfig
from miles_ray.engines.requests import SamplingParams
from miles_ray.rewards.safe import SafeReward
from miles_ray.rollout import generate_groups
from miles_ray.stack import StackConfig, build_stack

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("topology", ["colocated", "disaggregated"])
def test_grpo_steps_sync_and_match(make_placement, tiny_model_path, topology, record_property):
    n = 2
    transport = "shared_memory" if topology == "colocated" else "broadcast"
    pl = make_placement(placement.colocated(n) if topology == "colocated" else placement.disaggregated(n, n))
    # colocated runs the FSDP2 backend, disaggregated the DDP one: both backends are covered
    parallel = "fsdp2" if topology == "colocated" else "ddp"
    config = StackConfig(
        trainer={
            "model_path": tiny_model_path,
            "num_ranks": n,
            "optimizer": {"lr": 1e-3},
            "backend": {"parallel": parallel},
        },
        pool={"num_engines": n, "engine": {"model_path": tiny_model_path}},
        router={"policy": "round_robin"},
        buffer={"max_staleness": 0},
        broadcaster={"transport": transport, "bucket_bytes": 1 << 20},
        name_prefix=f"slice-{topology}",
    )
    stack = build_stack(config, pl)
    trainer, engines, router, buffer, broadcaster = (
        stack.trainer,
        stack.engines,
        stack.router,
        stack.buffer,
        stack.broadcaster,
    )
    assert ray.get_actor(f"slice-{topology}/trainer")._actor_id == trainer._actor_id  # reachable by name

    task = ShortResponseTask(AutoTokenizer.from_pretrained(tiny_model_path))
    params = SamplingParams(n=4, max_new_tokens=12, ignore_eos=True)
    first = ray.get(broadcaster.sync.remote(0))
    assert first["num_buckets"] > 1  # 1 MiB buckets split the 13 MB model
    checksums, max_diffs = [first["checksum"]], []
    for _ in range(3):
        version = ray.get(trainer.weight_version.remote())
        groups = generate_groups(router, task, params, num_prompts=4)
        assert all(g.weight_version == version for g in groups)
        ray.get(buffer.add.remote(groups))
        batch = ray.get(buffer.get_batch.remote(4, current_version=version))
        samples = [s for g in ray.get([g.ref for g in batch]) for s in g]
        trainer_lp = ray.get(trainer.compute_logprobs.remote(batch))
        diff = max(max(abs(a - b) for a, b in zip(t, s.rollout_logprobs)) for t, s in zip(trainer_lp, samples))
        max_diffs.append(diff)
        metrics = ray.get(trainer.train_step.remote(batch))
        assert metrics["weight_version"] == version + 1 and metrics["grad_norm"] > 0
        report = ray.get(broadcaster.sync.remote(metrics["weight_version"]))
        assert ray.get([e.weight_version.remote() for e in engines]) == [version + 1] * n
        assert ray.get([e.weights_checksum.remote() for e in engines]) == [report["checksum"]] * n
        checksums.append(report["checksum"])
    assert len(set(checksums)) == len(checksums), "weights must change every step"
    # fp32 engine vs fp32 trainer (FSDP2 over gloo): the same tokens get the same logprobs
    record_property("max_abs_logprob_diff", max(max_diffs))
    print(f"{topology}: max abs engine-vs-trainer logprob diff over 3 steps = {max(max_diffs):.2e}")
    assert max(max_diffs) < 1e-4
    stats = ray.get(router.stats.remote())
    assert stats["served"] == {0: 6, 1: 6}  # round robin over 12 requests


def test_router_evicts_killed_engine_and_retries(make_placement, tiny_model_path):
    from miles_ray.engines.requests import GenerateRequest

    pl = make_placement(placement.disaggregated(1, 2))
    router_config = RouterConfig(policy="round_robin", health_interval_s=0.2, max_health_failures=1)
    pool, engines, router = engines_and_router(pl, tiny_model_path, 2, router_config)
    req = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4))
    ray.get([router.generate.remote(req) for _ in range(4)])
    ray.kill(engines[0])
    outs = ray.get([router.generate.remote(req) for _ in range(6)])  # none lost: retried on engine 1
    assert {o.engine_id for o in outs} == {1}
    assert ray.get(router.stats.remote())["evicted"] == [0]
    with pytest.raises(ray.exceptions.RayTaskError, match="prompt_ids must not be empty"):
        ray.get(router.generate.remote(GenerateRequest([], SamplingParams())))
    assert ray.get(router.generate.remote(req)).engine_id == 1  # a bad request did not take the engine down
    assert ray.get(pool.num_engines.remote()) == 2


def test_checkpoint_round_trip_and_hooks(make_placement, tiny_model_path, tmp_path):
    """Save/train/load restores weights and version; every hook point runs on every rank with its arguments."""
    marks = tmp_path / "marks"
    marks.mkdir()

    def mark(name):
        def hook(ctx, *args):
            detail = type(args[0]).__name__ if args else type(ctx.model).__name__
            (marks / f"{name}-{ctx.rank}-{detail}").touch()
            return {"hook_rank_sum": ctx.rank} if name == "after_train_step" else None

        return hook

    hooks = {point: [mark(point)] for point in ("after_init", "before_logprobs", "before_train_step", "after_save")}
    hooks["after_train_step"] = [mark("after_train_step")]
    pl = make_placement(placement.colocated(2))
    cfg = TrainerGroupConfig(model_path=tiny_model_path, num_ranks=2, optimizer={"lr": 1e-3}, hooks=hooks)
    trainer = TrainerGroup.remote(cfg, pl)

    def checksum():
        return trainer_checksum(trainer)

    before = checksum()
    ray.get(trainer.save.remote(str(tmp_path / "ckpt")))
    # train one step on a synthetic group so the weights move, then load and expect the saved weights back
    group = synthetic_group(0)
    metrics = ray.get(trainer.train_step.remote(group))
    ray.get(trainer.compute_logprobs.remote(group))
    assert checksum() != before
    assert ray.get(trainer.weight_version.remote()) == 1
    ray.get(trainer.load.remote(str(tmp_path / "ckpt")))
    assert checksum() == before
    assert ray.get(trainer.weight_version.remote()) == 0
    assert metrics["hook_rank_sum"] == 0  # rank 0's metrics, with its hook's dict merged in
    expected = {
        f"{p}-{r}-{d}"
        for r in (0, 1)
        for p, d in [
            ("after_init", "FSDPLlamaForCausalLM"),
            ("before_train_step", "RolloutBatch"),
            ("after_train_step", "dict"),
            ("before_logprobs", "RolloutBatch"),
            ("after_save", "str"),
        ]
    }
    assert {m.name for m in marks.iterdir()} == expected


def test_failing_reward_gives_zero_weight_and_run_goes_on(make_placement, tiny_model_path):

    pl = make_placement(placement.disaggregated(1, 1))
    pool, _, router = engines_and_router(pl, tiny_model_path, 1)
    task = ShortResponseTask(AutoTokenizer.from_pretrained(tiny_model_path))
    calls = []

    def flaky(text, entry):  # every other call raises: a buggy reward function
        calls.append(text)
        if len(calls) % 2 == 0:
            raise RuntimeError("grader crashed")
        return task.reward(text, entry)

    groups = generate_groups(router, task, SamplingParams(n=4, max_new_tokens=6), 2, reward=SafeReward(flaky))
    samples = [s for g in ray.get([g.ref for g in groups]) for s in g]
    failed = [s for s in samples if "reward_failure" in s.metadata]
    assert len(samples) == 8 and len(failed) == 4
    assert all(s.loss_mask == [0] * len(s.response_ids) and s.reward == 0.0 for s in failed)
    assert all("grader crashed" in s.metadata["reward_failure"] for s in failed)
    assert all(sum(s.loss_mask) == len(s.response_ids) for s in samples if s not in failed)
    assert ray.get(pool.num_engines.remote()) == 1


def test_dynamic_sampling_drops_flat_groups_and_refills(make_placement, tiny_model_path):
    pl = make_placement(placement.colocated(1))
    pool, _, router = engines_and_router(pl, tiny_model_path, 1)

    class ParityTask(ShortResponseTask):
        def next_prompt(self):
            prompt = super().next_prompt()
            prompt["entry"] = {"answer": None, "odd": prompt["uid"] % 2 == 1}
            return prompt

    task = ParityTask(AutoTokenizer.from_pretrained(tiny_model_path))

    def reward(text, entry):  # odd prompts: every sample gets 1.0 (no signal); even prompts: varies
        return 1.0 if entry["odd"] else sum(map(ord, text)) % 7 / 6

    stats = {}
    params = SamplingParams(n=4, max_new_tokens=6, ignore_eos=True)
    groups = generate_groups(
        router,
        task,
        params,
        3,
        reward=SafeReward(reward),
        group_filter="miles_ray.rollout:has_reward_signal",
        max_rounds=5,
        stats=stats,
    )
    kept = ray.get([g.ref for g in groups])
    assert len(kept) == 3 and all(len({s.reward for s in g}) > 1 for g in kept)
    assert stats["groups_dropped"] == stats["groups_generated"] - 3 and stats["groups_dropped"] >= 1
    with pytest.raises(ValueError, match="group_filter 'nope:x' cannot be imported"):
        generate_groups(router, task, params, 1, group_filter="nope:x")
    assert ray.get(pool.num_engines.remote()) == 1


def test_kl_as_reward_penalty_on_two_ranks(make_placement, tiny_model_path):
    from miles_ray.types import GroupRef, Sample

    pl = make_placement(placement.colocated(2))
    cfg = TrainerGroupConfig(
        model_path=tiny_model_path, num_ranks=2, optimizer={"lr": 1e-2}, kl={"coef": 0.5, "mode": "reward"}
    )
    trainer = TrainerGroup.remote(cfg, pl)
    samples = [Sample([1, 2, 3], [4 + i, 5, 6], [-1.0] * 3, reward=float(i % 2), group_id=i // 2) for i in range(4)]
    group = [GroupRef(ray.put(samples), 4, 0, 0)]
    first = ray.get(trainer.train_step.remote(group))
    second = ray.get(trainer.train_step.remote(group))
    assert first["kl_reward_penalty_mean"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at the start
    assert abs(second["kl_reward_penalty_mean"]) > 0  # the policy moved; the reference did not
    assert second["shaped_reward_mean"] == pytest.approx(0.5 - second["kl_reward_penalty_mean"], abs=1e-6)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_a_batch_that_does_not_split_over_the_ranks_trains_as_on_one_rank(make_placement, tiny_model_path, aggregation):
    """5 samples on 2 ranks (a multi-turn rollout's count need not split: 17 on 2 crashed the tool-use example): the
    short rank's shard is filled with rows that train nothing, and the step equals one rank's on the whole batch."""
    from miles_ray.types import GroupRef, Sample

    lengths = [2, 5, 3, 4, 1]
    samples = [
        Sample([1, 2 + i, 3], [4 + j + i for j in range(n)], [-1.0] * n, reward=float(i % 3), group_id=i // 3)
        for i, n in enumerate(lengths)
    ]
    group = [GroupRef(ray.put(samples), len(samples), 0, 0)]
    out = {}
    for ranks in (1, 2):
        cfg = TrainerGroupConfig(
            model_path=tiny_model_path,
            num_ranks=ranks,
            optimizer={"lr": 1e-2},
            loss={"aggregation": aggregation},
            kl={"coef": 0.1, "mode": "reward"},  # token_kl and its gather on the filled shards too
            backend={"micro_batch_size": 2, "autocast": "none"},
        )
        trainer = TrainerGroup.remote(cfg, make_placement(placement.colocated(ranks)))
        before = ray.get(trainer.compute_logprobs.remote(group))
        metrics = ray.get(trainer.train_step.remote(group))
        out[ranks] = metrics, before, ray.get(trainer.compute_logprobs.remote(group))
        ray.kill(trainer)
    (one, lp0, lp1), (two, _, lp2) = out[1], out[2]

    def most(a, b):
        return max(abs(u - v) for x, y in zip(a, b) for u, v in zip(x, y))

    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    assert [len(x) for x in lp2] == lengths
    # the same weights after the step, up to fp32 summation order (Adam's first step amplifies it)
    assert most(lp1, lp2) < 1e-4 and most(lp0, lp1) > 100 * most(lp1, lp2)


@pytest.mark.parametrize("transport", ["shared_memory", "broadcast"])
def test_bf16_engines_get_bf16_weights_and_verify(make_placement, tiny_model_path, transport):
    """``engine_dtype="auto"``: engines holding bfloat16 are sent bfloat16 (half the bytes of float32), and what they
    hold hashes to what was sent, before and after a training step; a verified float32 sync is refused at start.

    Two DDP ranks under bf16 autocast keep a bf16 weight copy (``backends.weight_copy``): their forwards read it, the
    sync sends it, and the step's optimizer rewrites it (a stale copy would send the weights of before the step again).
    Shared memory hands the engines the copy itself (nothing copied): the steps between syncs write elsewhere, so
    the engines keep computing on exactly what the last sync sent.
    """
    from miles_ray.actors.weight_broadcaster import WeightBroadcaster, WeightBroadcasterConfig

    n = 2 if transport == "shared_memory" else 1
    pl = make_placement(placement.colocated(2) if transport == "shared_memory" else placement.disaggregated(2, 1))
    backend = {"parallel": "ddp", "autocast": "bfloat16"}
    config = StackConfig(
        trainer={"model_path": tiny_model_path, "num_ranks": 2, "optimizer": {"lr": 1e-3}, "backend": backend},
        pool={"num_engines": n, "engine": {"model_path": tiny_model_path, "dtype": "bfloat16"}},
        broadcaster={"transport": transport, "bucket_bytes": 1 << 20},
    )
    stack = build_stack(config, pl)
    report = ray.get(stack.broadcaster.sync.remote(0))
    assert report["dtype"] == "bfloat16"
    assert ray.get([e.weights_checksum.remote() for e in stack.engines]) == [report["checksum"]] * n
    workers = ray.get(stack.trainer.workers.remote())
    assert ray.get(workers[0].sync_plan.remote("float32", 1 << 20)).total_bytes == 2 * report["bytes"]
    # a float32 sync into bfloat16 engines could never verify: refused when the broadcaster starts
    fp32 = WeightBroadcaster.remote(
        WeightBroadcasterConfig(transport=transport, engine_dtype="float32"), workers, stack.engines
    )
    with pytest.raises(ray.exceptions.RayActorError, match="engine_dtype='float32' but engines"):
        ray.get(fp32.last_report.remote())
    for step in range(3):  # the copy rotates through its three shared sets
        version = ray.get(stack.trainer.train_step.remote(synthetic_group(step)))["weight_version"]
        assert ray.get([e.weights_checksum.remote() for e in stack.engines]) == [report["checksum"]] * n  # as sent
        after = ray.get(stack.broadcaster.sync.remote(version))
        assert after["checksum"] != report["checksum"]
        assert ray.get([e.weights_checksum.remote() for e in stack.engines]) == [after["checksum"]] * n
        report = after
    if transport == "shared_memory":  # rank 0 made no shared bucket buffers: engines got the copy, nothing copied
        assert ray.get(workers[0].__ray_call__.remote(lambda w: True not in w._sync_buffers))
    # verify="sampled": the engines' own sampled re-read equals what was sent; the window moves with the version
    sampled = WeightBroadcaster.remote(
        WeightBroadcasterConfig(transport=transport, verify="sampled", bucket_bytes=1 << 20), workers, stack.engines
    )
    for v in (version, version + 1):
        got = ray.get(sampled.sync.remote(v))["checksum"]
        assert ray.get([e.weights_checksum.remote(sample=v) for e in stack.engines]) == [got] * n
        assert got != after["checksum"]  # not the digest of every byte
    assert ray.get(stack.engines[0].weights_checksum.remote(sample=version)) != got  # another window
    stack.shutdown()
