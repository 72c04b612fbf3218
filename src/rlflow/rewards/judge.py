"""LLM-as-judge: a generation engine grades each response with a prompt template; a score is parsed from
its answer.

The judge speaks the engine interface of :mod:`rlflow.rollout.engines` (``generate(prompts, params)``
with token-id prompts, returning completions with ``token_ids``): the Hugging Face model in process
(``HFEngine``), an in-process vLLM engine, or an OpenAI-compatible server. For each sample::

    text   = template.format(prompt=..., response=..., ground_truth=...)
    ids    = judge tokenizer's chat template over [{"role": "user", "content": text}]   (plain text without one)
    answer = engine.generate([ids], params)[0][0]          # batched, ``batch_size`` prompts per call
    raw    = parse(decode(answer))                         # default: the last number in the answer
    score  = (raw - low) / (high - low)  with scale=(low, high); raw itself with scale=None

Failures cost the sample, never the step: an engine call that raises or passes ``timeout_s`` is retried
(``retries`` more times), then its rows score 0.0 and are counted (``reward/errors``,
``reward/timeouts``); an answer without a score is counted in ``reward/judge/parse_failures`` (retried
too when the judge samples, since a greedy judge would answer the same again).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.rewards.base import Reward, RewardWarning, column, run_calls
from rlflow.rollout.engines.base import SamplingParams

DEFAULT_TEMPLATE = (
    "Grade the response to the question from 0 (wrong or useless) to 10 (correct and helpful).\n"
    "Question: {prompt}\nResponse: {response}\nReference answer: {ground_truth}\n"
    "End your answer with 'Score: <0-10>'."
)
LAST_NUMBER = r"(-?\d+(?:\.\d+)?)(?!.*\d)"


class JudgeReward(Reward):
    """Scores samples by asking a judge model (module docs above).

    Args:
        engine: an engine with ``generate(prompts: list[list[int]], params) -> list[list[Completion]]``.
        tokenizer: the judge model's tokenizer (encodes the question, decodes the answer).
        template: ``str.format`` template with ``{prompt}``, ``{response}`` and ``{ground_truth}``.
        parse: a regular expression whose first group is the score (the last match counts), or a function
            ``answer_text -> float | None`` (None: no score found).
        scale: ``(low, high)`` maps the parsed score to ``[0, 1]``; ``None`` keeps it as parsed.
        max_new_tokens, greedy, temperature: the judge's sampling.
        batch_size: questions per engine call.
        timeout_s: seconds one engine call may take (``None``: no limit).
        retries: further attempts after a failed or timed-out call (and after a parse failure when sampling).
        name: the name in metrics.

    ``extras``: ``judge_answer`` (the judge's text per row) and ``judge_raw`` (the parsed number).
    """

    thread_safe = False  # the engine may be shared with the rollout

    def __init__(self, engine, tokenizer, template: str = DEFAULT_TEMPLATE, *,
                 parse: str | Callable[[str], float | None] = LAST_NUMBER, scale: tuple[float, float] | None = (0, 10),
                 max_new_tokens: int = 256, greedy: bool = True, temperature: float = 1.0, batch_size: int = 32,
                 timeout_s: float | None = 120.0, retries: int = 2, name: str = "judge"):
        super().__init__()
        if not hasattr(engine, "generate"):
            raise TypeError(f"engine must have generate(prompts, params) (rlflow.rollout.engines), got {engine!r}")
        missing = [f for f in ("response",) if "{" + f + "}" not in template]
        if missing:
            raise ValueError(f"the judge template must contain {{response}} (fields: prompt, response, ground_truth)")
        if scale is not None and not scale[1] > scale[0]:
            raise ValueError(f"scale must be (low, high) with high > low, got {scale}")
        if batch_size < 1 or retries < 0 or (timeout_s is not None and timeout_s <= 0):
            raise ValueError("batch_size must be >= 1, retries >= 0 and timeout_s > 0 or None")
        self.engine, self.tokenizer, self.template, self.scale = engine, tokenizer, template, scale
        self.parse = _regex_parser(parse) if isinstance(parse, str) else parse
        self.params = SamplingParams(n=1, temperature=temperature, max_new_tokens=max_new_tokens, greedy=greedy)
        self.greedy, self.batch_size, self.timeout_s, self.retries, self.name = (greedy, batch_size, timeout_s,
                                                                                  retries, name)
        self.in_keys = (*Reward.in_keys, K.RAW_PROMPT)

    def __repr__(self) -> str:
        return f"JudgeReward({type(self.engine).__name__}, scale={self.scale}, retries={self.retries})"

    def score(self, batch: TensorDict) -> torch.Tensor:
        prompts, responses = column(batch, K.RAW_PROMPT), column(batch, K.RESPONSE_TEXT)
        truths = column(batch, K.GROUND_TRUTH)
        questions = [self._encode(self.template.format(prompt=_prompt_text(p), response=r, ground_truth=g))
                     for p, r, g in zip(prompts, responses, truths)]
        n = len(questions)
        raw: list[float | None] = [None] * n
        answers: list[str | None] = [None] * n
        failed: dict[int, str] = {}  # row -> "error" | "timeout" | "parse", as of its latest attempt
        todo = list(range(n))
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats["reward/judge/retries"] = self.stats.get("reward/judge/retries", 0.0) + len(todo)
            for start in range(0, len(todo), self.batch_size):
                rows = todo[start : start + self.batch_size]
                [(status, value)] = run_calls([lambda rows=rows: self._generate([questions[i] for i in rows])],
                                              self.timeout_s, 1)
                if status != "ok":
                    failed |= {i: status for i in rows}
                    self._last_error = value
                    continue
                for i, completions in zip(rows, value):
                    answers[i] = self.tokenizer.decode(completions[0].token_ids, skip_special_tokens=True)
                    raw[i] = _finite(self.parse(answers[i]))
                    if raw[i] is None:
                        failed[i] = "parse"
                    else:
                        failed.pop(i, None)
            # a greedy judge answers a question the same way again: retry only failed calls then
            todo = sorted(i for i, why in failed.items() if why != "parse" or not self.greedy)
            if not todo:
                break
        self._report(failed, column(batch, K.DATA_SOURCE))
        self.extras["judge_answer"], self.extras["judge_raw"] = answers, raw
        low, high = self.scale or (0.0, 1.0)
        return torch.tensor([0.0 if r is None else (r - low) / (high - low) for r in raw], dtype=torch.float32)

    def _generate(self, prompts: list[list[int]]):
        out = self.engine.generate(prompts, self.params)
        if len(out) != len(prompts) or any(len(c) < 1 for c in out):
            raise RuntimeError(f"the engine returned {len(out)} answers for {len(prompts)} questions")
        return out

    def _encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
        return tok(text, add_special_tokens=True)["input_ids"]

    def _report(self, failed: dict[int, str], sources: list) -> None:
        counters = {"error": "reward/errors", "timeout": "reward/timeouts", "parse": "reward/judge/parse_failures"}
        self.stats.setdefault("reward/judge/parse_failures", 0.0)
        for why in ("error", "timeout", "parse"):
            rows = sorted(i for i, w in failed.items() if w == why)
            if not rows:
                continue
            self.stats[counters[why]] += len(rows)
            cause = {"error": f"the engine call raised {getattr(self, '_last_error', None)!r:.200}",
                     "timeout": f"the engine call timed out after {self.timeout_s} s",
                     "parse": "the judge's answer held no score"}[why]
            warnings.warn(f"{self.name}: {len(rows)} sample(s): {cause} after {self.retries + 1} attempt(s); scored "
                          f"0.0. First: row {rows[0]} (data_source={sources[rows[0]]!r}); rows {rows[:20]}",
                          RewardWarning, stacklevel=4)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
    return str(prompt)


def _finite(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number == number and abs(number) != float("inf") else None


def _regex_parser(pattern: str) -> Callable[[str], float | None]:
    compiled = re.compile(pattern, re.DOTALL)

    def parse(text: str) -> float | None:
        matches = list(compiled.finditer(text))
        return _finite(matches[-1].group(1)) if matches else None

    parse.__name__ = f"regex({pattern!r})"
    return parse
