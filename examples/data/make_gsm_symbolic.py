"""Write ``train.jsonl`` and ``test.jsonl`` of grade-school math word problems from reasoning-gym's ``gsm_symbolic``.

The problems are generated (GSM8K templates with new numbers), offline, in the columns ``DatasetSource`` reads by
default: ``prompt``, ``answer`` (the number, for ``math_reward``), ``data_source`` and ``difficulty``. The test
split uses another seed; no question appears twice in either split or in both.

    python examples/data/make_gsm_symbolic.py --train 1000 --test 100
    python examples/quickstart.py --data examples/data/train.jsonl --max-new-tokens 256 --logger jsonl,tensorboard
"""

import argparse
import json
from pathlib import Path

import reasoning_gym


def rows(size: int, seed: int) -> list[dict]:
    return [
        {
            "prompt": e["question"],
            "answer": e["answer"],
            "data_source": "gsm_symbolic",
            "difficulty": e["metadata"]["difficulty"],
        }
        for e in reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
    ]


def distinct(generated: list[dict], seen: set[str]) -> list[dict]:
    """The rows whose question is new (templates with few variables repeat now and then)."""
    out = []
    for r in generated:
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            out.append(r)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--train", type=int, default=1000)
    p.add_argument("--test", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).parent))
    args = p.parse_args()
    train = distinct(rows(2 * args.train, args.seed), set())[: args.train]
    test = distinct(rows(2 * args.test, args.seed + 1), {r["prompt"] for r in train})[: args.test]
    for name, split in (("train", train), ("test", test)):
        path = Path(args.out) / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in split))
        print(f"{path}: {len(split)} problems")


if __name__ == "__main__":
    main()
