import pytest
import torch

from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.engines.requests import GenerateRequest, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return EmbeddedEngine(EmbeddedEngineConfig(model_path=tiny_model_path, max_batch_size=16, max_seq_len=128))


PROMPT = [1, 50, 60, 70, 80]
GREEDY_24 = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}  # as `greedy_and_a_piece`'s


def _submit(engine, request):
    box = {}
    engine.submit(request, lambda out: box.__setitem__("out", out), lambda exc: box.__setitem__("err", exc))
    return box


def test_n_samples_lengths_and_logprobs(engine):
    [out] = engine.generate([GenerateRequest(PROMPT, SamplingParams(n=4, max_new_tokens=12, ignore_eos=True, seed=1))])
    assert len(out.completions) == 4
    for c in out.completions:
        assert len(c.token_ids) == len(c.logprobs) == 12 and c.finish_reason == "length"
        assert all(lp <= 0 for lp in c.logprobs)
    assert len({tuple(c.token_ids) for c in out.completions}) > 1  # the group's samples differ


def test_logprobs_equal_teacher_forced_hf_under_continuous_batching(engine, teacher_forced):
    """fp32: every sampled token's logprob equals HF's recomputation to 1e-5, whatever shared the batch."""
    requests = [
        GenerateRequest(PROMPT, SamplingParams(n=3, max_new_tokens=20, ignore_eos=True, seed=3)),
        GenerateRequest([1, 2, 3], SamplingParams(n=2, max_new_tokens=7, seed=4)),
        GenerateRequest(list(range(5, 30)), SamplingParams(max_new_tokens=15, top_p=0.9, seed=5)),
    ]
    boxes = [_submit(engine, requests[0])]
    for _ in range(4):  # the others join a running batch
        engine.step()
    boxes += [_submit(engine, r) for r in requests[1:]]
    while any("out" not in b for b in boxes):
        engine.step()
    worst = 0.0
    for r, b in zip(requests, boxes):
        for c in b["out"].completions:
            ref = teacher_forced(r.prompt_ids, c.token_ids)
            worst = max(worst, (torch.tensor(c.logprobs) - ref).abs().max().item())
    assert worst < 1e-5


def test_requests_join_and_leave_the_running_batch(engine):
    long = _submit(engine, GenerateRequest(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True, seed=1)))
    engine.step()
    short = _submit(engine, GenerateRequest([1, 2], SamplingParams(max_new_tokens=3, ignore_eos=True, seed=1)))
    steps = 0
    while "out" not in short:
        engine.step()
        steps += 1
    assert steps <= 2 and "out" not in long  # the short one did not wait for the long one, nor it for a batch
    assert engine.stats()["running"] == 1
    while "out" not in long:
        engine.step()
    assert len(long["out"].completions[0].token_ids) == 40 and engine.stats()["running"] == 0


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    params = SamplingParams(n=2, max_new_tokens=10, seed=7, ignore_eos=True)
    [alone] = engine.generate([GenerateRequest(PROMPT, params)])
    batched = engine.generate(
        [GenerateRequest([1, 2, 3], SamplingParams(n=3, max_new_tokens=5)), GenerateRequest(PROMPT, params)]
    )
    assert [c.token_ids for c in alone.completions] == [c.token_ids for c in batched[1].completions]
    for a, b in zip(alone.completions, batched[1].completions):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_prefix_sharing_off_gives_the_same_samples(tiny_model_path, engine):
    unshared = EmbeddedEngine(
        EmbeddedEngineConfig(model_path=tiny_model_path, max_batch_size=16, max_seq_len=128, prefix_sharing=False)
    )
    request = GenerateRequest(PROMPT, SamplingParams(n=4, max_new_tokens=8, seed=11, ignore_eos=True))
    [a], [b] = engine.generate([request]), unshared.generate([request])
    assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]


