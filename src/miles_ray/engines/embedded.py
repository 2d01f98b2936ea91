"""The embedded rollout engine: continuous batching over a slot KV cache in pure PyTorch (CPU included).

Scheduling: requests wait in a FIFO queue; each ``step()`` admits waiting requests while KV slots are
free (all ``n`` samples of a request together), prefills their prompts in one batch, then decodes one
token for every running sequence. A finished sequence leaves the batch at once and its slot goes to the
next request, so short responses never wait for long ones and new requests never wait for a batch to
drain. The ``n`` samples of a request prefill the prompt once and copy its KV (prefix sharing).

Memory: ``kv_cache_memory_gb`` buys ``num_slots`` slots of ``max_seq_len`` tokens each, allocated once.

Control: ``abort(request_id)`` ends a request now and returns what it generated so far (with logprobs);
``pause("in_place")`` stops stepping with sequences kept in their slots (weights may change meanwhile,
``resume()`` continues them), ``pause("abort")`` aborts everything in flight first.

Usage::

    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=path))
    [out] = engine.generate([GenerateRequest(prompt_ids=ids, params=SamplingParams(n=4))])
    out.completions[0].token_ids, out.completions[0].logprobs

``generate`` steps the engine on the calling thread; ``miles_ray.engines.loop.EngineLoop`` steps it on a
worker thread for asyncio callers (the Ray actor and the HTTP server).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from miles_ray.callables import resolve_callable
from miles_ray.config import StrictConfig
from miles_ray.devices import configure_host, native_bf16, rank_device
from miles_ray.engines.requests import (
    MAX_SEQ_LEN,
    Completion,
    GenerateOutput,
    GenerateRequest,
    PauseMode,
    check_pause_mode,
)
from miles_ray.engines.sampling import cut_at_stop, sample_tokens, stop_string_hit, stop_tail_length
from miles_ray.models.quant import RoundedLinear, WeightFormatConfig, apply_weight_format
from miles_ray.sync.buckets import AdapterSpec
from miles_ray.sync.digest import Known, TensorDigests

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolved_device(device: str) -> torch.device:
    """An engine device name as a torch device; ``auto``: the CUDA device this process was given, else the CPU."""
    if device == "auto":
        return rank_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but this process sees no CUDA device; allowed here: 'cpu' or 'auto'")
    return torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device(device)


def resolved_dtype(dtype: str, device: torch.device | None = None) -> torch.dtype:
    """An engine dtype name as a torch dtype; ``auto``: bfloat16 where ``device`` (default CPU) computes it natively."""
    if dtype == "auto":
        return torch.bfloat16 if native_bf16(device or torch.device("cpu")) else torch.float32
    return _DTYPES[dtype]


class EmbeddedEngineConfig(StrictConfig):
    """Configuration of one embedded engine."""

    kind: Literal["embedded"] = "embedded"
    model_path: str = Field(..., description="HF model directory (config.json + safetensors + tokenizer).")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32",
        description="Weights and KV cache dtype. 'auto': bfloat16 where the device computes it natively (CUDA with "
        "bf16, CPUs with AVX512-BF16 or AMX), else float32; float32 gives exact logprobs (equal to an fp32 trainer's).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where the model, KV cache and sampling live. 'auto': the CUDA device this process was given "
        "(Ray sets it for an engine with GPUs), else the CPU.",
    )
    max_batch_size: int = Field(64, ge=1, le=4096, description="Sequences decoded together at most (KV slots).")
    max_seq_len: int = Field(1024, ge=8, le=MAX_SEQ_LEN, description="Prompt + response tokens per sequence at most.")
    kv_cache_memory_gb: float = Field(
        2.0, gt=0.0, le=4096.0, description="KV cache budget; caps the slots at budget / bytes of one slot."
    )
    max_prefill_tokens: int = Field(
        8192, ge=1, description="Prompt tokens prefilled per step at most (bounds the stall of running decodes)."
    )
    prefix_sharing: bool = Field(True, description="Prefill a prompt once for its n samples and copy its KV.")
    num_threads: int = Field(1, ge=1, le=256, description="torch intra-op threads for this engine.")
    seed: int = Field(0, description="Seed of the engine RNG used by requests without their own seed.")
    weight_format: WeightFormatConfig | None = Field(
        None,
        description="Low-precision recipe (fp8 / int4): linear layers but the LM head compute with weights rounded "
        "through the format (emulated), re-rounded after every weight load; give the trainer the same config.",
    )
    tune_malloc: bool = Field(
        True,
        description="glibc only: keep freed memory in this process's heap (mallopt) so each step's vocab-sized "
        "temporaries do not page-fault afresh (measured ~20% faster decode on CPU; devices.configure_host). "
        "Process-wide.",
    )
    model_specs: dict[str, str | Callable[..., Any]] = Field(
        default_factory=dict,
        description="Your own model families: HF model_type -> spec '(hf_dir, dtype) -> model' (a callable or "
        "'pkg.module:fn'; miles_ray.models.EngineModel says what the model provides); they take precedence over the "
        "built-in ones (miles_ray.models.ENGINE_MODEL_SPECS).",
    )

    @model_validator(mode="after")
    def _known_family(self) -> EmbeddedEngineConfig:
        from miles_ray.models import model_spec, model_type_of

        for model_type, spec in self.model_specs.items():
            resolve_callable(spec, f"model_specs[{model_type!r}]")  # fail where the config is made
        if (Path(self.model_path) / "config.json").is_file():  # a path only the engines' nodes hold is checked there
            model_spec(model_type_of(self.model_path), self.model_specs)
        return self


DoneFn = Callable[[GenerateOutput], None]
ErrorFn = Callable[[BaseException], None]
TokenFn = Callable[[int, int, float], None]  # (sample index, token id, logprob): each token as it is sampled


@dataclass(eq=False)
class _Request:
    request: GenerateRequest
    on_done: DoneFn
    on_error: ErrorFn
    on_token: TokenFn | None = None
    first_version: int = -1
    completions: list[Completion | None] = field(default_factory=list)
    aborted: bool = False


@dataclass(eq=False)
class _Row:
    """One running sequence: sample ``index`` of ``req``; its KV fills positions ``0..length-1`` of its slot."""

    req: _Request
    index: int
    gen: torch.Generator
    stop_ids: set[int]
    length: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)  # MoE: experts of each fed token, in chunks
    earlier: list[int] = field(default_factory=list)  # resumed: the response's last tokens before (stop strings span)


class EmbeddedEngine:
    """The in-process rollout engine: continuous batching over a slot KV cache (see the module docstring)."""

    def __init__(self, config: EmbeddedEngineConfig):
        from transformers import AutoTokenizer

        from miles_ray.models import build_engine_model

        self.config = config
        configure_host(config.num_threads, config.tune_malloc)
        self.device = resolved_device(config.device)
        self.dtype = resolved_dtype(config.dtype, self.device)
        self.model = build_engine_model(config.model_path, self.dtype, config.model_specs).to(self.device)
        self._rounded: dict[str, RoundedLinear] = {}  # weight name -> layer computing with its rounded copy
        if config.weight_format is not None:
            for name in apply_weight_format(self.model, config.weight_format, "engine"):
                self._rounded[f"{name}.weight"] = self.model.get_submodule(name)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        slot_bytes = self.model.kv_bytes_per_slot(config.max_seq_len)
        self.num_slots = min(config.max_batch_size, int(config.kv_cache_memory_gb * 2**30 // slot_bytes))
        if self.num_slots < 1:
            raise ValueError(
                f"kv_cache_memory_gb={config.kv_cache_memory_gb} holds no sequence of max_seq_len={config.max_seq_len} "
                f"({slot_bytes / 2**20:.1f} MiB per sequence); raise kv_cache_memory_gb or lower max_seq_len"
            )
        self._cache = self.model.new_cache(self.num_slots, config.max_seq_len)
        self._rng = torch.Generator().manual_seed(config.seed)
        self._version = 0
        self._params = dict(self.model.named_parameters())
        self.adapter: AdapterSpec | None = None  # LoRA adapters the model holds (install_adapter)
        self._lock = threading.RLock()  # model, cache and running rows: one step or one weight update at a time
        self._mu = threading.Lock()  # waiting queue and abort marks, so submit/abort never wait for a step
        self._waiting: collections.deque[_Request] = collections.deque()
        self._abort_ids: set[str] = set()
        self._abort_all = False
        self._running: list[_Row] = []  # row i lives in cache slot i
        self._paused = False
        self._holding = False  # admit no waiting request (running ones go on): draining before a weight load

    # --- weights -------------------------------------------------------------------------------
    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], alias: bool = False) -> None:
        """Copy HF-named tensors into the model (casting to the engine dtype), between decode steps.

        ``alias``: the caller owns the tensors' memory and leaves it unwritten until the next update (a sync's
        persistent bucket buffers), so a parameter of the same dtype and device takes the tensor itself, no copy.

        Raises:
            ValueError: for an unknown name or a shape mismatch; nothing is copied then.

        """
        for name, t in named_tensors:
            if name not in self._params:
                raise ValueError(f"update_weights: unknown parameter {name!r}")
            if tuple(t.shape) != tuple(self._params[name].shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(t.shape)}, engine expects "
                    f"{tuple(self._params[name].shape)}"
                )
        with self._lock, torch.no_grad():
            for name, t in named_tensors:
                param = self._params[name]
                if alias and t.dtype == param.dtype and t.device == param.device and t.is_contiguous():
                    param.data = t  # the module keeps its Parameter; only the storage behind it changes
                else:
                    param.copy_(t)
                if name in self._rounded:
                    self._rounded[name].refresh()

    def set_weight_version(self, version: int) -> None:
        """Record the version of the loaded weights."""
        self._version = int(version)

    def weight_version(self) -> int:
        """The version of the loaded weights."""
        return self._version

    def weights_checksum(
        self,
        names: Collection[str] | None = None,
        known: Mapping[str, Known] | None = None,
        sample: int | None = None,
    ) -> str:
        """Checksum over the HF-named parameters (tied weights counted once), or only those in ``names``.

        ``known``: digests of received tensors by name; a parameter that views exactly that tensor takes its digest
        instead of being read again (``sync.digest``). ``sample``: the sampled digest (``sync.digest``).
        """
        with self._lock:
            params = self._params.items()  # named_parameters(), tied ones once, without walking the modules again
            if names is not None:
                wanted = set(names)
                params = ((n, p) for n, p in params if n in wanted)
            return TensorDigests(sample).add(params, known).hexdigest()

    def install_adapter(self, spec: AdapterSpec) -> bool:
        """Give the model LoRA adapters of ``spec`` (zero, so outputs are unchanged) before the first adapter sync.

        Returns:
            True if they were added now, False if the engine already holds this spec.

        Raises:
            ValueError: if the engine holds a different adapter spec (rank, scaling and targets are fixed per run).

        """
        from miles_ray.models.lora_layers import add_lora

        if self.config.weight_format is not None:
            raise ValueError("LoRA adapters and weight_format cannot be combined yet (engine config)")
        with self._lock:
            if self.adapter == spec:
                return False
            if self.adapter is not None:
                raise ValueError(f"engine holds adapter {self.adapter}; a sync sent {spec}: one adapter spec per run")
            add_lora(self.model, spec)
            self.adapter = spec
            self._params = dict(self.model.named_parameters())
            return True

    def state_dict_names(self) -> list[str]:
        """HF names of the parameters this engine accepts."""
        return list(self._params)

    # --- requests ------------------------------------------------------------------------------
    def validate(self, r: GenerateRequest) -> None:
        """Raise ``ValueError`` naming what is wrong with a request."""
        if not isinstance(r.request_id, str):  # aborts look requests up by id: it must be a hashable string
            raise ValueError(f"request_id must be a string, got {type(r.request_id).__name__}")
        if not r.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if not 0 <= r.resumed < len(r.prompt_ids):
            raise ValueError(f"resumed must be in [0, {len(r.prompt_ids)}) (prompt_ids' length), got {r.resumed}")
        vocab = self.model.args.vocab_size
        if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= vocab:
            raise ValueError(f"prompt_ids must be in [0, {vocab}), got min {min(r.prompt_ids)} max {max(r.prompt_ids)}")
        if r.params.n > self.num_slots:
            raise ValueError(
                f"sampling_params.n={r.params.n} exceeds the engine's {self.num_slots} KV slots "
                f"(max_batch_size={self.config.max_batch_size}, kv_cache_memory_gb={self.config.kv_cache_memory_gb})"
            )
        total = len(r.prompt_ids) + r.params.max_new_tokens
        if total > self.config.max_seq_len:
            raise ValueError(
                f"prompt ({len(r.prompt_ids)} tokens) + max_new_tokens ({r.params.max_new_tokens}) "
                f"exceeds max_seq_len={self.config.max_seq_len}"
            )

    def submit(
        self, request: GenerateRequest, on_done: DoneFn, on_error: ErrorFn, on_token: TokenFn | None = None
    ) -> None:
        """Queue ``request``; ``on_done(output)`` or ``on_error(exc)`` is called from the stepping thread.

        ``on_token(index, token_id, logprob)``, if given, is called there for each token of sample ``index`` as
        it is sampled (streaming), before ``on_done``.

        Raises:
            ValueError: for an invalid request (see ``validate``); nothing is queued then.

        """
        self.validate(request)
        with self._mu:
            self._waiting.append(_Request(request, on_done, on_error, on_token, completions=[None] * request.params.n))

    def abort(self, request_id: str | None = None) -> None:
        """End the request(s) with ``request_id`` (all requests if None) at the next step, keeping their output."""
        with self._mu:
            if request_id is None:
                self._abort_all = True
            else:
                self._abort_ids.add(request_id)

    def pause(self, mode: PauseMode = "abort") -> None:
        """Stop stepping. ``in_place`` keeps running sequences in their slots; ``abort`` ends them first.

        Raises:
            ValueError: for another mode.

        """
        check_pause_mode(mode)
        with self._lock:  # returns once the step in progress (if any) is over
            self._paused = True
            if mode == "abort":
                self.abort(None)
                self.step()  # paused, so this only applies the aborts: partial outputs are delivered now

    def resume(self) -> None:
        """Continue stepping after ``pause``."""
        self._paused = False

    def hold_admission(self, hold: bool) -> None:
        """Stop (``True``) or restart admitting waiting requests; running sequences keep decoding meanwhile."""
        self._holding = hold

    def num_running(self) -> int:
        """Sequences decoding now."""
        return len(self._running)

    def request_ids(self) -> set[str]:
        """Ids of the requests waiting or running now."""
        with self._mu:
            waiting = {r.request.request_id for r in self._waiting}
        return waiting | {row.req.request.request_id for row in list(self._running)}

    @property
    def paused(self) -> bool:
        """Whether the engine is paused."""
        return self._paused

    def has_work(self) -> bool:
        """True when a ``step`` would do something."""
        with self._mu:
            marks = self._abort_all or bool(self._abort_ids)
            waiting = bool(self._waiting) and not self._holding
            return marks or (not self._paused and bool(self._running or waiting))

    def stats(self) -> dict:
        """Load: running sequences, waiting requests, KV tokens in use and the slot count; dtype and device."""
        return {
            "running": len(self._running),
            "waiting": len(self._waiting),
            "kv_tokens_used": sum(r.length for r in self._running),
            "num_slots": self.num_slots,
            "paused": self._paused,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
        }

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """Sample every request's ``n`` responses (continuous batching), stepping on this thread.

        Raises:
            ValueError: for an invalid request (before any is queued).
            RuntimeError: if the engine is paused (``resume()`` first), or gets paused meanwhile; the
                unfinished requests stay queued.

        """
        for r in requests:
            self.validate(r)
        if self._paused:
            raise RuntimeError("the engine is paused: resume() before generate()")
        results: dict[int, GenerateOutput] = {}
        errors: list[BaseException] = []
        for i, r in enumerate(requests):
            self.submit(r, lambda out, i=i: results.__setitem__(i, out), errors.append)
        while len(results) + len(errors) < len(requests):
            if self._paused:
                raise RuntimeError(f"the engine was paused with {len(requests) - len(results)} requests unfinished")
            self.step()
        if errors:
            raise errors[0]
        return [results[i] for i in range(len(requests))]

    # --- scheduling ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Apply aborts, admit and prefill waiting requests, decode one token for every running sequence.

        A failure inside the step fails the requests it touched (``on_error``) and frees their slots; the
        engine stays usable.
        """
        with self._lock:
            self._apply_aborts()
            if self._paused:
                return
            admitted = self._admit()
            running = len(self._running)
            try:
                if admitted:
                    self._prefill(admitted)
            except Exception as exc:  # a prompt that cannot prefill fails alone; running rows keep their slots
                del self._running[running:]
                _fail(admitted, exc)
            try:
                if self._running:
                    self._decode()
            except Exception as exc:  # never take the engine down: fail the affected requests
                self._fail_running(exc)

    def fail_all(self, exc: BaseException) -> None:
        """Fail every running and waiting request with ``exc`` and free their slots (the engine stays usable).

        For a failure no single request can be blamed for; ``EngineLoop`` calls it when a step raises.
        """
        with self._lock:  # no pause or weight load steps meanwhile
            with self._mu:
                waiting, self._waiting = list(self._waiting), collections.deque()
            self._fail_running(exc)
        _fail(waiting, exc)

    def _fail_running(self, exc: BaseException) -> None:
        running = {id(r.req): r.req for r in self._running}  # a request's samples share one callback
        self._running = []
        _fail(list(running.values()), exc)

    def _apply_aborts(self) -> None:
        with self._mu:
            abort_all, ids = self._abort_all, self._abort_ids
            self._abort_all, self._abort_ids = False, set()
            if not (abort_all or ids):
                return
            hit = [r for r in self._waiting if abort_all or r.request.request_id in ids]
            for r in hit:
                self._waiting.remove(r)
        for req in hit:  # never started: every sample is empty
            req.completions = [Completion([], [], "abort", "") for _ in req.completions]
            req.first_version = self._version
            self._deliver(req)
        finished = [i for i, row in enumerate(self._running) if abort_all or row.req.request.request_id in ids]
        self._retire({s: ("abort", None) for s in finished})

    def _admit(self) -> list[_Request]:
        admitted: list[_Request] = []
        free = self.num_slots - len(self._running)  # KV slots
        budget = self.config.max_prefill_tokens  # prompt tokens this step may prefill
        if self._holding:
            return admitted
        with self._mu:
            while self._waiting:
                req = self._waiting[0]
                n, plen = req.request.params.n, len(req.request.prompt_ids)
                cost = plen if self.config.prefix_sharing else n * plen
                if n > free or (admitted and cost > budget):  # FIFO: a big request is not overtaken
                    break
                admitted.append(self._waiting.popleft())
                free, budget = free - n, budget - cost
        return admitted

    def _prefill(self, admitted: list[_Request]) -> None:
        """Prefill the admitted prompts into the slots after the running rows and sample their first tokens."""
        first = len(self._running)
        rows = [self._new_row(req, j) for req in admitted for j in range(req.request.params.n)]
        for req in admitted:
            req.first_version = self._version
        if self.config.prefix_sharing:  # prompt i prefilled once into slot first+i (its sample 0)
            heads = [r for r in rows if r.index == 0]
            rows = heads + [r for r in rows if r.index > 0]
            prefilled = heads
        else:
            prefilled = rows
        prompts = [r.req.request.prompt_ids for r in prefilled]
        ids = torch.full((len(prompts), max(len(p) for p in prompts)), self.pad_token_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        lengths = torch.tensor([len(p) for p in prompts])
        logits = self.model.prefill(ids.to(self.device), lengths.to(self.device), self._cache, first)
        if self.config.prefix_sharing:  # samples 1..n-1 copy their prompt's KV into their own slots
            head_of = {id(r.req): i for i, r in enumerate(prefilled)}
            source = [head_of[id(r.req)] for r in rows]
            for k, r in enumerate(rows[len(prefilled) :]):
                self._cache.copy_slot(first + head_of[id(r.req)], first + len(prefilled) + k, r.length)
        else:
            source = list(range(len(rows)))
        if self.model.last_routes is not None:  # a prompt's routes are shared by its samples, like its KV
            routes = self.model.last_routes.cpu()  # one copy per step, not one per row
            for r, i in zip(rows, source):
                r.routes.append(routes[i, : len(prompts[i])])
        self._running.extend(rows)
        self._advance(logits[torch.tensor(source, device=logits.device)], first)

    def _new_row(self, req: _Request, j: int) -> _Row:
        p = req.request.params
        gen = torch.Generator()
        seed = p.seed * 1000003 + j if p.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
        gen.manual_seed(seed % 2**64)  # derived seeds (sample j, a resumed request) may leave manual_seed's range
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else {self.eos_token_id})
        prompt, resumed = req.request.prompt_ids, min(req.request.resumed, stop_tail_length(p.stop))
        return _Row(req, j, gen, stop_ids, length=len(prompt), earlier=list(prompt[len(prompt) - resumed :]))

    def _decode(self) -> None:
        tokens = torch.tensor([r.tokens[-1] for r in self._running]).to(self.device)
        positions = torch.tensor([r.length for r in self._running]).to(self.device)
        logits = self.model.decode(tokens, positions, self._cache)
        routes = None if self.model.last_routes is None else self.model.last_routes.cpu()
        for b, r in enumerate(self._running):
            r.length += 1
            if routes is not None:
                r.routes.append(routes[b])
        self._advance(logits, 0)

    def _advance(self, logits: torch.Tensor, first: int) -> None:
        """Sample the next token of rows ``first..`` from ``logits`` ``[R, V]``; retire finished rows."""
        rows = self._running[first:]
        params = [r.req.request.params for r in rows]
        tokens, lps = sample_tokens(logits, params, [r.gen for r in rows], self.dtype == torch.float32)
        reasons = {}
        for b, (r, tok, lp) in enumerate(zip(rows, tokens.tolist(), lps.tolist())):
            r.tokens.append(tok)
            r.logprobs.append(lp)
            if r.req.on_token is not None:
                self._stream_token(r, tok, lp)
            p = r.req.request.params
            if r.earlier and len(r.tokens) >= stop_tail_length(p.stop):
                r.earlier = []  # the stop strings' window holds new tokens only from here: no concatenation per token
            if tok in r.stop_ids:
                reasons[first + b] = ("stop", None if tok == self.eos_token_id and not p.ignore_eos else tok)
            elif hit := stop_string_hit(self.tokenizer, r.earlier + r.tokens if r.earlier else r.tokens, p.stop):
                reasons[first + b] = ("stop", hit)
            elif len(r.tokens) >= p.max_new_tokens:
                reasons[first + b] = ("length", None)
        self._retire(reasons)

    def _stream_token(self, row: _Row, token: int, logprob: float) -> None:
        try:
            row.req.on_token(row.index, token, logprob)
        except Exception:  # its reader is gone (a closed event loop): stop generating for it, keep the others
            log.exception("streaming a token failed; aborting request %s", row.req.request.request_id)
            row.req.on_token = None
            self.abort(row.req.request.request_id)

    def _retire(self, reasons: dict[int, tuple[str, str | int | None]]) -> None:
        """Finish the row in each slot of ``reasons`` (slot -> finish reason, stop reason), descending.

        The last running row moves into each freed slot, so running rows stay in slots ``0..B-1``.
        """
        for s in sorted(reasons, reverse=True):
            row = self._running[s]
            reason, stop = reasons[s]
            text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
            text = cut_at_stop(text, stop)
            routes = torch.cat(row.routes) if row.routes else None
            row.req.completions[row.index] = Completion(row.tokens, row.logprobs, reason, text, routes, stop)
            last = len(self._running) - 1
            if s != last:
                self._cache.copy_slot(last, s, self._running[last].length)
                self._running[s] = self._running[last]
            self._running.pop()
            if all(c is not None for c in row.req.completions):
                self._deliver(row.req)

    def _deliver(self, req: _Request) -> None:
        req.on_done(GenerateOutput(req.request.request_id, list(req.completions), self._version, -1, req.first_version))


def _fail(requests: Collection[_Request], exc: BaseException) -> None:
    for req in requests:
        req.on_error(exc)
