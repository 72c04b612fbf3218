"""Rollout tracing into MLflow: each traced sample of a training step becomes one MLflow trace.

verl's ``actor_rollout_ref.rollout.trace.backend=mlflow`` records each sample of the agent loop as a trace with
the step and sample index as attributes and its generate calls as spans. :class:`TracedRollout` does the same
around any rollout (after it returns, from its output batch): per traced sample, a root span ``rollout`` (inputs:
the prompt; outputs: the response; attributes: step, sample_index, rollout_n, group, num_turns, experiment)
and a child span ``generate`` with the token ids (and their text with ``token2text``). At most
``max_samples_per_step`` prompts per step are traced, with all their ``n`` samples (verl's per-worker cap; rlflow
generates in one worker), chosen at random with a seeded generator. Validation (``with_options``) is not traced.

Needs the ``mlflow-skinny`` package (``pip install 'rlflow[tracing]'``), imported only when a tracer starts.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.rollout.wrapper import RolloutWrapper


def _mlflow():
    try:
        import mlflow
    except ImportError as e:
        raise ImportError("TracedRollout (rollout.trace.backend=mlflow) needs the mlflow-skinny package: "
                          "pip install 'rlflow[tracing]'") from e
    return mlflow


def open_store(tracking_uri: str | None, folder: str | None, experiment: str):
    """Point MLflow at ``tracking_uri`` (else ``$MLFLOW_TRACKING_URI``, else a ``file:`` store in
    ``folder/mlruns``) and the experiment ``experiment``; returns the mlflow module and the URI used.

    MLflow 3 refuses a ``file:`` store unless ``MLFLOW_ALLOW_FILE_STORE=true`` (its SQL stores need
    SQLAlchemy, which mlflow-skinny lacks), so this sets it for the default store.
    """
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        if folder is None:
            raise ValueError("TracedRollout: give tracking_uri, set MLFLOW_TRACKING_URI or give a folder for mlruns")
        uri = (Path(folder).expanduser().resolve() / "mlruns").as_uri()
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow = _mlflow()
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)  # it also writes $MLFLOW_TRACKING_URI for subprocesses: put the user's back, so
    if before is None:            # the next run in this process does not take this run's store for the user's
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before
    mlflow.set_experiment(experiment)
    return mlflow, uri


class TracedRollout(RolloutWrapper):
    """Runs ``rollout`` and writes an MLflow trace per traced sample of each call (one call = one step).

    ``tracking_uri``/``folder``/``experiment``: where (:func:`open_store`); ``token2text``: decode ids to text
    in the spans (else ids only, as verl); ``max_samples_per_step``: prompts traced per step (None: all).
    """

    def __init__(self, rollout, experiment: str = "rlflow", tracking_uri: str | None = None,
                 folder: str | None = None, token2text: bool = False, max_samples_per_step: int | None = None,
                 run_name: str | None = None, seed: int = 0):
        super().__init__(rollout)
        if max_samples_per_step is not None and max_samples_per_step < 1:
            raise ValueError(f"TracedRollout: max_samples_per_step={max_samples_per_step}: expected None or >= 1")
        self.experiment, self.tracking_uri, self.folder = experiment, tracking_uri, folder
        self.token2text, self.max_samples_per_step = token2text, max_samples_per_step
        self.run_name, self.seed, self.step = run_name, seed, 0
        self._mlflow = None

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
        if self._mlflow is None:
            self._mlflow, self.tracking_uri = open_store(self.tracking_uri, self.folder, self.experiment)
        mlflow, rows = self._mlflow, samples.batch_size[0]
        n = max(rows // max(prompts, 1), 1)
        for row in self.traced_rows(rows, prompts):
            prompt = self._tokens(samples[K.PROMPT_IDS][row], samples[K.PROMPT_MASK][row])
            response = self._tokens(samples[K.RESPONSE_IDS][row], _through_last(samples[K.RESPONSE_MASK][row]))
            attributes = {"step": self.step, "sample_index": row // n, "rollout_n": row % n,
                          "experiment": self.run_name or self.experiment, "batch_seconds": round(seconds, 3)}
            for key in (K.GROUP, K.NUM_TURNS):
                if key in samples.keys():
                    attributes[key] = int(samples[key][row])
            with mlflow.start_span(name="rollout", attributes=attributes) as root:
                root.set_inputs({"prompt": prompt})
                with mlflow.start_span(name="generate") as span:
                    span.set_inputs({"prompt_ids": prompt["ids"]})
                    span.set_outputs(response)
                root.set_outputs({"response": response})
        flush = getattr(mlflow, "flush_trace_async_logging", None)
        if flush is not None:
            flush()

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
