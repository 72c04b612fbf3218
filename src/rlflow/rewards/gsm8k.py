"""GSM8K rule reward, with verl's extraction rules (``verl/utils/reward_score/gsm8k.py``).

Reference: Trung et al., "ReFT: Reasoning with Reinforced Fine-Tuning", ACL 2024.
"""

from __future__ import annotations

import re

CLIP_CHARS = 300  # only the tail is searched: the answer comes last, and regexes on long text are slow
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer in the last 300 characters of ``solution_str``, or ``None``.

    - ``"strict"``: the LAST match of ``#### (-?[0-9.,]+)``, with ``,`` and ``$`` removed
      (``"#### 1,234"`` -> ``"1234"``; ``"#### $5"`` does not match, ``$`` is not in the class).
    - ``"flexible"``: the last match of ``(-?[0-9.,]+)`` that is not ``""`` or ``"."``, as is
      (commas kept: ``"1,234"`` stays ``"1,234"``; a lone ``","`` counts, as in verl).
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT.findall(tail)
        return matches[-1].replace(",", "").replace("$", "") if matches else None
    for candidate in reversed(_FLEXIBLE.findall(tail)):
        if candidate not in ("", "."):
            return candidate
    return None


def compute_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """``0`` if no answer is found; ``score`` if it string-equals ``ground_truth``; else ``format_score``."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score