def test_kv_budget_caps_slots_and_queues_the_rest(tiny_model_path):
    probe = EmbeddedEngine(EmbeddedEngineConfig(model_path=tiny_model_path, max_seq_len=64))
    slot_gb = probe.model.kv_bytes_per_slot(64) / 2**30
    small = EmbeddedEngine(
        EmbeddedEngineConfig(model_path=tiny_model_path, max_seq_len=64, kv_cache_memory_gb=3.5 * slot_gb)
    )
    assert small.num_slots == 3
    with pytest.raises(ValueError, match="exceeds the engine's 3 KV slots"):
        small.generate([GenerateRequest(PROMPT, SamplingParams(n=4))])
    outs = small.generate([GenerateRequest(PROMPT, SamplingParams(n=2, max_new_tokens=5, seed=i)) for i in range(5)])
    assert [len(o.completions) for o in outs] == [2] * 5
    with pytest.raises(ValueError, match="kv_cache_memory_gb=.* holds no sequence"):
        EmbeddedEngine(EmbeddedEngineConfig(model_path=tiny_model_path, max_seq_len=64, kv_cache_memory_gb=slot_gb / 2))


def test_abort_returns_partial_output_with_logprobs(engine):
    box = _submit(engine, GenerateRequest(PROMPT, SamplingParams(n=2, max_new_tokens=50, ignore_eos=True), "r1"))
    waiting = _submit(engine, GenerateRequest(PROMPT, SamplingParams(n=15, max_new_tokens=5), "r2"))  # no room yet
    for _ in range(3):
        engine.step()
    engine.abort("r1")
    engine.abort("r2")
    engine.step()
    for c in box["out"].completions:
        assert c.finish_reason == "abort" and 0 < len(c.token_ids) == len(c.logprobs) < 50
    assert [c.finish_reason for c in waiting["out"].completions] == ["abort"] * 15
    assert all(c.token_ids == [] for c in waiting["out"].completions)


def test_pause_in_place_keeps_sequences_across_a_weight_update(engine):
    box = _submit(engine, GenerateRequest(PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True, seed=2)))
    engine.step()
    engine.pause("in_place")
    assert not engine.has_work()
    engine.step()
    assert engine.stats()["running"] == 1 and "out" not in box
    engine.set_weight_version(engine.weight_version() + 1)  # weights may change while paused
    engine.resume()
    while "out" not in box:
        engine.step()
    out = box["out"]
    assert len(out.completions[0].token_ids) == 12 and out.weight_version == out.first_weight_version + 1


def test_pause_abort_ends_everything_in_flight(engine):
    box = _submit(engine, GenerateRequest(PROMPT, SamplingParams(max_new_tokens=30, ignore_eos=True)))
    engine.step()
    engine.pause("abort")
    assert box["out"].completions[0].finish_reason == "abort"
    queued = _submit(engine, GenerateRequest(PROMPT, SamplingParams(max_new_tokens=3)))
    engine.step()
    assert "out" not in queued  # paused: new requests wait
    with pytest.raises(RuntimeError, match="the engine is paused"):
        engine.generate([GenerateRequest(PROMPT, SamplingParams(max_new_tokens=3))])
    engine.resume()
    while "out" not in queued:
        engine.step()
    with pytest.raises(ValueError, match="pause mode must be"):
        engine.pause("retract")


def test_failing_step_fails_its_requests_not_the_engine(engine, monkeypatch):
    box = _submit(engine, GenerateRequest(PROMPT, SamplingParams(max_new_tokens=5)))

    def broken(*args, **kwargs):  # fault injection: the model raises mid-decode
        raise RuntimeError("injected decode failure")

    monkeypatch.setattr(engine.model, "decode", broken)
    engine.step()
    assert isinstance(box.get("err"), RuntimeError) and engine.stats()["running"] == 0
    monkeypatch.undo()
    [out] = engine.generate([GenerateRequest(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))])
    assert len(out.completions[0].token_ids) == 4


