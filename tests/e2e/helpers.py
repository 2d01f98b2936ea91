"""Shared pieces of the end-to-end tests: a learnable task for a random tiny model, an engine stack, checksums."""

import contextlib
import os
import subprocess
import time
from pathlib import Path

import ray

from miles_ray.actors import RolloutPool, RolloutPoolConfig, Router, RouterConfig
from miles_ray.engines.embedded import EmbeddedEngineConfig
from miles_ray.sync.checksum import buckets_checksum
from miles_ray.sync.shm import as_tensor
from miles_ray.types import GroupRef, Sample


def tiny_stack(pl, model_path, num_ranks=1, num_engines=1, trainer: dict | None = None, **fields):
    """``build_stack`` on ``pl``: a trainer at lr 1e-3 (plus ``trainer`` fields), fp32 embedded engines, and the
    other ``StackConfig`` ``fields`` as given (router, buffer, broadcaster, critic, reference, name_prefix)."""
    from miles_ray.stack import StackConfig, build_stack

    config = StackConfig(
        trainer={"model_path": model_path, "num_ranks": num_ranks, "optimizer": {"lr": 1e-3}, **(trainer or {})},
        pool={"num_engines": num_engines, "engine": {"model_path": model_path}},
        **fields,
    )
    return build_stack(config, pl)


def engines_and_router(pl, model_path, num_engines, router_config=None):
    """Pool, its engines and a router, for tests that need no trainer (``build_stack`` builds a whole stack).

    Keep the pool handle: the engines die with the pool actor."""
    pool_config = RolloutPoolConfig(num_engines=num_engines, engine=EmbeddedEngineConfig(model_path=model_path))
    pool = RolloutPool.remote(pool_config, pl)
    engines = ray.get(pool.engines.remote())
    return pool, engines, Router.remote(router_config or RouterConfig(), engines)


ROOT = Path(__file__).resolve().parents[2]


def server_python(env_var: str, venv: str, probe: str, env: dict | None = None) -> str | None:
    """The interpreter of a server engine's own venv: ``$env_var`` or ``ROOT/venv``, if ``probe`` imports there."""
    for python in (os.environ.get(env_var), str(ROOT / venv / "bin" / "python")):
        if python and Path(python).exists():
            env = {**os.environ, **(env or {})}
            run = subprocess.run([python, "-c", f"import {probe}"], capture_output=True, timeout=300, env=env)
            if run.returncode == 0:
                return python
    return None


def trainer_logprobs(trainer, prompt, completions) -> list[list[float]]:
    """The trainer's logprobs of each completion's tokens after ``prompt``."""
    samples = [Sample(list(prompt), c.token_ids, c.logprobs) for c in completions]
    return ray.get(trainer.compute_logprobs.remote([GroupRef(ray.put(samples), len(samples), 0, 0)]))


def max_logprob_diff(completions, reference) -> float:
    """Largest |engine logprob - reference logprob| over every token of ``completions``."""
    return max(abs(a - b) for c, ref in zip(completions, reference) for a, b in zip(c.logprobs, ref))


SGLANG_PROMPT = [1, 2, 3, 4, 5]


@contextlib.contextmanager
def sglang_stack(lora=None, trainer_backend: dict | None = None):
    """One real SGLang server (tiny Llama, fp32; ``lora``: ``SGLangEngineConfig.lora``) behind a pool and router, a
    1-rank trainer (lr 1e-2, ``trainer_backend``) and two broadcasters (``broadcast`` over gloo, ``shared_memory``),
    on one colocated bundle. Skips without an SGLang environment (``scripts/setup_sglang.sh``)."""
    from miles_ray import placement
    from miles_ray.actors import WeightBroadcaster, WeightBroadcasterConfig
    from miles_ray.engines.sglang import SITE_DIR, SGLangEngineConfig
    from miles_ray.models.hub import tiny_llama_dir
    from miles_ray.stack import StackConfig, build_stack

    shim = {"PYTHONPATH": str(SITE_DIR), "SGLANG_USE_CPU_ENGINE": "1"}  # the CPU shim, as the engine sets it
    python = server_python("MILES_RAY_SGLANG_PYTHON", ".venv-sglang", "sglang.srt.entrypoints.http_server", shim)
    if python is None:
        from installs import missing  # here, not at the top: Ray workers import this module without tests/

        missing("sglang", "no SGLang environment: run scripts/setup_sglang.sh or set MILES_RAY_SGLANG_PYTHON")
    model_path = str(tiny_llama_dir())
    pl = placement.create(placement.colocated(1))
    engine = SGLangEngineConfig(model_path=model_path, python=python, context_length=512, lora=lora)
    config = StackConfig(
        trainer={"model_path": model_path, "optimizer": {"lr": 1e-2}, "backend": trainer_backend or {}},
        pool=RolloutPoolConfig(engine=engine, served_model_name="tiny"),
        broadcaster=WeightBroadcasterConfig(transport="broadcast", collective="gloo"),
    )
    stack = build_stack(config, pl)
    shared_memory = WeightBroadcasterConfig(transport="shared_memory")
    workers = ray.get(stack.trainer.workers.remote())
    try:
        yield {
            "pl": pl,
            "pool": stack.pool,
            "engines": list(stack.engines),
            "router": stack.router,
            "trainer": stack.trainer,
            "model_path": model_path,
            "url": ray.get(stack.engines[0].health.remote())["url"],
            "api_key": ray.get(stack.engines[0].__ray_call__.remote(lambda actor: actor.server.api_key)),
            "broadcast": stack.broadcaster,
            "shared_memory": WeightBroadcaster.remote(shared_memory, workers, list(stack.engines)),
        }
    finally:
        ray.get(stack.engines[0].shutdown.remote())
        ray.util.remove_placement_group(pl.pg)


