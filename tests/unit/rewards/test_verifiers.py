import threading

import pytest

from miles_ray.rewards.safe import SafeReward
from miles_ray.rewards.verifiers import exact_match, last_boxed, math_reward, multiple_choice


@pytest.mark.parametrize(
    ("answer", "response", "expected"),
    [
        ("\\frac{1}{2}", "So the probability is \\boxed{0.5}.", 1.0),
        ("0.5", "$\\boxed{\\frac{2}{4}}$", 1.0),
        ("1/2", "Half of them: \\boxed{\\dfrac{1}{2}}", 1.0),
        ("\\sqrt{2}/2", "\\boxed{\\frac{\\sqrt2}{2}}", 1.0),
        ("x^2+1", "Expanding, \\boxed{1 + x^2}", 1.0),
        ("1,000", "The total is \\boxed{1000}", 1.0),
        ("72", "Natalia sold 48 + 24 = 72 clips.", 1.0),  # no box: the last expression
        (-3, "The answer is -3", 1.0),  # a numeric column
        ("\\{1,2\\}", "\\boxed{\\{2, 1\\}}", 1.0),
        ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0.0),
        ("72", "She has 72 apples, 3 left", 0.0),  # the last number is not the answer
        ("x^2+1", "\\boxed{x^2-1}", 0.0),
        ("72", "I do not know.", 0.0),
        ("72", "\\boxed{7", 0.0),  # cut off inside the box
    ],
)
def test_math_reward(answer, response, expected):
    assert math_reward(response, {"answer": answer}) == expected


def test_math_reward_in_a_worker_thread_as_safe_reward_runs_it():
    # math-verify's SIGALRM timeouts cannot run off the main thread: the verifier turns them off there
    results = []
    worker = threading.Thread(target=lambda: results.append(math_reward("\\boxed{3/4}", {"answer": "0.75"})))
    worker.start()
    worker.join()
    assert results == [1.0]
    assert SafeReward(math_reward)("\\boxed{4}", {"answer": "4"}) == (1.0, None)


def test_unreadable_references_are_errors_not_zero_rewards():
    with pytest.raises(ValueError, match="no reference answer"):
        math_reward("\\boxed{1}", {"question": "q"})
    with pytest.raises(ValueError, match="cannot read the reference answer"):
        math_reward("\\boxed{1}", {"answer": "}{"})
    value, failure = SafeReward(math_reward)("\\boxed{1}", {"answer": ""})
    assert value == 0.0 and failure.kind == "exception" and "no reference answer" in failure.message


@pytest.mark.parametrize(
    ("answer", "response", "expected"),
    [
        ("Paris", "<answer> paris </answer>", 1.0),
        ("Paris", "The capital is \\boxed{Paris}.", 1.0),
        ("New York", "Final answer: new  york.", 1.0),
        (["NYC", "New York"], "Answer: NYC", 1.0),
        ("Paris", "Paris", 1.0),
        ("Paris", "I think it is Paris, France.", 0.0),  # no committed answer: the whole text must match
        ("Paris", "<answer>Lyon</answer> or maybe Paris", 0.0),
    ],
)
def test_exact_match(answer, response, expected):
    assert exact_match(response, {"answer": answer}) == expected


CHOICES = ["red", "green", "blue", "yellow"]


@pytest.mark.parametrize(
    ("answer", "response", "expected"),
    [
        ("C", "The answer is (C).", 1.0),
        ("c", "\\boxed{C}", 1.0),
        (2, "<answer>C</answer>", 1.0),  # a 0-based index
        ("blue", "Answer: C) blue", 1.0),  # the choice's text
        ("C", "A is wrong and B is wrong, so C", 1.0),  # the last standalone letter
        ("C", "The answer is (B).", 0.0),
        ("C", "Answer: E", 0.0),  # only four choices: E is none of them
        ("C", "I cannot tell.", 0.0),
    ],
)
def test_multiple_choice(answer, response, expected):
    assert multiple_choice(response, {"answer": answer, "choices": CHOICES}) == expected


def test_multiple_choice_refuses_a_reference_that_names_no_choice():
    with pytest.raises(ValueError, match="reference 'purple' is none of the letters ABCD"):
        multiple_choice("A", {"answer": "purple", "choices": CHOICES})


def test_last_boxed_keeps_nested_braces():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("no box") is None