def test_greedy_equals_hf_greedy(engine, hf):
    [out] = engine.generate([GenerateRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))])
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.completions[0].token_ids == ref[0, len(PROMPT) :].tolist()


def test_top_k_1_is_greedy(engine):
    greedy = engine.generate(
        [GenerateRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))]
    )
    topk = engine.generate([GenerateRequest(PROMPT, SamplingParams(top_k=1, max_new_tokens=6, ignore_eos=True))])
    assert greedy[0].completions[0].token_ids == topk[0].completions[0].token_ids


def test_stop_token_ends_response(engine):
    [free] = engine.generate(
        [GenerateRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))]
    )
    stop_at = free.completions[0].token_ids[2]
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, stop_token_ids=[stop_at])
    [out] = engine.generate([GenerateRequest(PROMPT, params)])
    c = out.completions[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] == stop_at and c.stop_reason == stop_at
    assert c.token_ids == free.completions[0].token_ids[: free.completions[0].token_ids.index(stop_at) + 1]


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        (GenerateRequest([], SamplingParams()), "prompt_ids must not be empty"),
        (GenerateRequest([10**7], SamplingParams()), "prompt_ids must be in"),
        (GenerateRequest([1], SamplingParams(n=17)), "exceeds the engine's 16 KV slots"),
        (GenerateRequest([1] * 100, SamplingParams(max_new_tokens=64)), "exceeds max_seq_len"),
    ],
)
def test_invalid_requests(engine, request_, match):
    with pytest.raises(ValueError, match=match):
        engine.generate([request_])
    assert engine.stats()["waiting"] == 0  # nothing half-queued


def test_update_weights_validates_and_changes_output(engine):
    name = "model.norm.weight"
    with pytest.raises(ValueError, match="unknown parameter"):
        engine.update_weights([("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights([(name, torch.zeros(3))])
    before = engine.weights_checksum()
    old = dict(engine.model.named_parameters())[name].clone()
    engine.update_weights([(name, old * 2)])
    assert engine.weights_checksum() != before
    engine.update_weights([(name, old)])
    assert engine.weights_checksum() == before


def test_a_prompt_that_fails_prefill_fails_alone(engine, monkeypatch):
    """Regression (#23): a prefill failure used to fail every running request with the bad one."""
    running = _submit(engine, GenerateRequest(PROMPT, SamplingParams(max_new_tokens=20, ignore_eos=True), "ok"))
    engine.step()
    new_row = engine._new_row

    def broken(req, j):  # fault injection: one request's row cannot be built (as a bad seed once did)
        if req.request.request_id == "bad":
            raise RuntimeError("injected prefill failure")
        return new_row(req, j)

    monkeypatch.setattr(engine, "_new_row", broken)
    bad = _submit(engine, GenerateRequest(PROMPT, SamplingParams(max_new_tokens=5), "bad"))
    for _ in range(40):
        if running:
            break
        engine.step()
    assert "err" not in running and "injected prefill failure" in str(bad["err"])
    assert len(running["out"].completions[0].token_ids) == 20


def test_an_out_of_range_seed_is_refused_and_derived_seeds_wrap():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**63)
    SamplingParams(seed=-(2**63))
    # a resumed request derives seed * 7919 + ...: past 64 bits, the engine wraps it instead of failing
    derived = SamplingParams(seed=2**62).model_copy(update={"seed": 2**62 * 7919})
    assert derived.seed > 2**64


def test_a_huge_derived_seed_samples(engine):
    derived = SamplingParams(max_new_tokens=3, ignore_eos=True).model_copy(update={"seed": 2**62 * 7919})
    [out] = engine.generate([GenerateRequest(PROMPT, derived)])
    assert len(out.completions[0].token_ids) == 3


def test_a_request_id_must_be_a_string(engine):
    with pytest.raises(ValueError, match="request_id must be a string"):
        engine.generate([GenerateRequest(PROMPT, SamplingParams(), request_id={"a": 1})])


def test_the_loop_survives_a_failing_step_and_reports_a_dead_thread(tiny_model_path):
    """A step raising past the engine's isolation fails the requests in flight, not the loop; a dead loop says so."""
    import asyncio

    from miles_ray.engines.loop import EngineLoop
    from miles_ray.engines.requests import EngineDeadError

    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=tiny_model_path, max_batch_size=4, max_seq_len=64))
    loop = EngineLoop(engine)
    apply_aborts = engine._apply_aborts
    calls = {"n": 0}

    def broken_once():  # fault injection: the abort bookkeeping raises once (an unhashable rid used to)
        calls["n"] += 1
        if calls["n"] == 1:
            raise TypeError("injected: unhashable type")
        apply_aborts()

    engine._apply_aborts = broken_once
    request = GenerateRequest(PROMPT, SamplingParams(max_new_tokens=30, ignore_eos=True))

    async def scenario():
        with pytest.raises(TypeError, match="injected"):
            await asyncio.wait_for(loop.generate(request), 30)
        again = await asyncio.wait_for(loop.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=2))), 30)
        return again

    again = asyncio.run(scenario())
    assert loop.step_errors == 1 and loop.alive and len(again.completions[0].token_ids) <= 2

    def exit_thread():  # fault injection: something no `except Exception` catches ends the thread
        raise SystemExit

    engine.has_work = exit_thread
    loop.wake()
    loop._thread.join(10)
    assert not loop.alive
    with pytest.raises(EngineDeadError, match="stepping thread has died"):
        asyncio.run(loop.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=2))))