def sglang_generate(stack, n=4, max_new_tokens=10):
    """``n`` samples of ``SGLANG_PROMPT`` through the stack's router (temperature 1, no EOS)."""
    from miles_ray.engines.requests import GenerateRequest, SamplingParams

    params = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=1.0, ignore_eos=True)
    return ray.get(stack["router"].generate.remote(GenerateRequest(list(SGLANG_PROMPT), params)))


def sglang_diff_to_trainer(stack, out) -> float:
    """Largest |server logprob - trainer logprob| over ``out``'s tokens."""
    return max_logprob_diff(out.completions, trainer_logprobs(stack["trainer"], SGLANG_PROMPT, out.completions))


def sglang_train_step(stack, out) -> dict:
    """One train step on ``out``'s completions with rewards 0, 1, 0, 1, ... (non-zero GRPO advantages)."""
    samples = [
        Sample(list(SGLANG_PROMPT), c.token_ids, c.logprobs, reward=float(i % 2)) for i, c in enumerate(out.completions)
    ]
    return ray.get(stack["trainer"].train_step.remote([GroupRef(ray.put(samples), len(samples), 0, 0)]))


def sglang_train_and_sync(stack, transport: str) -> dict:
    """A train step on fresh samples, then a sync over ``transport``; checks that the server moved with the trainer.

    Checked: the sync report's version and checksum are the engine's, new samples carry the version, their
    logprobs are the trainer's (< 1e-4) and the samples from before the step now differ from it (> 1e-3).
    Returns the sync report.
    """
    engine = stack["engines"][0]
    before = sglang_generate(stack)
    version = sglang_train_step(stack, before)["weight_version"]
    report = ray.get(stack[transport].sync.remote(version))  # raises unless the engine's checksum is the trainer's
    assert report["version"] == version and report["checksum"] == ray.get(engine.weights_checksum.remote())
    after = sglang_generate(stack)
    assert after.weight_version == after.first_weight_version == version
    assert sglang_diff_to_trainer(stack, after) < 1e-4  # the server computes with the trained weights
    assert sglang_diff_to_trainer(stack, before) > 1e-3  # which differ from the ones before
    return report


def check_in_place_pause_holds_requests(engine, router) -> None:
    """A request sent while ``engine`` is paused ``in_place`` waits, and finishes in full after ``resume``."""
    from miles_ray.engines.requests import GenerateRequest, SamplingParams

    ray.get(engine.pause.remote("in_place"))
    pending = router.generate.remote(GenerateRequest([1, 2, 3], SamplingParams(n=1, max_new_tokens=4)))
    ready, _ = ray.wait([pending], timeout=2.0)
    assert not ready  # held while paused
    ray.get(engine.resume.remote())
    assert len(ray.get(pending, timeout=60).completions[0].token_ids) == 4


def check_a_weight_load_keeps_a_pause(engine, router, broadcaster, version: int) -> None:
    """A weight load into an engine paused by the user leaves it paused: requests wait until ``resume``.

    (The servers' load paused and resumed them itself, and so resumed a server the user had paused.)
    """
    from miles_ray.engines.requests import GenerateRequest, SamplingParams

    ray.get(engine.pause.remote("in_place"))
    ray.get(broadcaster.sync.remote(version))
    assert ray.get(engine.weight_version.remote()) == version
    pending = router.generate.remote(GenerateRequest([1, 2, 3], SamplingParams(n=1, max_new_tokens=4)))
    ready, _ = ray.wait([pending], timeout=2.0)
    assert not ready, "the weight load resumed the paused engine"
    ray.get(engine.resume.remote())
    assert len(ray.get(pending, timeout=60).completions[0].token_ids) == 4


