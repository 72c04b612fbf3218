"""Rollout tracing: each traced sample of a training step becomes one trace, in MLflow or Trackio.

verl's ``actor_rollout_ref.rollout.trace.backend=mlflow|trackio`` records each sample of the agent loop as a trace
with the step and sample index. :class:`TracedRollout` does the same around any rollout (after it returns, from
its output batch): per traced sample, the prompt and the response (token ids, and their text with ``token2text``)
with the attributes step, sample_index, rollout_n, group, num_turns, experiment, written by the backend's writer
(:mod:`rlflow.rollout.trace_writers`). At most ``max_samples_per_step`` prompts per step are traced, with all their
``n`` samples (verl's per-worker cap; rlflow generates in one worker), chosen at random with a seeded generator.
Validation (``with_options``) is not traced.
"""

from __future__ import annotations

import random
import time

from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.rollout.trace_writers import MlflowTraceWriter, TrackioTraceWriter
from rlflow.rollout.wrapper import RolloutWrapper

BACKENDS = ("mlflow", "trackio")


class TracedRollout(RolloutWrapper):
    """Runs ``rollout`` and writes a trace per traced sample of each call (one call = one step).

    ``backend``: ``mlflow`` (an MLflow experiment ``experiment`` at ``tracking_uri``, else
    ``$MLFLOW_TRACKING_URI``, else ``folder/mlruns``) or ``trackio`` (the Trackio project ``experiment`` in
    ``$TRACKIO_DIR``, else ``folder/trackio``); ``run_name``: the run the traces carry; ``token2text``: decode ids
    to text (else ids only, as verl); ``max_samples_per_step``: prompts traced per step (None: all).
    """

    def __init__(self, rollout, experiment: str = "rlflow", tracking_uri: str | None = None,
                 folder: str | None = None, token2text: bool = False, max_samples_per_step: int | None = None,
                 run_name: str | None = None, seed: int = 0, backend: str = "mlflow"):
        super().__init__(rollout)
        if max_samples_per_step is not None and max_samples_per_step < 1:
            raise ValueError(f"TracedRollout: max_samples_per_step={max_samples_per_step}: expected None or >= 1")
        if backend not in BACKENDS:
            raise ValueError(f"TracedRollout: backend={backend!r}: expected one of {BACKENDS}")
        if backend == "mlflow":
            self.writer = MlflowTraceWriter(experiment, tracking_uri, folder)
        else:
            self.writer = TrackioTraceWriter(experiment, folder, run_name)
        self.experiment, self.backend = experiment, backend
        self.token2text, self.max_samples_per_step = token2text, max_samples_per_step
        self.run_name, self.seed, self.step = run_name, seed, 0

    @property
    def location(self):
        """Where the traces went (MLflow's tracking URI, Trackio's folder); None before the first step."""
        return self.writer.location

    def forward(self, prompts: TensorDict) -> TensorDict:
        start = time.time()
        samples = self.rollout(prompts)
        self.step += 1
        self.trace(samples, prompts.batch_size[0], time.time() - start)
        return samples

    def traced_rows(self, rows: int, prompts: int) -> list[int]:
        """The rows traced this step: all ``n`` samples of up to ``max_samples_per_step`` random prompts."""
        n = max(rows // max(prompts, 1), 1)
        groups = list(range(rows // n))
        if self.max_samples_per_step is not None and len(groups) > self.max_samples_per_step:
            groups = sorted(random.Random(self.seed * 1_000_003 + self.step).sample(groups, self.max_samples_per_step))
        return [g * n + i for g in groups for i in range(n)]

    def trace(self, samples: TensorDict, prompts: int, seconds: float) -> None:
        rows = samples.batch_size[0]
        n = max(rows // max(prompts, 1), 1)
        for row in self.traced_rows(rows, prompts):
            prompt = self._tokens(samples[K.PROMPT_IDS][row], samples[K.PROMPT_MASK][row])
            response = self._tokens(samples[K.RESPONSE_IDS][row], _through_last(samples[K.RESPONSE_MASK][row]))
            attributes = {"step": self.step, "sample_index": row // n, "rollout_n": row % n,
                          "experiment": self.run_name or self.experiment, "batch_seconds": round(seconds, 3)}
            for key in (K.GROUP, K.NUM_TURNS):
                if key in samples.keys():
                    attributes[key] = int(samples[key][row])
            self.writer.write(attributes, prompt, response)
        self.writer.flush()

    def _tokens(self, ids, mask) -> dict:
        ids = ids[mask.bool()]
        out = {"ids": ids.tolist()}
        if self.token2text:
            out["text"] = self.tokenizer.decode(out["ids"], skip_special_tokens=False)
        return out


def _through_last(response_mask):
    """1 up to the last sampled token (tool/observation tokens inside the response kept), 0 on the padding."""
    on = response_mask.nonzero()
    keep = response_mask.new_zeros(response_mask.shape)
    if len(on):
        keep[: int(on[-1]) + 1] = 1
    return keep