def test_streamed_tokens_arrive_in_order_and_a_broken_reader_aborts_only_its_request(engine):
    """``on_token`` sees every sampled token before ``on_done``; one that raises (its event loop closed) ends
    its own request and not the one decoding beside it."""
    seen, outs = [], {}

    def broken(index, token, logprob):
        raise RuntimeError("Event loop is closed")

    params = SamplingParams(n=2, max_new_tokens=12, ignore_eos=True, seed=1)
    on_token = lambda i, t, lp: seen.append((i, t, lp))  # noqa: E731
    engine.submit(GenerateRequest(PROMPT, params, "reader"), lambda o: outs.update(reader=o), pytest.fail, on_token)
    engine.submit(GenerateRequest(PROMPT, params, "broken"), lambda o: outs.update(broken=o), pytest.fail, broken)
    while engine.has_work():
        engine.step()
    reader, gone = outs["reader"], outs["broken"]
    for i, c in enumerate(reader.completions):
        assert c.finish_reason == "length" and [(t, lp) for j, t, lp in seen if j == i] == list(
            zip(c.token_ids, c.logprobs)
        )
    assert all(c.finish_reason == "abort" and len(c.token_ids) <= 2 for c in gone.completions)


def test_device_auto_is_the_cpu_here_and_cuda_without_one_is_refused(tiny_model_path, engine):
    assert engine.device == torch.device("cpu")  # "auto" on a machine without CUDA
    assert engine._cache.k[0].device == engine.device
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: device='cuda' is allowed")
    with pytest.raises(ValueError, match="device='cuda' but this process sees no CUDA device"):
        EmbeddedEngine(EmbeddedEngineConfig(model_path=tiny_model_path, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_samples_what_the_cpu_engine_samples(tiny_model_path, engine):
    """Same seeds on CUDA and CPU (the rows' generators stay on the CPU): same tokens, logprobs within fp32 noise."""
    cuda = EmbeddedEngine(EmbeddedEngineConfig(model_path=tiny_model_path, device="cuda", max_seq_len=64))
    params = SamplingParams(n=3, max_new_tokens=8, ignore_eos=True, seed=5)
    [a], [b] = (e.generate([GenerateRequest([1, 2, 3], params)]) for e in (engine, cuda))
    for x, y in zip(a.completions, b.completions):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_qwen3_families_batch_share_prefixes_and_match_hf(family, request):
    """Qwen3 / Qwen3-MoE in the engine: fp32 logprobs equal HF's teacher-forced ones under continuous batching,
    and prefix sharing gives the same samples and (MoE) the same routes as prefilling every sample."""
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue("tiny_qwen3_path" if family == "qwen3" else "tiny_qwen3_moe_path")
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    requests = [
        GenerateRequest(PROMPT, SamplingParams(n=3, max_new_tokens=12, ignore_eos=True, seed=3)),
        GenerateRequest(list(range(5, 25)), SamplingParams(n=2, max_new_tokens=6, seed=4)),
    ]
    outs = {}
    for sharing in (True, False):
        config = EmbeddedEngineConfig(model_path=path, max_batch_size=8, max_seq_len=64, prefix_sharing=sharing)
        outs[sharing] = EmbeddedEngine(config).generate(requests)
    for r, shared, unshared in zip(requests, outs[True], outs[False]):
        for c, u in zip(shared.completions, unshared.completions):
            assert c.token_ids == u.token_ids
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([r.prompt_ids + c.token_ids])).logits[0, len(r.prompt_ids) - 1 : -1]
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=1e-5)
            if family == "qwen3_moe":  # a route for each fed token and each of the 2 MoE layers (layer 1 is dense)
                assert c.routes.shape == (len(r.prompt_ids) + len(c.token_ids) - 1, 2, 2)
                assert torch.equal(c.routes, u.routes)
            else:
                assert c.routes is None


