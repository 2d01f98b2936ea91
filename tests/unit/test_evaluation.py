import itertools
import math

import pytest

from miles_ray.evaluation import BestMetric, EvaluatorConfig, pass_at_k


@pytest.mark.parametrize(("n", "c", "k"), [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (6, 3, 4), (3, 3, 3), (8, 7, 2)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_pass_at_1_is_the_share_correct_and_bad_counts_are_refused():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)


def test_k_above_n_is_refused_in_the_config():
    with pytest.raises(ValueError, match=r"k values \[8\] must be between 1 and n=4"):
        EvaluatorConfig(n=4, k=[1, 8])


def test_best_metric_keeps_the_best_step():
    best = BestMetric("eval/pass@1")
    assert [best.update({"eval/pass@1": v}, step) for step, v in enumerate([0.2, 0.5, 0.4, 0.5, 0.6])] == [
        True,
        True,
        False,
        False,
        True,
    ]
    assert (best.step, best.value) == (4, 0.6)
    lowest = BestMetric("loss", mode="min")
    assert lowest.update({"loss": 2.0}, 0) and lowest.update({"loss": 1.0}, 1) and not lowest.update({"loss": 3.0}, 2)
    with pytest.raises(KeyError, match="'eval/nope' is not among the eval metrics"):
        BestMetric("eval/nope").update({"x": 1.0}, 0)
