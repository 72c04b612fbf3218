"""One sample of an agent rollout: its tokens, which of them the model wrote, and what happened on the way.

A trajectory's response is every token after the prompt, in order: model turns (mask 1, the sampler's
log-probs) and the tool/user messages between them (mask 0, log-prob 0). :func:`summarize` turns a
batch of trajectories into the rollout's metrics.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

FINISH_REASONS = ("answer", "length", "max_assistant_turns", "max_user_turns", "interaction", "environment")
CALL_ERRORS = ("parse", "unknown_tool", "error", "timeout")


@dataclass
class Trajectory:
    """The state of one sample while the loop runs, and its result afterwards."""

    prompt_ids: list[int]
    budget: int                                   # the most response tokens (model + appended)
    tools_kwargs: dict = field(default_factory=dict)
    interaction_kwargs: dict = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)   # the conversation, for interactions and rewards
    row: dict = field(default_factory=dict)       # the data row's ground_truth, data_source and extra_info
    agent_name: str | None = None                 # the loop the row named (verl's agent_name), None: the default
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)   # per response token: the weights that sampled it, -1: none
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    call_errors: Counter = field(default_factory=Counter)   # CALL_ERRORS -> count
    dropped_calls: int = 0                        # calls beyond max_parallel_calls in one turn
    truncated_results: int = 0
    tool_rewards: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    tool_metrics: dict[str, list[float]] = field(default_factory=dict)
    sessions: dict[str, dict] = field(default_factory=dict)  # tool name -> state kept across its calls
    finish: str = ""
    gen_s: float = 0.0
    tool_s: float = 0.0

    @property
    def context(self) -> list[int]:
        """What the model conditions on for its next turn."""
        return self.prompt_ids + self.response_ids

    @property
    def remaining(self) -> int:
        return self.budget - len(self.response_ids)

    def add_model_turn(self, token_ids: list[int], log_probs: list[float], versions: list[int] | None = None) -> None:
        """Append a model turn (mask 1); ``versions``: per token, the policy version that sampled it, if known."""
        self.response_ids += token_ids
        self.response_mask += [1] * len(token_ids)
        self.log_probs += log_probs
        self.versions += list(versions) if versions is not None else [-1] * len(token_ids)
        self.assistant_turns += 1

    def add_observation(self, token_ids: list[int]) -> bool:
        """Append tool/user tokens (mask 0); False, and nothing appended, when they do not fit the budget."""
        if len(token_ids) > self.remaining:
            return False
        self.response_ids += token_ids
        self.response_mask += [0] * len(token_ids)
        self.log_probs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)
        return True

    @property
    def step_reward(self) -> float:
        return float(sum(self.tool_rewards) + sum(self.turn_scores))

    def info(self) -> dict:
        """What a reward function reads in ``extra_info`` (verl's ``num_turns`` and ``rollout_reward_scores``)."""
        return {"num_turns": self.num_turns, "tool_calls": self.tool_calls, "messages": self.messages,
                "rollout_reward_scores": {"tool_rewards": list(self.tool_rewards),
                                          "turn_scores": list(self.turn_scores)}, "finish_reason": self.finish}

    @property
    def num_turns(self) -> int:
        """verl's count: assistant turns + user/tool turns + 1 (the prompt)."""
        return self.assistant_turns + self.user_turns + 1


def _spread(prefix: str, values: list[float]) -> dict[str, float]:
    return {f"{prefix}/mean": sum(values) / len(values), f"{prefix}/max": float(max(values)),
            f"{prefix}/min": float(min(values))} if values else {}


def summarize(trajs: list[Trajectory]) -> dict[str, float]:
    """The rollout's metrics: verl's ``num_turns/*`` and ``tool_call_counts/*``, and ``agent/*``."""
    n = len(trajs)
    calls = sum(t.tool_calls for t in trajs)
    errors = Counter()
    for t in trajs:
        errors.update(t.call_errors)
    masked = [t.response_mask.count(0) for t in trajs]
    total = sum(len(t.response_mask) for t in trajs)
    out = _spread("num_turns", [t.num_turns for t in trajs]) | _spread("tool_call_counts", [t.tool_calls for t in trajs])
    out |= {
        "agent/assistant_turns/mean": sum(t.assistant_turns for t in trajs) / n,
        "agent/tool_calls/mean": calls / n,
        "agent/tool_error_rate": sum(errors.values()) / calls if calls else 0.0,
        **{f"agent/tool_errors/{kind}": float(errors[kind]) for kind in CALL_ERRORS},
        "agent/dropped_calls": float(sum(t.dropped_calls for t in trajs)),
        "agent/truncated_tool_results": float(sum(t.truncated_results for t in trajs)),
        "agent/masked_tokens/mean": sum(masked) / n,
        "agent/masked_fraction": sum(masked) / total if total else 0.0,
        "agent/step_reward/mean": sum(t.step_reward for t in trajs) / n,
        "agent/gen_s/mean": sum(t.gen_s for t in trajs) / n,
        "agent/tool_s/mean": sum(t.tool_s for t in trajs) / n,
    }
    finishes = Counter(t.finish for t in trajs)
    out |= {f"agent/finish/{reason}": finishes[reason] / n for reason in FINISH_REASONS}
    per_tool: dict[str, list[float]] = {}
    for t in trajs:
        for key, values in t.tool_metrics.items():
            per_tool.setdefault(key, []).extend(values)
    out |= {f"agent/tool/{key}": sum(v) / len(v) for key, v in per_tool.items() if v}
    return out
