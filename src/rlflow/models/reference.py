"""The frozen KL reference of a policy, with a scoring split and weights of its own when asked.

``Trainer(reference=functools.partial(frozen_reference, path="ref-model", micro_batch_size=2))`` gives the Trainer
a function of its policy: it calls it with the policy when the loss or the estimator reads ``ref_log_probs``
(``"auto"`` is :meth:`Policy.reference`, the policy's split). verl's ``actor_rollout_ref.ref.*`` keys write this.
"""

from __future__ import annotations

from pathlib import Path

from rlflow.data import keys as K
from rlflow.models.checks import check_model_folder
from rlflow.models.critic import load_causal_lm
from rlflow.models.policy import Policy


def frozen_reference(policy: Policy, path: str | Path | None = None, *, micro_batch_size: int | None = None,
                     max_tokens_per_micro_batch: int | None = None, trust_remote_code: bool = False):
    """The reference of ``policy``: its frozen copy (with LoRA, the policy with its adapter off), or the weights at
    ``path`` scored with the policy's tokenizer (the vocabularies must agree: it scores the policy's token ids).
    ``micro_batch_size`` rows / ``max_tokens_per_micro_batch`` tokens per scoring pass (None: the whole batch / no
    token budget), whatever the policy's are."""
    if path is None:
        reference = policy.reference()
    else:
        check_model_folder(str(path), tokenizer=False)
        model = load_causal_lm(str(path), trust_remote_code).eval().requires_grad_(False)
        ours, theirs = (m.get_output_embeddings().weight.shape[0] for m in (policy.model, model))
        if ours != theirs:
            raise ValueError(f"{path}: its vocabulary has {theirs} tokens, the policy's {ours}; the reference scores "
                             "the policy's token ids, so they must agree")
        reference = Policy(model, policy.tokenizer, processor=policy.processor, temperature=policy.temperature,
                           log_prob_key=K.REF_LOG_PROBS, entropy_key=None, remove_padding=policy.remove_padding,
                           share_prompts=policy.share_prompts)
    reference.micro_batch_size, reference.max_tokens_per_micro_batch = micro_batch_size, max_tokens_per_micro_batch
    return reference
