"""verl's GSM8K answer-checking tool (``verl.tools.gsm8k_tool.Gsm8kTool``), for its multi-turn example.

The model submits an answer; the tool replies with the parsed answer and its GSM8K score against the
row's ground truth (``extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth``), and
returns verl's step reward: 0 when the score improved on the trajectory's best so far, else -0.05.
"""

from __future__ import annotations

from rlflow.rewards.gsm8k import compute_score
from rlflow.rollout.tools.base import Tool, ToolResult


class Gsm8kTool(Tool):
    """Scores a submitted GSM8K answer (``{"answer": "72"}``) against the sample's ``ground_truth``."""

    name = "calc_gsm8k_reward"
    description = "A tool for calculating the reward of gsm8k. (1.0 if your answer is correct, 0.0 if your answer is incorrect)"
    parameters = {"type": "object", "properties": {
        "answer": {"type": "string", "description": "The model's answer to the GSM8K math problem, must be a digits"}},
        "required": ["answer"]}
    timeout_s = 5.0

    async def execute(self, args: dict, *, session: dict, ground_truth: str | None = None, **_) -> ToolResult:
        if ground_truth is None:
            raise ValueError("calc_gsm8k_reward needs the row's ground truth: extra_info.tools_kwargs."
                             "calc_gsm8k_reward.create_kwargs.ground_truth")
        answer = str(args.get("answer", ""))
        response = answer if answer.startswith("#### ") else "#### " + answer
        reward = float(compute_score(response, str(ground_truth), method="flexible"))
        step = 0.0 if reward > session.get("reward", 0.0) else -0.05  # verl: penalise a non-improving submission
        session["reward"] = max(reward, session.get("reward", 0.0))
        return ToolResult(f"Current parsed {answer=} {reward=}", step, {"score": reward})
