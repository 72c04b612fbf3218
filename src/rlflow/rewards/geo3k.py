"""Geometry3K rule reward (``hiyouga/geometry3k``, the data of verl's vision GRPO examples): verl's ``geo3k``.

``score = 0.9 * accuracy + 0.1 * format``: *format* is 1 when the whole response is
``<think>...</think>...\\boxed{...}...``; *accuracy* is 1 when the last ``\\boxed{}`` answer grades equal to
the ground truth under ``mathruler``'s grader (the PRM800K rules: the same string after the MATH
normalisation, or, after its own normalisation and LaTeX-to-text, a difference sympy simplifies to 0; an
unreduced fraction is not equal to the reduced one, an integer answer must match exactly).

The grading is ``mathruler``'s own code, as in verl, so scores are verl's. It is an optional dependency
(``pip install "rlflow[math]"``: mathruler and pylatexenc, which mathruler imports but does not declare).
"""

from __future__ import annotations

import re

INSTALL = 'pip install "rlflow[math]"  (mathruler and pylatexenc)'
FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def grader():
    """``mathruler.grader``; an ImportError naming the install command when it (or pylatexenc) is missing."""
    try:
        from mathruler import grader
    except ImportError as e:
        raise ImportError(f"data_source hiyouga/geometry3k is scored with mathruler's grader, as in verl, which "
                          f"is not installed ({e}): {INSTALL}") from None
    return grader


def format_reward(response: str) -> float:
    """1.0 when the response is ``<think>...</think>`` followed by a ``\\boxed{...}`` answer, else 0.0."""
    return 1.0 if FORMAT.fullmatch(response) else 0.0


def acc_reward(response: str, ground_truth: str, use_boxed: bool = True) -> float:
    """1.0 when the (last boxed) answer grades equal to ``ground_truth``."""
    g = grader()
    answer = g.extract_boxed_content(response) if use_boxed else response
    return 1.0 if g.grade_answer(answer, ground_truth) else 0.0


def compute_score(solution_str: str, ground_truth: str, use_boxed: bool = True, format_score: float = 0.1) -> float:
    """verl's ``geo3k.compute_score``: ``(1 - format_score) * accuracy + format_score * format``."""
    return ((1.0 - format_score) * acc_reward(solution_str, str(ground_truth), use_boxed)
            + format_score * format_reward(solution_str))


def available() -> bool:
    """Whether the grader imports (``rlflow[math]`` installed)."""
    try:
        grader()
    except ImportError:
        return False
    return True
