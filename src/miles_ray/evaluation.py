"""Evaluation on a held-out data source between training steps: mean@n, unbiased pass@k, greedy accuracy.

``Evaluator.evaluate(router, step)`` sends every prompt of a held-out ``DatasetSource`` (in file order, or the
first ``max_prompts``) through the Router: ``n`` sampled responses at ``temperature`` and, with ``greedy``, one
at temperature 0; it scores them with the source's reward (run safely: a failed reward scores 0 and is
counted) and returns flat metrics ready for a tracker, overall and per value of the ``group_by`` column (a
``data_source`` name, as verl reports). pass@k is the unbiased estimator of Chen et al. (2021),
``1 - C(n-c, k) / C(n, k)`` averaged over prompts, with ``c`` the responses whose reward reaches ``correct_at``.
``BestMetric`` keeps the step with the best value of one of them (for the best checkpoint).

Usage::

    evaluator = Evaluator(EvaluatorConfig(n=4, k=[1, 4]), DatasetSource(DatasetSourceConfig(path="test.jsonl"), tok))
    metrics = evaluator.evaluate(stack.router)   # {"eval/mean@4", "eval/pass@1", "eval/pass@4", "eval/greedy", ...}
"""

from __future__ import annotations

import math
import uuid
from collections import defaultdict

import ray
from pydantic import Field, model_validator

from miles_ray.config import StrictConfig
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.rewards.safe import SafeReward


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct out of ``n`` samples: ``1 - C(n-c, k) / C(n, k)``.

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.

    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


class EvaluatorConfig(StrictConfig):
    """How a held-out set is sampled and scored."""

    n: int = Field(4, ge=1, le=1024, description="Sampled responses per prompt (mean@n, pass@k).")
    k: list[int] = Field(default_factory=lambda: [1], description="pass@k for each k (each <= n).")
    temperature: float = Field(1.0, gt=0, description="Temperature of the n sampled responses.")
    greedy: bool = Field(True, description="Also one greedy (temperature 0) response per prompt: eval/greedy.")
    max_new_tokens: int = Field(256, ge=1, description="Response length limit.")
    max_prompts: int | None = Field(None, ge=1, description="Evaluate the first this many prompts; None: all.")
    correct_at: float = Field(1.0, description="A response counts as correct for pass@k if its reward >= this.")
    group_by: str | None = Field("data_source", description="Entry key for per-group metrics; None: overall only.")
    reward_timeout_s: float = Field(30.0, gt=0, description="Per-response reward timeout.")

    @model_validator(mode="after")
    def _k_within_n(self):
        bad = [k for k in self.k if not 1 <= k <= self.n]
        if bad:
            raise ValueError(f"k values {bad} must be between 1 and n={self.n}")
        return self


class Evaluator:
    """Scores the policy behind a Router on every prompt of a held-out data source."""

    def __init__(self, config: EvaluatorConfig, source):
        """``source``: a ``DatasetSource`` (its ``prompts()`` are the held-out set, its ``reward`` the score)."""
        if not hasattr(source, "prompts"):
            raise ValueError(f"the eval source must list its prompts (a DatasetSource), got {type(source).__name__}")
        self.config = config
        self.prompts = source.prompts()[: config.max_prompts]
        self.reward = SafeReward(source.reward, timeout_s=config.reward_timeout_s)

    def evaluate(self, router) -> dict[str, float]:
        """Sample, score and summarise; ``eval/...`` metrics (see the module docstring)."""
        c = self.config
        round_id = uuid.uuid4().hex[:8]  # request ids apart from training's p<uid>, other rounds and other drivers
        sampled = SamplingParams(n=c.n, temperature=c.temperature, max_new_tokens=c.max_new_tokens)
        greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=c.max_new_tokens)
        requests = [
            GenerateRequest(p["prompt_ids"], sampled, f"eval{round_id}-{i}") for i, p in enumerate(self.prompts)
        ]
        if c.greedy:
            requests += [
                GenerateRequest(p["prompt_ids"], greedy, f"eval{round_id}-g{i}") for i, p in enumerate(self.prompts)
            ]
        outs = ray.get([router.generate.remote(r) for r in requests])
        groups: dict[str, list[dict]] = defaultdict(list)
        failures = 0
        for i, prompt in enumerate(self.prompts):
            scored = [self.reward(x.text, prompt["entry"]) for x in outs[i].completions]
            best = (
                [self.reward(x.text, prompt["entry"]) for x in outs[len(self.prompts) + i].completions]
                if c.greedy
                else []
            )
            failures += sum(f is not None for _, f in scored + best)
            row = {"rewards": [v for v, _ in scored], "greedy": [v for v, _ in best]}
            groups[""].append(row)
            if c.group_by is not None and c.group_by in prompt["entry"]:
                groups[f"{prompt['entry'][c.group_by]}/"].append(row)
        metrics = {"eval/num_prompts": float(len(self.prompts)), "eval/reward_failures": float(failures)}
        for name, rows in groups.items():
            metrics |= self._summarise(rows, f"eval/{name}")
        return metrics

    def _summarise(self, rows: list[dict], prefix: str) -> dict[str, float]:
        c = self.config
        out = {f"{prefix}mean@{c.n}": sum(sum(r["rewards"]) / c.n for r in rows) / len(rows)}
        for k in c.k:
            passes = [pass_at_k(c.n, sum(v >= c.correct_at for v in r["rewards"]), k) for r in rows]
            out[f"{prefix}pass@{k}"] = sum(passes) / len(rows)
        if c.greedy:
            out[f"{prefix}greedy"] = sum(r["greedy"][0] for r in rows) / len(rows)
        return out


class BestMetric:
    """The best value of one metric seen so far, and its step (``mode``: ``max`` or ``min``)."""

    def __init__(self, metric: str, mode: str = "max"):
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        self.metric, self.mode = metric, mode
        self.value: float | None = None
        self.step: int | None = None

    def update(self, metrics: dict[str, float], step: int) -> bool:
        """Take one evaluation's metrics; True if ``metric`` is a new best (the first one always is).

        Raises:
            KeyError: naming the metric and the ones there are, if it is missing.

        """
        if self.metric not in metrics:
            raise KeyError(f"best metric {self.metric!r} is not among the eval metrics {sorted(metrics)}")
        value = metrics[self.metric]
        better = self.value is None or (value > self.value if self.mode == "max" else value < self.value)
        if better:
            self.value, self.step = value, step
        return better
