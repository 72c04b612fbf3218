"""The built-in task's answers and scorers, against hand-computed values."""

import pytest

from rlflow.tasks.addition import answer, digit_match, exact_match


def test_answers_are_reversed_sums():
    assert answer(37, 45) == "28"  # 82 reversed
    assert answer(0, 0) == "0" and answer(50, 50) == "001"


@pytest.mark.parametrize("response, truth, expected", [
    ("28", "28", 1.0), (" 28 ", "28", 1.0), ("29", "28", 0.5), ("2", "28", 0.5), ("82", "28", 0.0),
    ("281", "28", 2 / 3), ("", "28", 0.0), ("001", "001", 1.0), ("01", "001", 1 / 3),
])
def test_digit_match_gives_partial_credit(response, truth, expected):
    assert digit_match(response, truth) == pytest.approx(expected)
    assert (digit_match(response, truth) == 1.0) == (exact_match(response, truth) == 1.0)
