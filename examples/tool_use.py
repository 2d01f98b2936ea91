"""GRPO with a calculator tool through standard function calling on each engine's OpenAI chat API, token-exact.

Each request carries ``tools=[calculator]``; the policy calls it in the Hermes format its chat template shows
(``<tool_call>{"name": "calculator", "arguments": {...}}</tool_call>``, SmolLM2 gets the bundled ``chatml_tools``
template), the engine returns the call as ``tool_calls``, the rollout runs it and sends the result back as a
``tool`` message, and the policy answers. The final answer is scored by reasoning-gym. Each conversation becomes
one training sample whose loss mask covers exactly the tokens the policy sampled (template and tool tokens are
masked out; ``miles_ray.multiturn.merge_turns``). ``--stream`` runs every chat call as server-sent events.

    python examples/tool_use.py --steps 10
"""

import argparse
import ast
import asyncio
import json
import operator
import time
from pathlib import Path

import ray
from common import RunLog, add_logger_argument, init_ray, step_record
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from miles_ray import placement
from miles_ray.engines.tool_calls import chat_template
from miles_ray.models.hub import MODELS, model_dir
from miles_ray.multiturn import ChatTurnRunner, Tool, tool_groups
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
p.add_argument("--stream", action="store_true", help="stream every chat call (server-sent events)")
p.add_argument("--out", default="runs/tool_use")
add_logger_argument(p)
args = p.parse_args()

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval(node):  # arithmetic only: numbers, + - * /, parentheses, unary minus
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError("only numbers and + - * / are allowed")


def calculator(expression: str) -> str:
    """The tool: the value of an arithmetic expression (numbers, + - * /, parentheses)."""
    value = _eval(ast.parse(expression.strip(), mode="eval").body)
    return str(int(value) if float(value).is_integer() else round(value, 6))


CALCULATOR = Tool(
    "calculator",
    calculator,
    "Evaluate an arithmetic expression",
    {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
)


def worked_example(a: int, op: str, b: int, result: int) -> list[dict]:
    """One calculator exchange in the function-calling form the chat template renders."""
    arguments = json.dumps({"expression": f"{a}{op}{b}"})
    call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    return [
        {"role": "user", "content": f"Calculate {a} {op} {b}."},  # phrased as the dataset asks
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": str(result)},
        {"role": "assistant", "content": str(result)},
    ]


class FewShotTask(ReasoningGymTask):
    """Shows the policy three calculator exchanges before each question.

    A 135M model needs them: SmolLM2 called the tool in 9% of 64 answers after two exchanges, 31% after three.
    """

    EXAMPLES = worked_example(12, "*", 34, 408) + worked_example(305, "+", 17, 322) + worked_example(71, "*", 9, 639)

    def messages(self, entry: dict) -> list[dict]:
        """The system prompt, the worked examples, then the question."""
        system, *rest = super().messages(entry)
        return [system, *self.EXAMPLES, *rest]


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
                # SmolLM2's own chat template ignores tools: the bundled ChatML one renders them (Hermes format)
                "http": {"chat_template": "chatml_tools", "tool_call_parser": "hermes"},
                "served_model_name": "policy",
            },
            buffer={"max_staleness": 0},
        ),
        placement.create(placement.colocated(n)),
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = chat_template("chatml_tools")  # the template the engines serve with
    sizes = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 3, "operators": ["+", "*"]}
    task = FewShotTask(
        ReasoningGymTaskConfig(
            dataset="basic_arithmetic",
            dataset_kwargs={**sizes, "allow_negation": False, "allow_parentheses": False},
            system_prompt="Use the calculator for every question, then reply with only the final number.",
        ),
        tokenizer,
    )
    key = ray.get(stack.pool.api_key.remote())  # the engines' bearer token (random unless http.api_key is given)
    runners = [
        ChatTurnRunner(
            AsyncOpenAI(base_url=f"{url}/v1", api_key=key),
            "policy",
            [CALCULATOR],
            max_turns=args.max_turns,
            stream=args.stream,
            max_tokens=48,
            stop=["</tool_call>"],  # a call ends the turn: the rollout answers it
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
            # > 1 when a call came back re-tokenised differently and merge_turns split its conversation
            samples_per_conversation=len(samples) / (args.prompts_per_step * args.group_size),
            policy_tokens_mean=sum(sum(s.loss_mask) for s in samples) / len(samples),
            masked_tokens_mean=sum(len(s.loss_mask) - sum(s.loss_mask) for s in samples) / len(samples),
            step_s=time.perf_counter() - t0,
        )
        log.write(record)
        print(json.dumps(record))
    log.close()


if __name__ == "__main__":
    asyncio.run(main())
