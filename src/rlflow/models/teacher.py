"""Distillation teachers: frozen models whose per-token log-probs of the student's samples fill ``teacher_log_probs``.

A teacher is a :class:`~rlflow.models.policy.Policy` that writes ``teacher_log_probs`` instead of ``old_log_probs``
(the same scoring pass as the reference's: micro-batches, token budgets, packing, shared prompts). Several teachers
(verl's multi-teacher "MOPD") are routed per row by a batch key, ``data_source`` by default: each row is scored
by the teacher of its value, as verl's ``distillation.teacher_key`` routes requests to its teacher servers.

:class:`Teacher` runs as a stage of the experience stream (``stages=[teacher]``), after the reward, so its time is
``timing_s/teacher``. Its model moves to the device of the batches it scores at the first one. Teachers score at
temperature 1 (verl: "temperature has no effect on prompt_logprobs"), and must share the student's vocabulary:
the student's token ids are fed to them as they are.

With ``top_k=k`` (verl's ``loss_mode=forward_kl_topk``) each teacher also writes, at every response position, its
``k`` most likely tokens' log-probs and ids (``teacher_topk_log_probs`` / ``teacher_topk_ids``, ``B x R x k``):
the full-vocabulary log-softmax at those tokens, not renormalised over them, as verl's teacher servers return.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.data.nontensor import per_row
from rlflow.models.policy import Policy
from rlflow.module import BatchModule


class Teacher(BatchModule):
    """Frozen teacher model(s) writing ``teacher_log_probs`` [B, R] (0 after each response's end).

    Args:
        teachers: one model (a ``Policy``, or a causal LM with ``tokenizer``), or ``{route value: Policy}`` for
            several, routed by ``route_key``; a row whose value has no teacher is an error naming it.
        route_key: the batch key (non-tensor, one value per row) that picks each row's teacher.
        micro_batch_size / max_tokens_per_micro_batch: the scoring passes' split (for models given bare).
        top_k: also write each position's ``top_k`` most likely tokens (log-probs and ids) for
            :class:`~rlflow.algorithms.distillation.DistillationLoss` with ``kind="forward_kl_topk"``.

    ``stats``: ``distillation/teacher_kl``, the mean over response tokens of ``rollout_log_probs -
    teacher_log_probs`` (the k1 estimate of KL(student || teacher) on the fresh samples), when the rollout wrote
    its log-probs: what distillation drives down.
    """

    stage_name = "teacher"

    def __init__(self, teachers, tokenizer=None, *, route_key: str = K.DATA_SOURCE, micro_batch_size: int | None = None,
                 max_tokens_per_micro_batch: int | None = None, top_k: int | None = None):
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"Teacher: top_k must be a positive integer (or None), got {top_k!r}")
        self.top_k = top_k
        many = isinstance(teachers, dict)
        given = teachers if many else {None: teachers}
        if not given:
            raise ValueError("Teacher needs at least one teacher model")
        self.teachers = {key: self._frozen(t, tokenizer, micro_batch_size, max_tokens_per_micro_batch)
                         for key, t in given.items()}
        self.route_key = route_key if many else None
        self.stats: dict[str, float] = {}

    @staticmethod
    def _frozen(teacher, tokenizer, micro, tokens) -> Policy:
        if not isinstance(teacher, Policy):
            teacher = Policy(teacher, tokenizer, micro_batch_size=micro, max_tokens_per_micro_batch=tokens)
        teacher.model.eval().requires_grad_(False)
        teacher.log_prob_key, teacher.entropy_key = K.TEACHER_LOG_PROBS, None
        teacher.module.temperature = 1.0
        return teacher

    @classmethod
    def from_pretrained(cls, paths: str | Path | dict[str, str | Path], *, route_key: str = K.DATA_SOURCE,
                        top_k: int | None = None, **kwargs) -> Teacher:
        """Teacher(s) loaded with :meth:`Policy.from_pretrained` (``kwargs`` go there: ``micro_batch_size``,
        ``remove_padding``, ...): one path, or ``{route value: path}``."""
        if isinstance(paths, dict):
            return cls({k: Policy.from_pretrained(p, **kwargs) for k, p in paths.items()}, route_key=route_key,
                       top_k=top_k)
        return cls(Policy.from_pretrained(paths, **kwargs), top_k=top_k)

    @property
    def out_keys(self) -> tuple[str, ...]:
        return (K.TEACHER_LOG_PROBS,) + ((K.TEACHER_TOPK_LOG_PROBS, K.TEACHER_TOPK_IDS) if self.top_k else ())

    @property
    def in_keys(self) -> tuple[str, ...]:
        return Policy.in_keys + (K.RESPONSE_MASK,) + ((self.route_key,) if self.route_key else ())

    @property
    def tokenizers(self) -> dict:
        return {key: t.tokenizer for key, t in self.teachers.items()}

    def _placed(self, teacher: Policy, device: torch.device) -> Policy:
        if next(teacher.model.parameters()).device != device:
            teacher.model.to(device)
        return teacher

    def _score(self, teacher: Policy, batch: TensorDict) -> tuple[torch.Tensor, ...]:
        """(log-probs ``B x R``,) or, with ``top_k``, also the top-k log-probs and ids ``B x R x k``."""
        if self.top_k is None:
            return (teacher(batch)[K.TEACHER_LOG_PROBS].float(),)
        vocab = teacher.model.get_output_embeddings().weight.shape[0]
        if self.top_k > vocab:
            raise ValueError(f"Teacher: top_k={self.top_k} is more than the teacher's vocabulary ({vocab} tokens)")
        return teacher.top_k(batch, self.top_k)

    @torch.no_grad()
    def forward(self, batch: TensorDict) -> TensorDict:
        device = batch[K.PROMPT_IDS].device
        if self.route_key is None:
            outs = self._score(self._placed(self.teachers[None], device), batch)
        else:
            values = per_row(batch, self.route_key)
            missing = sorted({str(v) for v in values} - {str(k) for k in self.teachers})
            if missing:
                raise KeyError(f"Teacher: no teacher for {self.route_key}={missing[0]!r} (rows routed by "
                               f"{self.route_key!r}); teachers: {sorted(map(str, self.teachers))}")
            B, R = batch[K.RESPONSE_IDS].shape
            outs = (torch.zeros(B, R, dtype=torch.float32, device=device),)
            if self.top_k:
                outs += (torch.zeros(B, R, self.top_k, device=device),
                         torch.zeros(B, R, self.top_k, dtype=torch.long, device=device))
            for key, teacher in self.teachers.items():
                rows = torch.tensor([i for i, v in enumerate(values) if str(v) == str(key)], device=device,
                                    dtype=torch.long)
                if len(rows):
                    part = batch[rows].select(*Policy.in_keys, K.RESPONSE_MASK, *self._vision_keys(batch))
                    for full, scored in zip(outs, self._score(self._placed(teacher, device), part)):
                        full[rows] = scored.to(full.dtype)
        out, mask = outs[0], batch[K.RESPONSE_MASK]
        batch[K.TEACHER_LOG_PROBS] = out * mask  # positions after a response's end score nothing
        if self.top_k:
            batch[K.TEACHER_TOPK_LOG_PROBS] = outs[1] * mask[..., None]
            batch[K.TEACHER_TOPK_IDS] = outs[2] * mask[..., None].long()
        self.stats = {}
        if K.ROLLOUT_LOG_PROBS in batch.keys():
            gap = (batch[K.ROLLOUT_LOG_PROBS].float() - out) * mask
            self.stats["distillation/teacher_kl"] = float(gap.sum() / mask.sum().clamp(min=1))
        return batch

    @staticmethod
    def _vision_keys(batch: TensorDict) -> tuple[str, ...]:
        return (K.MULTI_MODAL_INPUTS,) if K.MULTI_MODAL_INPUTS in batch.keys() else ()

    def __repr__(self) -> str:
        names = [str(k) for k in self.teachers] if self.route_key else []
        routed = f", routed by {self.route_key!r}: {names}" if names else ""
        top = f", top_k={self.top_k}" if self.top_k else ""
        return f"Teacher({len(self.teachers)} model(s){routed}{top})"
