"""Callbacks the Trainer installs itself (plain objects with ``on_*`` hooks, like a user's).

:class:`NoLearningSignal` warns, once, when every group of several consecutive steps had zero reward
variance (``numerics/zero_variance_group_frac`` = 1): under GRPO-style estimators every advantage is then
0 and the policy does not move, however long the run. The message names the likely causes, with what
this run shows for each of them.
"""

from __future__ import annotations

import warnings

import torch

from rlflow.data import keys as K
from rlflow.data.nontensor import column
from rlflow.trainer.watchdog import Watchdog

# Characters common answer formats need, and what needs them.
FORMAT_CHARS = {"\\": "\\boxed{...}", "{": "\\boxed{...}", "}": "\\boxed{...}", "#": "GSM8K's '#### 42'",
                "<": "<answer>...</answer>", ">": "<answer>...</answer>"}


class NoLearningSignalWarning(UserWarning):
    """Every group of several consecutive steps scored the same for all its samples: nothing to learn from."""


def unwritable_chars(tokenizer, text: str) -> list[str]:
    """The characters of ``text`` that ``tokenizer`` cannot write (encode, then decode, and it is not there)."""
    out = []
    for ch in dict.fromkeys(text):
        if ch.isspace():
            continue
        ids = tokenizer.encode(ch, add_special_tokens=False)
        if tokenizer.decode(ids, skip_special_tokens=True).strip() != ch:
            out.append(ch)
    return out


class NoLearningSignal:
    """Warn once when ``patience`` consecutive steps had no group with any reward variance.

    ``Trainer`` adds one (``patience=3``) unless its ``callbacks`` hold an instance already (pass
    ``NoLearningSignal(patience=10)`` to change it, or ``NoLearningSignal(patience=0)`` to turn it off).
    It reads the step's metrics and, at ``on_rollout_end``, keeps what the message needs: which groups
    were token-for-token identical, and one sample (prompt, response, ground truth).
    """

    def __init__(self, patience: int = 3):
        self.patience = patience
        self.flat_steps, self.warned = 0, False
        self._identical: float | None = None
        self._example: tuple[str, str, str] | None = None
        self._tokenizer = None

    def on_rollout_end(self, trainer, batch) -> None:
        if self.warned or not self.patience or K.GROUP not in batch.keys():
            return
        self._identical = identical_group_frac(batch[K.RESPONSE_IDS], batch[K.RESPONSE_MASK], batch[K.GROUP])
        tok = self._tokenizer = trainer.policy.tokenizer
        keys = batch.keys()
        prompt = column(batch, K.PROMPT_TEXT)[0] if K.PROMPT_TEXT in keys else ""
        truth = column(batch, K.GROUND_TRUTH)[0] if K.GROUND_TRUTH in keys else None
        ids = batch[K.RESPONSE_IDS][0][batch[K.RESPONSE_MASK][0].bool()].tolist()
        self._example = (str(prompt), tok.decode(ids, skip_special_tokens=True), truth)

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        if self.warned or not self.patience:
            return
        flat = metrics.get("numerics/zero_variance_group_frac", 0.0) >= 1.0 - 1e-9
        self.flat_steps = self.flat_steps + 1 if flat else 0
        if self.flat_steps >= self.patience:
            self.warned = True
            warnings.warn(self.message(trainer, metrics), NoLearningSignalWarning, stacklevel=3)  # at Trainer.fit

    def message(self, trainer, metrics: dict) -> str:
        lo, hi = metrics.get("critic/score/min"), metrics.get("critic/score/max")
        head = (f"no learning signal for {self.flat_steps} steps in a row (to step {trainer.global_step}): in every "
                "group all samples got the same reward (numerics/zero_variance_group_frac = 1), so every advantage "
                "is 0 and the policy does not change.")
        causes = []
        if lo is not None and lo == hi:
            head += f" Every sample scored {lo:g}."
            if hi <= 0:
                causes += self._zero_reward_causes()
            else:
                causes += [f"the task is too easy (if {lo:g} is the reward's best, every sample is right): use harder "
                           "prompts or a reward with finer steps",
                           "the reward does not depend on the response (a reward function bug?)"]
        elif lo is not None:
            causes.append(f"each prompt is always answered alike (scores from {lo:g} to {hi:g}, but the same within "
                          "each group): the policy has converged on these prompts, or samples too greedily; use harder "
                          "or more varied prompts, or a higher temperature")
        if self._identical is not None and self._identical > 0.5:
            temp = trainer.rollout.temperature
            causes.append(f"the samples of a prompt are token-for-token identical in {self._identical:.0%} of the "
                          f"groups: the rollout temperature ({temp}) is too low, do_sample is off, or the policy's "
                          "entropy has collapsed (actor/entropy)")
        if not causes:
            causes.append("the reward does not depend on the response (a reward function bug?)")
        return head + "\nLikely causes:\n" + "\n".join(f"  - {c}" for c in causes)

    def _zero_reward_causes(self) -> list[str]:
        prompt, response, truth = self._example or ("", "", None)
        truth = None if truth is None else str(truth)
        causes, tok = [], self._tokenizer
        if tok is not None:
            missing = unwritable_chars(tok, "".join(FORMAT_CHARS))
            if missing:
                needs = " or ".join(sorted({FORMAT_CHARS[c] for c in missing}))
                causes.append(f"the tokenizer cannot write {', '.join(map(repr, missing))}, so no response can contain "
                              f"{needs}: a reward that looks for them scores 0 whatever the model learns")
            in_truth = unwritable_chars(tok, truth or "")
            if in_truth:
                causes.append(f"the tokenizer cannot write {', '.join(map(repr, in_truth))} of the ground truth "
                              f"{truth[:60]!r}: no response can match it")
            in_prompt = unwritable_chars(tok, prompt)
            if in_prompt:
                causes.append(f"the prompt holds characters the tokenizer cannot encode ({', '.join(map(repr, in_prompt))}):"
                              " the model never sees them")
        causes += ["the answer format is never produced: the reward looks for a format (\\boxed{}, '####', a tag) that "
                   "the model does not write yet; ask for it in the prompt with an example, or give partial credit",
                   "a reward function bug, or ground truths in another format than the reward compares with"]
        example = f"a sample: response {response[:120]!r}"
        if truth is not None:
            example += f", ground truth {truth[:60]!r}"
        return causes + [example + f", prompt {prompt[-120:]!r}"]


def identical_group_frac(response_ids: torch.Tensor, mask: torch.Tensor, group: torch.Tensor) -> float:
    """Fraction of the groups with at least 2 samples whose responses are token-for-token the same.
    response_ids, mask: [B, R]; group: [B]."""
    ids = torch.where(mask.bool(), response_ids, torch.full_like(response_ids, -1))
    same, total = 0, 0
    for g in torch.unique(group):
        rows = ids[group == g]
        if len(rows) > 1:
            total += 1
            same += bool((rows == rows[0]).all())
    return same / total if total else 0.0


def with_defaults(callbacks) -> list:
    """The user's callbacks, plus a :class:`NoLearningSignal` unless they hold one, and the fault
    :class:`~rlflow.trainer.watchdog.Watchdog` (idle on one process)."""
    callbacks = list(callbacks)
    callbacks = callbacks if any(isinstance(c, NoLearningSignal) for c in callbacks) else [*callbacks, NoLearningSignal()]
    return callbacks if any(isinstance(c, Watchdog) for c in callbacks) else [*callbacks, Watchdog()]
