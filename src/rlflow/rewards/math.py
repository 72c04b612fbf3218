"""MATH rule reward: the last ``\\boxed{...}`` answer, Hendrycks-normalized, string-compared.

Same rules as verl's ``math_reward`` (from the Hendrycks MATH / lm-evaluation-harness code).
The whole response is read (no 300-character window, unlike GSM8K and DAPO).
"""

from __future__ import annotations


def last_boxed_only_string(string: str) -> str | None:
    """The last boxed expression, box command included, or ``None``.

    - If ``"\\boxed "`` (with a space) occurs anywhere, the text after its last occurrence up
      to the next ``$`` is returned as ``"\\boxed " + text`` (this takes precedence, as in verl).
    - Otherwise the last ``\\boxed`` (or, if there is none, the last ``\\fbox``) up to its
      matching ``}``, braces counted: ``"\\boxed{\\frac{1}{2}}"``. Unbalanced -> ``None``.
    """
    if "\\boxed " in string:
        return "\\boxed " + string.split("\\boxed ")[-1].split("$")[0]
    start = string.rfind("\\boxed")
    if start < 0:
        start = string.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(string)):
        if string[i] == "{":
            depth += 1
        elif string[i] == "}":
            depth -= 1
            if depth == 0:
                return string[start : i + 1]
    return None


def remove_boxed(s: str) -> str:
    """``"\\boxed{x}"`` / ``"\\fbox{x}"`` -> ``"x"``; ``"\\boxed x"`` -> ``"x"``. Else ``ValueError``."""
    if "\\boxed " in s:
        if not s.startswith("\\boxed "):
            raise ValueError(f"not a boxed expression: {s!r}")
        return s[len("\\boxed ") :]
    for left in ("\\boxed{", "\\fbox{"):
        if s.startswith(left) and s.endswith("}"):
            return s[len(left) : -1]
    raise ValueError(f"not a boxed expression: {s!r}")


def _fix_fracs(string: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``; braced fracs untouched."""
    head, *parts = string.split("\\frac")
    out = head
    for part in parts:
        out += "\\frac"
        if part[0] == "{":  # IndexError on a trailing "\\frac": is_equiv falls back to raw equality
            out += part
            continue
        if len(part) < 2:
            return string
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b + rest if b == "{" else "{" + b + "}" + rest)
    return out


def _fix_a_slash_b(string: str) -> str:
    """``"3/4"`` -> ``"\\frac{3}{4}"`` when both sides are plain integers."""
    parts = string.split("/")
    if len(parts) != 2:
        return string
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return string
    return f"\\frac{{{a}}}{{{b}}}" if string == f"{a}/{b}" else string


def _remove_right_units(string: str) -> str:
    """Drop everything from ``"\\text{ "`` on (units: ``"5\\text{ cm}"`` -> ``"5"``)."""
    if "\\text{ " not in string:
        return string
    parts = string.split("\\text{ ")
    if len(parts) != 2:
        raise ValueError(f"more than one unit in {string!r}")
    return parts[0]


def _fix_sqrt(string: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}`` (one character is taken as the argument)."""
    head, *parts = string.split("\\sqrt")
    return head + "".join("\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:]) for p in parts)


def strip_string(string: str) -> str:
    """Hendrycks normalization, in this order:

    remove newlines and ``\\!``; ``\\\\`` -> ``\\``; ``tfrac``/``dfrac`` -> ``frac``; remove
    ``\\left``, ``\\right``, ``^{\\circ}``, ``^\\circ``, ``\\$`` (a bare ``$`` stays); drop a unit
    after ``"\\text{ "``; remove ``\\%``; ``" ."`` -> ``" 0."`` and ``"{."`` -> ``"{0."``; a leading
    ``.`` gets a ``0``; ``"k = v"`` -> ``"v"`` when the left side has at most 2 characters;
    ``\\sqrt3`` -> ``\\sqrt{3}``; remove spaces; ``\\frac12`` -> ``\\frac{1}{2}``; exactly
    ``"0.5"`` -> ``"\\frac{1}{2}"`` (the only decimal converted: ``"0.25"`` stays); integer
    ``"a/b"`` -> ``"\\frac{a}{b}"``. May raise on malformed LaTeX (see :func:`is_equiv`).
    """
    string = string.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    string = string.replace("tfrac", "frac").replace("dfrac", "frac")
    for junk in ("\\left", "\\right", "^{\\circ}", "^\\circ", "\\$"):
        string = string.replace(junk, "")
    string = _remove_right_units(string)
    string = string.replace("\\%", "")
    string = string.replace(" .", " 0.").replace("{.", "{0.")
    if not string:
        return string
    if string[0] == ".":
        string = "0" + string
    sides = string.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        string = sides[1]
    string = _fix_sqrt(string).replace(" ", "")
    string = _fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _fix_a_slash_b(string)


def is_equiv(str1: str | None, str2: str | None) -> bool:
    """``strip_string(str1) == strip_string(str2)``; raw equality if normalization raises.

    Two ``None`` are equal; one ``None`` is not equal to anything.
    """
    if str1 is None or str2 is None:
        return str1 is None and str2 is None
    try:
        return strip_string(str1) == strip_string(str2)
    except Exception:  # noqa: BLE001 - malformed LaTeX from the model, as in verl
        return str1 == str2


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last boxed answer in ``solution_str`` is equivalent to ``ground_truth``, else 0.0."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    try:
        answer = remove_boxed(boxed)
    except ValueError:
        return 0.0
    return 1.0 if is_equiv(answer, ground_truth) else 0.0
