"""verl's Geometry3K reward (hiyouga/geometry3k): 0.9 x accuracy (mathruler's grader) + 0.1 x format
(<think>...</think> then \\boxed{}), on hand-written responses with the scores worked out from the rules."""

import sys

import pytest

from rlflow.config.verl.loading import ConfigError
from rlflow.config.verl.reward_fn import check_data_sources
from rlflow.rewards import default_compute_score, geo3k
from rlflow.rewards.dispatch import supports

CASES = [
    ("<think>The angles sum to 180.</think> So x is \\boxed{30}.", "30", 1.0),  # format and answer
    ("x is \\boxed{30}", "30", 0.9),  # no thinking block: accuracy only
    ("<think>guess</think> \\boxed{31}", "30", 0.1),  # format only
    ("<think>guess</think> the answer is 30", "30", 0.0),  # no box: neither
    ("<think>a</think> \\boxed{2\\sqrt{3}}", "2\\sqrt{3}", 1.0),  # the same LaTeX
    ("<think>a</think> \\boxed{4 \\sqrt{3}}", "4\\sqrt{3}", 1.0),  # spaces do not count
    ("<think>a</think> \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # equal under sympy
    ("<think>a</think> \\boxed{\\sqrt{12}}", "2\\sqrt{3}", 1.0),  # simplifies to the ground truth
    ("<think>a</think> \\boxed{2/4}", "1/2", 0.1),  # an unreduced fraction is not the answer
    ("<think>a</think> \\boxed{30^\\circ}", "30", 1.0),  # degrees dropped
    ("<think>a</think> \\boxed{1} then \\boxed{30}", "30", 1.0),  # the last box is the answer
]


@pytest.mark.parametrize("response, ground_truth, score", CASES)
def test_geometry3k_scores(response, ground_truth, score):
    assert supports("hiyouga/geometry3k")
    assert default_compute_score("hiyouga/geometry3k", response, ground_truth) == pytest.approx(score)


def test_format_and_accuracy_parts_and_verls_arguments():
    assert geo3k.format_reward("<think>\nmulti\nline\n</think>\n\\boxed{5}\n") == 1.0  # spans lines
    assert geo3k.format_reward("\\boxed{5}<think>a</think>") == 0.0  # the order matters
    assert geo3k.acc_reward("5", "5", use_boxed=False) == 1.0
    assert geo3k.compute_score("<think>a</think> \\boxed{7}", "7", format_score=0.5) == 1.0
    assert geo3k.compute_score("\\boxed{7}", "7", format_score=0.5) == 0.5


def test_without_mathruler_the_entry_point_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mathruler", None)  # import mathruler now raises ImportError
    with pytest.raises(ConfigError, match=r'geometry3k is scored with mathruler.*pip install "rlflow\[math\]"'):
        check_data_sources({"hiyouga/geometry3k"}, "train.parquet")
    with pytest.raises(ImportError, match=r"rlflow\[math\]"):
        geo3k.compute_score("\\boxed{1}", "1")
    check_data_sources({"openai/gsm8k"}, "train.parquet")  # other sources do not need it
