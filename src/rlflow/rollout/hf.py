"""HFRollout: the single-turn rollout sampling with transformers' ``generate``: ``SingleTurnRollout(HFEngine(...))``
with the engine's options among its own."""

from __future__ import annotations

from rlflow.rollout.engines.hf import HFEngine, response_mask_until_eos  # noqa: F401 - re-exported
from rlflow.rollout.single_turn import SingleTurnRollout
from rlflow.rollout.weight_sync import DEFAULT_BUCKET_BYTES


class HFRollout(SingleTurnRollout):
    """Turns prompts into ``n`` samples each with ``model.generate``.

    Reads left-padded prompts; writes right-padded responses, a response mask
    that covers tokens up to and including the first EOS, the sampler's
    log-probs (temperature-scaled, before top-k/top-p truncation, as the policy
    computes them), a ``group`` id per prompt and the decoded text. Non-tensor
    prompt fields (ground truth, data source, ...) are repeated with their rows.

    On one device the model is the policy's own module (``bind``), so weight sync
    after an update is free; under FSDP2 the Trainer binds a full copy and
    ``sync_weights`` refreshes it in buckets.

    ``ignore_eos=True`` generates past EOS, as vLLM's ``ignore_eos``: each response runs to ``max_new_tokens``
    (or a ``stop_token_ids`` token), and the mask covers all of it.

    ``cache_implementation`` (e.g. ``"static"``) and ``compile`` (compiled decoding, on GPUs) are passed to
    :class:`~rlflow.rollout.engines.hf.HFEngine`; both off by default. Under the Trainer, sampling runs in the
    training precision (``precision="bf16-mixed"``: bf16 autocast, as the update).
    """

    makes_image_engine = True  # HFEngine generates with images (vision-language prompts)

    def __init__(self, n: int = 1, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 max_new_tokens: int = 512, do_sample: bool = True, seed: int | None = None,
                 stop_token_ids: tuple[int, ...] = (), bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 cache_implementation: str | None = None, compile: bool = False, ignore_eos: bool = False,
                 return_routed_experts: bool = False):
        super().__init__(HFEngine(cache_implementation=cache_implementation, compile=compile), n,
                         temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                         do_sample=do_sample, seed=seed, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                         return_routed_experts=return_routed_experts, bucket_bytes=bucket_bytes)