def abort_running_request(engine, max_new_tokens: int, pause_first: bool = False):
    """Start a long request, abort it while the server is paused (so it cannot finish first), resume; its output.

    ``pause_first``: send it to the already paused server, where it is held: a fast machine cannot finish it before
    the pause, and the abort ends a request that never started.
    """
    from miles_ray.engines.requests import GenerateRequest, SamplingParams

    long = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True), request_id="long")
    if pause_first:
        ray.get(engine.pause.remote("in_place"))
    future = engine.generate.remote(long)
    wait_outstanding(engine, 1, future)
    if not pause_first:
        ray.get(engine.pause.remote("in_place"))
    ray.get(engine.abort.remote("long"))
    ray.get(engine.resume.remote())
    return ray.get(future, timeout=60)


def wait_outstanding(engine, count: int, future=None) -> None:
    """Return once ``engine`` holds ``count`` requests (sent to its server, not yet answered).

    ``future``: the request waited for; if it ends first, fail with its output or error instead of waiting on.
    """
    deadline = time.time() + 60
    while ray.get(engine.health.remote())["outstanding"] < count:
        if future is not None and ray.wait([future], timeout=0)[0]:
            try:
                ended = f"with {ray.get(future)!r}"
            except Exception as e:  # noqa: BLE001 - reported as the failure's cause
                ended = f"raising {e!r}"
            raise AssertionError(f"the request ended before it was seen outstanding, {ended}")
        assert time.time() < deadline, "the request never reached the engine"
        time.sleep(0.002)


def wait_until_decoding(engine) -> None:
    """Return once ``engine`` is decoding and some tokens are in (so a sync now lands mid-request)."""
    deadline = time.time() + 60
    while ray.get(engine.health.remote())["running"] == 0:
        assert time.time() < deadline, "the engine never started decoding"
        time.sleep(0.005)
    time.sleep(0.05)


def grpo_in_step(trainer, router, wb, model_path, steps=2, check=None) -> list[str]:
    """``steps`` GRPO steps on ``ShortResponseTask`` where, before each step, the trainer's logprobs equal the
    engines' (< 1e-4: the engines hold the trainer's weights), then a verified sync.

    ``check(samples, metrics)`` may assert more per step. Returns the sync checksums.
    """
    from transformers import AutoTokenizer

    from miles_ray.actors import ReplayBuffer, ReplayBufferConfig
    from miles_ray.engines.requests import SamplingParams
    from miles_ray.rollout import generate_groups

    buffer = ReplayBuffer.remote(ReplayBufferConfig())
    task = ShortResponseTask(AutoTokenizer.from_pretrained(model_path))
    params = SamplingParams(n=4, max_new_tokens=12, ignore_eos=True)
    checksums = []
    for _ in range(steps):
        ray.get(buffer.add.remote(generate_groups(router, task, params, num_prompts=2)))
        refs = ray.get(buffer.get_batch.remote(2))
        samples = [s for g in ray.get([g.ref for g in refs]) for s in g]
        trainer_lp = ray.get(trainer.compute_logprobs.remote(refs))
        diff = max(max(abs(a - b) for a, b in zip(t, s.rollout_logprobs)) for t, s in zip(trainer_lp, samples))
        assert diff < 1e-4
        metrics = ray.get(trainer.train_step.remote(refs))
        assert metrics["grad_norm"] > 0
        if check is not None:
            check(samples, metrics)
        checksums.append(ray.get(wb.sync.remote(metrics["weight_version"]))["checksum"])  # every engine verified
    return checksums


class ShortResponseTask:
    """Data source + verifiable reward for a random tiny model: reward = share of response tokens below 1000.

    The reward varies across a group's samples (so GRPO advantages are non-zero and weights must change),
    and it is learnable: it depends only on which tokens the policy emits.
    """

    def __init__(self, tokenizer):
        self.tokenizer, self.position = tokenizer, 0

    def next_prompt(self):
        self.position += 1
        ids = self.tokenizer(f"Count to {self.position}:", add_special_tokens=False)["input_ids"]
        return {"prompt_ids": ids, "entry": {"answer": None}, "uid": self.position}

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]

    def reward(self, text, entry):
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] or [10**6]
        return sum(i < 1000 for i in ids) / len(ids)


def trainer_checksum(trainer) -> str:
    """Checksum of the trainer's full weights (from the buckets rank 0 gathers into the object store)."""
    workers = ray.get(trainer.workers.remote())
    plan = ray.get(workers[0].sync_plan.remote("float32", 1 << 30))
    refs = [r for r in ray.get([w.put_weight_buckets.remote(plan) for w in workers]) if r][0]
    return buckets_checksum(plan, [as_tensor(a, b.dtype) for b, a in zip(plan.buckets, ray.get(refs))])