def test_a_stop_string_ends_the_response_and_stays_in_its_text(engine, greedy_and_a_piece):
    """Greedy twice: the second run, given a piece of the first one's text as a stop string, stops where that piece
    is complete; its tokens are the first run's up to there and its text ends with the piece (as vLLM's and SGLang's
    do, ``tests/e2e/helpers.check_a_stop_string_stays_in_the_text``)."""
    prompt, first, _, stop = greedy_and_a_piece(engine, 2)
    [c] = engine.generate([GenerateRequest(prompt, SamplingParams(**GREEDY_24, stop=[stop]))])[0].completions
    assert c.finish_reason == "stop" and c.stop_reason == stop and c.token_ids == first.token_ids[: len(c.token_ids)]
    assert c.text.endswith(stop) and c.text.count(stop) == 1, (c.text, stop)
    assert c.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)[: len(c.text)]  # nothing after it
    assert first.finish_reason == "length" and first.stop_reason is None


def test_a_resumed_request_stops_at_a_stop_string_begun_before_it(engine, greedy_and_a_piece):
    """A request continued after an abort (``resumed``: the response so far ends its prompt) stops at a stop string
    that started in that response, as the uninterrupted request does; without ``resumed`` it would run on."""
    prompt, first, i, stop = greedy_and_a_piece(engine, 3)
    whole = engine.generate([GenerateRequest(prompt, SamplingParams(**GREEDY_24, stop=[stop]))])[0].completions[0]
    k = i + 1  # the abort fell inside the stop string: its first token is in the resumed prompt
    params = SamplingParams(**{**GREEDY_24, "max_new_tokens": 24 - k}, stop=[stop])
    [resumed, unaware] = [
        engine.generate([GenerateRequest(prompt + first.token_ids[:k], params, resumed=r)])[0].completions[0]
        for r in (k, 0)
    ]
    assert resumed.finish_reason == "stop" and resumed.stop_reason == stop
    assert first.token_ids[:k] + resumed.token_ids == whole.token_ids
    assert unaware.finish_reason == "length" and len(unaware.token_ids) == 24 - k  # the check it replaces
    with pytest.raises(ValueError, match=r"resumed must be in \[0, 5\)"):
        engine.generate([GenerateRequest(PROMPT, params, resumed=5)])
