"""GRPO with a calculator tool: multi-turn rollouts through each engine's OpenAI chat API, token-exact.

The policy may write ``<calc>EXPRESSION</calc>``; generation stops there, the rollout evaluates the
expression and sends the result back as a ``tool`` message, and the policy continues. The final answer is
scored by reasoning-gym. Each conversation becomes one training sample whose loss mask covers exactly the
tokens the policy sampled (template and tool tokens are masked out; ``miles_ray.multiturn.merge_turns``).

    python examples/tool_use.py --steps 10
"""

import argparse
import ast
import asyncio
import json
import operator
import re
import time
from pathlib import Path

import ray
from common import RunLog, add_logger_argument, init_ray, step_record
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from miles_ray import placement
from miles_ray.models.hub import MODELS, model_dir
from miles_ray.multiturn import ChatTurnRunner, tool_groups
from miles_ray.rewards import ReasoningGymTask, ReasoningGymTaskConfig
from miles_ray.stack import StackConfig, build_stack

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
p.add_argument("--steps", type=int, default=10)
p.add_argument("--num-ranks", type=int, default=2, help="trainer ranks (and as many engines)")
p.add_argument("--prompts-per-step", type=int, default=4)
p.add_argument("--group-size", type=int, default=4)
p.add_argument("--max-turns", type=int, default=3)
p.add_argument("--lr", type=float, default=1e-5)
p.add_argument("--out", default="runs/tool_use")
add_logger_argument(p)
args = p.parse_args()

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)


def _eval(node):  # arithmetic only: numbers, + - * /, parentheses, unary minus
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError("only numbers and + - * / are allowed")


def calculator(text: str) -> str | None:
    """The tool: evaluate the last <calc>...</calc> of a response; None if the response calls no tool."""
    calls = _CALL.findall(text)
    if not calls:
        return None
    try:
        value = _eval(ast.parse(calls[-1].strip(), mode="eval").body)
        return str(int(value) if float(value).is_integer() else round(value, 6))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


class FewShotTask(ReasoningGymTask):
    """Shows the policy one calculator exchange before each question (a 135M model needs the example)."""

    EXAMPLE = [
        {"role": "user", "content": "What is 12 * 34?"},
        {"role": "assistant", "content": "<calc>12*34</calc>"},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "408"},
    ]

    def messages(self, entry: dict) -> list[dict]:
        """The system prompt, the worked example, then the question."""
        system, *rest = super().messages(entry)
        return [system, *self.EXAMPLE, *rest]


async def main() -> None:
    init_ray()
    path, n = str(model_dir(args.model)), args.num_ranks
    stack = build_stack(
        StackConfig(
            trainer={"model_path": path, "num_ranks": n, "optimizer": {"lr": args.lr}},
            # every engine serves the OpenAI API (127.0.0.1, a free port each) from its Ray actor
            pool={
                "num_engines": n,
                "engine": {"model_path": path, "max_seq_len": 768},
                "http": {},
                "served_model_name": "policy",
            },
            buffer={"max_staleness": 0},
        ),
        placement.create(placement.colocated(n)),
    )
    sizes = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 3, "operators": ["+", "*"]}
    task = FewShotTask(
        ReasoningGymTaskConfig(
            dataset="basic_arithmetic",
            dataset_kwargs={**sizes, "allow_negation": False, "allow_parentheses": False},
            system_prompt="You have a calculator: write <calc>12*34</calc> and you will get the result. "
            "Then reply with only the final number.",
        ),
        AutoTokenizer.from_pretrained(path),
    )
    runners = [
        ChatTurnRunner(
            AsyncOpenAI(base_url=f"{url}/v1", api_key="unused"),
            "policy",
            calculator,
            max_turns=args.max_turns,
            max_tokens=48,
            stop=["</calc>"],
        )
        for url in ray.get(stack.pool.urls.remote())
    ]
    log = RunLog(Path(args.out), logger=args.logger, config=vars(args))
    version = ray.get(stack.trainer.weight_version.remote())
    ray.get(stack.broadcaster.sync.remote(version))
    for step in range(args.steps):
        t0 = time.perf_counter()
        groups = await tool_groups(runners, task, args.group_size, args.prompts_per_step)
        ray.get(stack.buffer.add.remote(groups))
        batch = ray.get(stack.buffer.get_batch.remote(len(groups), current_version=version))
        samples = [s for g in ray.get([g.ref for g in batch]) for s in g]
        metrics = ray.get(stack.trainer.train_step.remote(batch))
        version = metrics["weight_version"]
        ray.get(stack.broadcaster.sync.remote(version))
        record = step_record(
            step,
            samples,
            metrics,
            tool_calls_mean=sum(s.metadata["tool_calls"] for s in samples) / len(samples),
            policy_tokens_mean=sum(sum(s.loss_mask) for s in samples) / len(samples),
            masked_tokens_mean=sum(len(s.loss_mask) - sum(s.loss_mask) for s in samples) / len(samples),
            step_s=time.perf_counter() - t0,
        )
        log.write(record)
        print(json.dumps(record))
    log.close()


if __name__ == "__main__":
    asyncio.run(main())
