"""verl's ``default_compute_score``: pick a rule scorer by ``data_source``.

==========================================================================  ================
data_source                                                                 scorer
==========================================================================  ================
``openai/gsm8k``                                                            :mod:`.gsm8k`
``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,                 :mod:`.math`
``HuggingFaceH4/MATH-500``
``math_dapo``, ``math``, ``math_dapo_reasoning``, any ``aime*``             :mod:`.math_dapo`
``codecontests``, ``apps``, ``codeforces``, ``taco``                        :mod:`.code`
``hiyouga/geometry3k``                                                      :mod:`.geo3k` (``rlflow[math]``)
``rlflow/addition``, ``rlflow/shapes`` (the built-in tasks)                exact match
==========================================================================  ================

Code is run against the sample's test cases in rlflow's local sandbox (verl: ``prime_code``), or, given
``sandbox=SandboxFusion(url, ...)`` (verl's ``sandbox_fusion.url``), on that SandboxFusion server
(:mod:`rlflow.rewards.sandbox_fusion`); the score is the pass fraction, verl's ``continuous=True``. Geometry3K is graded with
``mathruler``, as in verl (an optional dependency: ``pip install "rlflow[math]"``). verl's search and PRIME
scorers are not built in: pass your own function to :class:`~rlflow.rewards.FunctionReward` for those.
"""

from __future__ import annotations

from typing import Any

from rlflow.rewards import code, geo3k, gsm8k, math, math_dapo  # geo3k imports its grader (mathruler) when called
from rlflow.rewards.sandbox_fusion import SandboxFusion

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
DAPO_PREFIX = "aime"
ADDITION_SOURCES = ("rlflow/addition", "rlflow/shapes")  # the built-in tasks' DATA_SOURCE (exact match)
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
GEO3K_SOURCES = ("hiyouga/geometry3k",)


def exact_match(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response is exactly the answer (surrounding spaces ignored), else 0.0: the reward of the
    built-in addition task (``rlflow.tasks.addition.exact_match`` is this function)."""
    return float(solution_str.strip() == ground_truth)


def supports(data_source: str) -> bool:
    """Whether :func:`default_compute_score` has a scorer for ``data_source``."""
    return (data_source in (*GSM8K_SOURCES, *MATH_SOURCES, *DAPO_SOURCES, *CODE_SOURCES, *ADDITION_SOURCES,
                            *GEO3K_SOURCES)
            or str(data_source).startswith(DAPO_PREFIX))


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
    sandbox: SandboxFusion | None = None,
) -> float | dict:
    """Score one sample with the rule scorer for its ``data_source``.

    Returns a float (GSM8K, MATH, Geometry3K, the built-in addition task) or a dict with ``"score"``
    (DAPO: ``score``, ``acc``, ``pred``; code: ``score``, ``passed``, ``total``).

    ``sandbox``: where code data sources run (default: the local sandbox; a :class:`SandboxFusion` client: its
    server, and a request that fails raises :class:`~rlflow.rewards.sandbox_fusion.SandboxFusionError`).

    Raises:
        NotImplementedError: for any other data_source, naming it and the supported ones.
    """
    if data_source in GSM8K_SOURCES:
        return float(gsm8k.compute_score(solution_str, ground_truth))
    if data_source in MATH_SOURCES:
        return float(math.compute_score(solution_str, ground_truth))
    if data_source in DAPO_SOURCES or str(data_source).startswith(DAPO_PREFIX):
        return math_dapo.compute_score(solution_str, ground_truth)
    if data_source in CODE_SOURCES:
        return code.compute_score(solution_str, ground_truth, sandbox=sandbox)
    if data_source in GEO3K_SOURCES:
        return float(geo3k.compute_score(solution_str, ground_truth))
    if data_source in ADDITION_SOURCES:
        return exact_match(solution_str, str(ground_truth))
    supported = ", ".join([*GSM8K_SOURCES, *MATH_SOURCES, *DAPO_SOURCES, f"{DAPO_PREFIX}*", *CODE_SOURCES,
                           *GEO3K_SOURCES, *ADDITION_SOURCES])
    raise NotImplementedError(
        f"no built-in reward for data_source={data_source!r}. Supported: {supported}. "
        "For other data, pass your own function: FunctionReward(my_compute_score)."
    )
