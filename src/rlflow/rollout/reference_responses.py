"""Adds each prompt's reference (ground-truth) response to its group of samples: SPIN's "real" data."""

from __future__ import annotations

import torch
from tensordict import NonTensorStack, TensorDict

from rlflow.data import keys as K
from rlflow.rewards.base import column
from rlflow.rollout.wrapper import RolloutWrapper, cat_batches


class WithReferenceResponses(RolloutWrapper):
    """Runs ``rollout`` (``n`` samples per prompt), then appends to each prompt's group one row holding
    the prompt's reference response, tokenized, followed by EOS.

    Layout: per prompt, its ``n`` samples then its reference row, contiguous, sharing ``group``;
    ``is_reference`` ([B] bool) marks the reference rows. ``B = prompts x (n + 1)``. The reference row's
    ``rollout_log_probs`` are 0 (it was not sampled) and its ``response_text`` is the reference text.
    The reference text is :meth:`reference_text` (default: the row's ``ground_truth``); override it
    when the full solution lives elsewhere (e.g. GSM8K's ``extra_info["answer"]``).
    Validation (``with_options``) samples without reference rows. As a stage of the experience stream
    (timed on its own): ``ReferenceResponses(text)`` in ``rlflow.rollout.stream``.
    """

    def __init__(self, rollout):
        super().__init__(rollout)
        self.in_keys = tuple(dict.fromkeys(tuple(rollout.in_keys) + (K.GROUND_TRUTH, K.EXTRA_INFO)))
        self.out_keys = tuple(rollout.out_keys) + (K.IS_REFERENCE,)

    def reference_text(self, ground_truth, extra_info) -> str:
        """The reference response of one prompt."""
        return str(ground_truth)

    def forward(self, prompts: TensorDict) -> TensorDict:
        return add_reference_rows(prompts, self.rollout(prompts), self.tokenizer, self.reference_text)


def add_reference_rows(prompts: TensorDict, samples: TensorDict, tok, reference_text) -> TensorDict:
    """``samples`` (``n`` per prompt of ``prompts``) with each prompt's reference row after its group
    (:class:`WithReferenceResponses`' layout); ``reference_text(ground_truth, extra_info) -> str``."""
    P = prompts.batch_size[0]
    n = samples.batch_size[0] // P
    truths, extras = column(prompts, K.GROUND_TRUTH), column(prompts, K.EXTRA_INFO)
    missing = [i for i, t in enumerate(truths) if t is None]
    if missing:
        raise ValueError(f"WithReferenceResponses: prompt row(s) {missing[:10]} have no ground_truth to use as "
                         "the reference response")
    texts = [reference_text(t, e) for t, e in zip(truths, extras)]
    reference = _reference_rows(tok, prompts, samples, texts, samples[K.GROUP].view(P, n)[:, 0])
    samples.set(K.IS_REFERENCE, torch.zeros(P * n, dtype=torch.bool, device=reference.device))
    joined = cat_batches([samples, reference], tok.pad_token_id)
    order = torch.cat([torch.arange(P * n).view(P, n), P * n + torch.arange(P)[:, None]], dim=1).flatten()
    return joined[order.to(reference[K.GROUP].device)]


def _reference_rows(tok, prompts: TensorDict, samples: TensorDict, texts: list[str], group) -> TensorDict:
    device = prompts[K.PROMPT_IDS].device
    eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
    ids = [tok(t, add_special_tokens=False)["input_ids"] + eos for t in texts]
    width = max(len(x) for x in ids)
    response = torch.full((len(ids), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        response[i, : len(x)], mask[i, : len(x)] = torch.tensor(x, dtype=torch.long), 1
    rows = prompts.clone(False)
    rows.set(K.RESPONSE_IDS, response.to(device))
    rows.set(K.RESPONSE_MASK, mask.to(device=device, dtype=samples[K.RESPONSE_MASK].dtype))
    rows.set(K.GROUP, group)
    rows.set(K.RESPONSE_TEXT, NonTensorStack(*texts))
    rows.set(K.IS_REFERENCE, torch.ones(len(ids), dtype=torch.bool, device=device))
    for key in samples.keys():  # anything else the sampler wrote: zeros (tensors) or None
        if key in rows.keys():
            continue
        value = samples.get(key)
        if isinstance(value, torch.Tensor):
            rows.set(key, value.new_zeros((len(ids),) + value.shape[1:]))
        else:
            rows.set(key, NonTensorStack(*([None] * len(ids))))
    return rows
