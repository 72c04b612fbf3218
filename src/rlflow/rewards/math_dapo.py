"""DAPO math reward: the last ``Answer: ...`` line, Minerva-normalized, string-compared.

Same rules as verl's ``math_dapo`` (default, non strict-box mode): read the last 300
characters, take the LAST match of ``(?i)Answer\\s*:\\s*([^\\n]+)`` (``"[INVALID]"`` if none),
normalize it and the ground truth with :func:`normalize_final_answer`, and compare strings.
"""

from __future__ import annotations

import re

CLIP_CHARS = 300  # the longest MATH-500 answer has 159 characters
ANSWER_PATTERN = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva's normalization (Lewkowycz et al. 2022, appendix D), applied in this order.
SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]  # fmt: skip
REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
]  # fmt: skip
_UNWRAP = [re.compile(r"\\text\{(.*?)\}"), re.compile(r"\\textbf\{(.*?)\}"), re.compile(r"\\overline\{(.*?)\}")]


def normalize_final_answer(final_answer: str) -> str:
    """Normalize a final answer (Minerva's rules, as verl), step by step:

    1. keep the text after the last ``=`` (``"x = 5"`` -> ``" 5"``);
    2. apply :data:`SUBSTITUTIONS` in order: drop the words ``"an "``/``"a "``, ``\\$``, all
       spaces; ``\\text{and}`` -> ``,``;
    3. delete each of :data:`REMOVED_EXPRESSIONS` (units such as ``dollars``, ``cm``,
       ``degrees``; ``\\ldots``; ``^\\circ``; thousands separators ``{,}`` and ``,\\!``; quotes);
    4. keep only the first ``$...$`` math span if there is one;
    5. unwrap ``\\text{x}``, ``\\textbf{x}``, ``\\overline{x}`` and ``\\boxed{x}`` to ``x``;
    6. expand shorthand: ``\\frac12`` -> ``\\frac{1}{2}``, ``\\sqrt2`` -> ``\\sqrt{2}``;
    7. delete ``$``; if the rest is digits once commas are removed, drop the commas
       (``"1,000"`` -> ``"1000"``); strip surrounding whitespace.

    Not normalized: decimals vs fractions (``"0.5"`` != ``"\\frac{1}{2}"``), trailing zeros,
    ``\\dfrac`` vs ``\\frac``, and the order of set elements.
    """
    final_answer = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expression in REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expression, "")
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    for pattern in _UNWRAP:
        final_answer = pattern.sub(r"\1", final_answer)
    final_answer = re.sub(r"\\boxed\{(.*)\}", r"\1", final_answer)
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def compute_score(solution_str: str, ground_truth: str) -> dict:
    """``{"score": 1.0 | -1.0, "acc": bool, "pred": normalized prediction}``."""
    matches = ANSWER_PATTERN.findall(solution_str[-CLIP_CHARS:])
    pred = normalize_final_answer(matches[-1] if matches else "[INVALID]")
    correct = pred == normalize_final_answer(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
