r"""Verifiable rewards for a user's data: math equivalence, exact match, multiple choice; ``(text, entry) -> float``.

Each reads the reference from ``entry["answer"]`` (``DatasetSource`` puts the configured answer column there)
and returns 1.0 or 0.0. Pass them by import path, e.g. ``DatasetSourceConfig(reward=
"miles_ray.rewards.verifiers:exact_match")``.

- ``math_reward``: HF ``math-verify`` (the verifier of open-r1 and TRL's accuracy reward): the response's
  ``\boxed{}`` answer, else its last expression, compared symbolically with the reference (``\frac{1}{2}``,
  ``0.5`` and ``1/2`` agree; ``1,000`` is 1000; sets, intervals and LaTeX expressions compare as math).
- ``exact_match``: the committed answer (``<answer>`` tag, ``\boxed{}``, an ``Answer:`` line, else the whole
  response) equals the reference, or one of a list of references, after case and whitespace folding.
- ``multiple_choice``: the chosen letter equals the reference, given as a letter, a 0-based index, or the
  text of one of ``entry["choices"]``.

A reference the verifier cannot read (an empty one, an unknown choice) raises: that is bad data, and
``SafeReward`` records it as a failure instead of training on it.
"""

from __future__ import annotations

import re
import string
import threading
from typing import Any

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_ANSWER_LINE = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*(.+)", re.I)


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unbalanced: the response was cut off inside the box


def committed_answer(text: str) -> str:
    r"""What a response commits to: the last ``<answer>`` tag, else ``\boxed{}``, else an answer line, else all."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1]
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(text)
    return lines[-1] if lines else text


def _normalize(text: str) -> str:
    text = " ".join(str(text).split()).casefold()
    return text.strip().strip("$").strip().rstrip(".").strip().strip("\"'").strip()


def _reference(entry: dict[str, Any]) -> Any:
    if "answer" not in entry or entry["answer"] is None or str(entry["answer"]).strip() == "":
        raise ValueError(f"entry has no reference answer (entry['answer']); its keys are {sorted(entry)}")
    return entry["answer"]


def math_reward(response_text: str, entry: dict[str, Any]) -> float:
    """1.0 if the response's answer equals ``entry["answer"]`` as math (``math-verify``), else 0.0.

    Raises:
        ValueError: if the reference itself cannot be parsed as math.

    """
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which works only on the main thread; elsewhere (SafeReward's
    # worker threads, which time the call out themselves) they must be off
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    reference = str(_reference(entry))
    # a bare reference ("\sqrt{2}/2", "(1,2)") is read as LaTeX math only between dollars
    wrapped = reference if "$" in reference or "\\boxed" in reference else f"${reference}$"
    gold = parse(wrapped, parsing_timeout=limit) or parse(reference, parsing_timeout=limit)
    if all(isinstance(g, str) for g in gold):  # only math-verify's fallback, the reference's own text
        raise ValueError(f"math_reward cannot read the reference answer {reference!r} as math")
    answer = parse(response_text, parsing_timeout=limit)
    return float(bool(answer) and verify(gold, answer, timeout_seconds=limit))


def exact_match(response_text: str, entry: dict[str, Any]) -> float:
    """1.0 if the committed answer equals ``entry["answer"]`` (or one of a list of them) after folding, else 0.0."""
    reference = _reference(entry)
    accepted = reference if isinstance(reference, list) else [reference]
    return float(_normalize(committed_answer(response_text)) in {_normalize(a) for a in accepted})


def multiple_choice(response_text: str, entry: dict[str, Any]) -> float:
    """1.0 if the chosen letter is the reference's, else 0.0.

    ``entry["answer"]`` is a letter (``"B"``), a 0-based index, or the text of one of ``entry["choices"]``;
    letters run over ``entry["choices"]`` when given, else A-J.

    Raises:
        ValueError: for a reference that names no choice.

    """
    choices = entry.get("choices")
    letters = string.ascii_uppercase[: len(choices)] if choices else "ABCDEFGHIJ"
    gold = _gold_letter(_reference(entry), choices, letters)
    chosen = chosen_letter(response_text, letters)
    return float(chosen == gold)


def _gold_letter(reference: Any, choices: list | None, letters: str) -> str:
    if isinstance(reference, int) and not isinstance(reference, bool) and 0 <= reference < len(letters):
        return letters[reference]
    text = str(reference).strip()
    if len(text) == 1 and text.upper() in letters:
        return text.upper()
    if choices:
        folded = [_normalize(c) for c in choices]
        if _normalize(text) in folded:
            return letters[folded.index(_normalize(text))]
    raise ValueError(f"multiple_choice: reference {reference!r} is none of the letters {letters} or the choices")


def chosen_letter(text: str, letters: str) -> str | None:
    """The letter a response picks: from its committed answer, else the last standalone ``(X)`` or ``X``."""
    committed = committed_answer(text)
    pattern = re.compile(rf"(?<![A-Za-z])\(?([{letters}])\)?(?![A-Za-z])")
    for place in (committed, text) if committed is not text else (text,):
        found = pattern.findall(place)
        if found:
            return found[-1] if place is text else found[0]
    return None