def synthetic_group(group_id: int, first_token: int = 1) -> list[GroupRef]:
    """One group of 4 two-token responses with rewards 0..3 (non-zero GRPO advantages), as a one-GroupRef list."""
    prompt = [first_token, 2, 3]
    samples = [
        Sample(prompt, [4 + i, 5 + group_id], [-1.0, -1.0], reward=float(i), group_id=group_id) for i in range(4)
    ]
    return [GroupRef(ray.put(samples), 4, 0, group_id)]


def reward_by_source(text: str, entry: dict) -> float:
    """An eval reward known in advance: 1 for rows of source ``a``, 0 for ``b``; rows of ``c`` make it raise."""
    assert isinstance(text, str)
    if entry["data_source"] == "c":
        raise RuntimeError("a reward that fails")
    return float(entry["data_source"] == "a")


def server_auth_probe(actor, routes: list[tuple[str, str]], safe: tuple[str, str]) -> dict:
    """Run in a vLLM/SGLang engine actor (``engine.__ray_call__.remote(server_auth_probe, ...)``): the status codes
    of ``(method, route)`` calls to its server without a key and with a wrong one, of ``/health`` without a key
    and of the ``safe`` call with the server's key, and whether the key shows on the server's command line."""
    import urllib.error
    import urllib.request

    server = actor.server

    def status(method: str, route: str, key: str | None) -> int:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        data = b"{}" if method == "POST" else None
        request = urllib.request.Request(server.url + route, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    argv = Path(f"/proc/{server._proc.pid}/cmdline").read_bytes()
    return {
        "key_in_argv": server.api_key.encode() in argv,
        "without_key": {route: status(method, route, None) for method, route in routes},
        "wrong_key": {route: status(method, route, "wrong") for method, route in routes},
        "health": status("GET", "/health", None),
        "safe_with_key": status(*safe, server.api_key),
    }


class SyntheticSource:
    """Deterministic data source: the batch at each position depends on the position only."""

    def __init__(self):
        self.position = 0

    def next_batch(self):
        self.position += 1
        return synthetic_group(self.position % 5)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def stop_stepping(engine) -> bool:
    """Fault injection: end an engine actor's stepping thread (as a bug in it would) and return whether it lives."""

    def stop(actor):
        def exit_thread():
            raise SystemExit  # past the loop's `except Exception`, as only a fatal error would be

        actor.engine.has_work = exit_thread
        actor.loop.wake()
        actor.loop._thread.join(10)
        return actor.loop.alive

    return ray.get(engine.__ray_call__.remote(stop))


def check_a_stop_string_stays_in_the_text(router, tokenizer) -> None:
    """Greedy twice through ``router``: given a piece of the first response's text as a stop string, the second
    stops where the piece is complete, with the first one's tokens up to there, and its text ends with the piece;
    both texts leave special tokens out, as the embedded engine's do (``sampling.cut_at_stop``). The stop reason
    names what ended a response, as vLLM's does: the stop string, a stop token id, None for a length cut.

    A random model's greedy response may repeat one special token (no text): prompts are tried until one's has
    text to cut a piece from.
    """
    from miles_ray.engines.requests import GenerateRequest, SamplingParams

    def complete(prompt, **params):
        params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, **params}
        return ray.get(
            router.generate.remote(GenerateRequest(prompt, SamplingParams(**params))), timeout=120
        ).completions[0]

    for prompt in ([1, 2, 3, 4, 5], [1000, 2000, 3000], [4321, 87, 9000, 1234], [300, 301, 302, 303]):
        first = complete(prompt)
        assert first.text == tokenizer.decode(first.token_ids, skip_special_tokens=True), first.text  # no specials
        pieces = [tokenizer.decode(first.token_ids[i : i + 2], skip_special_tokens=True) for i in range(2, 20)]
        stop = next((s for s in pieces if s.isascii() and len(s.strip()) >= 2), None)
        if stop is not None:
            break
    assert stop is not None, (first.token_ids, pieces)
    c = complete(prompt, stop=[stop])
    assert c.finish_reason == "stop" and c.token_ids == first.token_ids[: len(c.token_ids)]
    assert c.stop_reason == stop and first.stop_reason is None, (c.stop_reason, first.stop_reason)
    assert c.text.endswith(stop) and c.text.count(stop) == 1, (c.text, stop)
    assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)[: len(c.text)]
    # not ignore_eos: SGLang's would ignore the stop token too (its engine refuses the pair, test_sglang.py)
    by_token = complete(prompt, stop_token_ids=[first.token_ids[3]], ignore_eos=False)
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", first.token_ids[3]), by_token
