import pytest

from rlflow.rewards import default_compute_score, math_dapo
from rlflow.rewards.math import compute_score, is_equiv, last_boxed_only_string, remove_boxed, strip_string


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{\\frac{1}{2}} done", "\\boxed{\\frac{1}{2}}"),  # nested braces
        ("\\boxed{1} then \\boxed{2}", "\\boxed{2}"),  # the last one
        ("\\fbox{3} and \\fbox{4}", "\\fbox{4}"),
        ("\\boxed{5} and \\fbox{6}", "\\boxed{5}"),  # \fbox only when there is no \boxed
        ("$\\boxed 7$ and more", "\\boxed 7"),  # "\boxed " form: up to the next '$'
        ("\\boxed{\\frac{1}{2}", None),  # unbalanced
        ("no box", None),
    ],
)
def test_last_boxed_only_string(text, expected):
    assert last_boxed_only_string(text) == expected


def test_remove_boxed():
    assert remove_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert remove_boxed("\\fbox{4}") == "4"
    assert remove_boxed("\\boxed 7") == "7"
    with pytest.raises(ValueError):
        remove_boxed("{4}")


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("0.5", "\\frac{1}{2}"),  # the one decimal special-cased
        (".5", "\\frac{1}{2}"),
        ("0.25", "0.25"),  # other decimals are left alone
        ("0.50", "0.50"),
        ("1/2", "\\frac{1}{2}"),
        ("\\dfrac12", "\\frac{1}{2}"),
        ("\\tfrac{1}{2}", "\\frac{1}{2}"),
        ("x = 5", "5"),
        ("abc=5", "abc=5"),  # left side longer than 2 characters: kept
        ("5 \\text{ cm}", "5"),
        ("\\sqrt3", "\\sqrt{3}"),
        ("10\\%", "10"),
        ("90^\\circ", "90"),
        ("\\left(1, 2\\right)", "(1,2)"),
        ("\\$5", "5"),
        ("$5", "$5"),  # a bare dollar sign stays
        ("{.5}", "{0.5}"),
        ("", ""),
    ],
)
def test_strip_string(raw, normalized):
    assert strip_string(raw) == normalized


def test_is_equiv():
    assert is_equiv("0.5", "\\frac{1}{2}")
    assert is_equiv("\\dfrac{1}{2}", "1/2")
    assert not is_equiv("0.25", "\\frac{1}{4}")
    assert not is_equiv("0.50", "\\frac{1}{2}")
    assert is_equiv(None, None)
    assert not is_equiv(None, "1")
    # malformed LaTeX makes strip_string raise; is_equiv falls back to raw equality
    with pytest.raises(IndexError):
        strip_string("\\frac")
    assert is_equiv("\\frac", "\\frac")
    assert not is_equiv("\\sqrt", "\\sqrt{}")


def test_compute_score():
    assert compute_score("The answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}") == 1.0
    assert compute_score("The answer is \\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert compute_score("\\boxed{3} no, \\boxed{4}", "4") == 1.0
    assert compute_score("\\boxed{3} no, \\boxed{4}", "3") == 0.0
    assert compute_score("\\fbox{4}", "4") == 1.0
    assert compute_score("the answer is 4", "4") == 0.0  # no box -> 0
    # no 300-character window for MATH: a box far from the end still counts
    assert compute_score("\\boxed{9}" + " filler" * 100, "9") == 1.0


def test_dapo_normalize_final_answer():
    n = math_dapo.normalize_final_answer
    assert n("\\boxed{5}") == "5"
    assert n("$\\frac12$") == "\\frac{1}{2}"
    assert n("10 dollars") == "10"
    assert n("x = 3") == "3"
    assert n("1,000") == "1000"
    assert n("90^\\circ") == "90"
    assert n("\\text{(B)}") == "(B)"
    assert n("0.5") == "0.5"  # decimals and fractions are not unified
    assert n("5.") == "5."


def test_dapo_compute_score():
    assert math_dapo.compute_score("work...\nAnswer: 42", "42") == {"score": 1.0, "acc": True, "pred": "42"}
    assert math_dapo.compute_score("ANSWER : 1,000\n", "1000") == {"score": 1.0, "acc": True, "pred": "1000"}
    assert math_dapo.compute_score("Answer: 3\nAnswer: 4", "3") == {"score": -1.0, "acc": False, "pred": "4"}
    far = "Answer: 42\n" + "z" * 300
    assert math_dapo.compute_score(far, "42") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert math_dapo.compute_score("Answer: 0.5", "\\frac{1}{2}")["acc"] is False


def test_default_compute_score_dispatch():
    assert default_compute_score("openai/gsm8k", "#### 1,234", "1234") == 1.0
    assert default_compute_score("openai/gsm8k", "no answer", "1234") == 0.0
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert default_compute_score(source, "\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    for source in ("math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime_2025"):
        assert default_compute_score(source, "Answer: 7", "7", {"index": 0}) == {"score": 1.0, "acc": True, "pred": "7"}
    with pytest.raises(NotImplementedError) as info:
        default_compute_score("my/dataset", "x", "y")
    message = str(info.value)
    assert "my/dataset" in message and "openai/gsm8k" in message and "FunctionReward" in message
