import pytest

from rlflow.rewards.gsm8k import compute_score, extract_solution


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so she has 72 left.\n#### 72", "72"),
        ("#### 1,234", "1234"),  # commas stripped
        ("#### -5", "-5"),  # negative numbers
        ("#### -1,000,000", "-1000000"),
        ("first #### 3 then #### 4", "4"),  # the last match wins
        ("#### 5.", "5."),  # a trailing period is part of the match
        ("#### $5", None),  # '$' is not in the number class, so strict finds nothing
        ("####72", None),  # the space after #### is required
        ("The answer is 72", None),
    ],
)
def test_strict_extraction(text, expected):
    assert extract_solution(text, method="strict") == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x is -3 and y is 4", "4"),
        ("The answer is 1,234.", "1,234."),  # flexible keeps commas and the trailing period
        ("costs $18.", "18."),
        ("#### -1,000,000", "-1,000,000"),
        ("Hello, world", ","),  # a lone comma is a "number" for verl's flexible rule
        ("3 apples . .", "3"),  # lone "." matches are skipped
        (". . .", None),
        ("no digits here", None),
    ],
)
def test_flexible_extraction(text, expected):
    assert extract_solution(text, method="flexible") == expected


def test_only_last_300_characters_are_read():
    inside = "#### 42" + "x" * 293  # exactly 300 characters: the answer is in the window
    outside = "#### 42" + "x" * 294  # one more: the '#' falls out of the window
    assert len(inside) == 300
    assert extract_solution(inside) == "42"
    assert extract_solution(outside) is None
    assert compute_score(outside, "42") == 0
    # the window cuts through an answer: only its tail is seen
    assert extract_solution("#### 12345" + "y" * 295) is None
    assert extract_solution("A" * 1000 + "#### 7") == "7"


def test_compute_score_values():
    assert compute_score("#### 1,234", "1234") == 1.0
    assert compute_score("#### 1234", "1,234") == 0.0  # the ground truth is compared as given
    assert compute_score("#### 5", "6") == 0.0
    assert compute_score("#### 5", "6", format_score=0.1) == 0.1
    assert compute_score("no answer", "6", format_score=0.1) == 0  # no match -> 0, not format_score
    assert compute_score("#### 6", "6", score=2.0) == 2.0
    assert compute_score("it is 1,234.", "1,234.", method="flexible") == 1.0
    assert compute_score("it is 1,234.", "1234", method="flexible") == 0.0


def test_unknown_method_raises():
    with pytest.raises(ValueError, match="method"):
        extract_solution("#### 1", method="loose")
