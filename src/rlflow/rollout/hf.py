"""HFRollout: sampling with transformers' ``generate`` (KV cache, batched, no per-token Python loop of ours)."""

from __future__ import annotations

import torch
from tensordict import NonTensorStack, TensorDict
from torch import Tensor
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rlflow.data import keys as K
from rlflow.module import BatchModule
from rlflow.rollout.weight_sync import DEFAULT_BUCKET_BYTES, sync_weights


class _RecordLogProbs(LogitsProcessor):
    """Keeps the temperature-scaled log-softmax of the current step so the chosen token's log-prob can be read.

    Only one ``B x V`` step is held at a time: at step t it reads the log-prob of the
    token chosen at step t-1 (now the last of ``input_ids``) from the stored step.
    """

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len
        self.previous: Tensor | None = None
        self.chosen: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        self.take(input_ids)
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def take(self, input_ids: Tensor) -> None:
        if self.previous is not None and input_ids.shape[1] > self.prompt_len + len(self.chosen):
            self.chosen.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))


class HFRollout(BatchModule):
    """Turns prompts into ``n`` samples each with ``model.generate``.

    Reads left-padded prompts; writes right-padded responses, a response mask
    that covers tokens up to and including the first EOS, the sampler's
    log-probs (temperature-scaled, before top-k/top-p truncation, as the policy
    computes them), a ``group`` id per prompt and the decoded text. Non-tensor
    prompt fields (ground truth, data source, ...) are repeated with their rows.

    On one device the model is the policy's own module (``bind``), so weight sync
    after an update is free; under FSDP2 the Trainer binds a full copy and
    ``sync_weights`` refreshes it in buckets.
    """

    in_keys = (K.PROMPT_IDS, K.PROMPT_MASK)
    out_keys = (K.RESPONSE_IDS, K.RESPONSE_MASK, K.ROLLOUT_LOG_PROBS, K.GROUP, K.RESPONSE_TEXT)

    def __init__(
        self,
        n: int = 1,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_new_tokens: int = 512,
        do_sample: bool = True,
    ):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if do_sample and temperature <= 0:
            raise ValueError("temperature must be > 0 when sampling; use do_sample=False for greedy decoding")
        self.n, self.temperature, self.top_p, self.top_k = n, temperature, top_p, top_k
        self.max_new_tokens, self.do_sample = max_new_tokens, do_sample
        self.model = None
        self.tokenizer = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES

    def bind(self, model, tokenizer) -> None:
        """Generate with this model and tokenizer from now on."""
        self.model, self.tokenizer = model, tokenizer

    def sync_weights(self, trained) -> dict[str, float]:
        """After an update, bring the engine's weights up to date with ``trained``.

        When the engine generates with the trained module itself (one device, DDP)
        nothing moves; when it holds its own copy (FSDP2 shards the trained one),
        the weights are gathered and copied in size-bounded buckets.
        """
        if trained is self.model:
            return {}
        return sync_weights(trained, self.model, self.bucket_bytes)

    def with_options(self, **overrides) -> "HFRollout":
        """A copy with other sampling options (e.g. greedy validation), bound to the same model."""
        opts = dict(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_new_tokens=self.max_new_tokens, do_sample=self.do_sample,
        )
        clone = HFRollout(**{**opts, **overrides})
        clone.bind(self.model, self.tokenizer)
        return clone

    def _processors(self, prompt_len: int) -> tuple[LogitsProcessorList, _RecordLogProbs]:
        recorder = _RecordLogProbs(prompt_len)
        procs = []
        if self.do_sample and self.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(self.temperature))
        procs.append(recorder)
        if self.do_sample and self.top_k > 0:
            procs.append(TopKLogitsWarper(self.top_k))
        if self.do_sample and self.top_p < 1.0:
            procs.append(TopPLogitsWarper(self.top_p))
        return LogitsProcessorList(procs), recorder

    @torch.no_grad()
    def forward(self, batch: TensorDict) -> TensorDict:
        if self.model is None:
            raise RuntimeError("HFRollout has no model: call rollout.bind(model, tokenizer) (the Trainer does)")
        num_prompts = batch.batch_size[0]
        batch = batch.repeat_interleave(self.n, dim=0) if self.n > 1 else batch.clone(False)
        prompt_ids, prompt_mask = batch[K.PROMPT_IDS], batch[K.PROMPT_MASK]
        P = prompt_ids.shape[1]
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        config = GenerationConfig(
            max_new_tokens=self.max_new_tokens, do_sample=self.do_sample,
            temperature=None, top_k=None, top_p=None,  # ours, in _processors
            eos_token_id=eos, pad_token_id=pad, use_cache=True,
        )
        procs, recorder = self._processors(P)
        was_training = self.model.training
        self.model.eval()
        try:
            sequences = self.model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config, logits_processor=procs
            )
        finally:
            self.model.train(was_training)
        recorder.take(sequences)
        response = sequences[:, P:]
        R = response.shape[1]
        log_probs = torch.stack(recorder.chosen[:R], dim=1) if R else response.float()

        mask = response_mask_until_eos(response, eos)
        response = response.masked_fill(mask == 0, pad)
        batch[K.RESPONSE_IDS] = response
        batch[K.RESPONSE_MASK] = mask
        batch[K.ROLLOUT_LOG_PROBS] = log_probs * mask
        batch[K.GROUP] = torch.arange(num_prompts, device=response.device).repeat_interleave(self.n)
        texts = self.tokenizer.batch_decode(response, skip_special_tokens=True)
        batch[K.RESPONSE_TEXT] = NonTensorStack(*texts)
        return batch


def response_mask_until_eos(response: Tensor, eos_token_id: int | list[int] | None) -> Tensor:
    """1 on tokens up to and including the first EOS, 0 after it (``B x R`` int64)."""
    if eos_token_id is None:
        return torch.ones_like(response)
    eos_ids = torch.as_tensor(eos_token_id, device=response.device).reshape(-1)
    is_eos = torch.isin(response, eos_ids).long()
    # tokens strictly after the first EOS have a positive count of EOS before them
    after = (is_eos.cumsum(-1) - is_eos) > 0
    return (~after).long()
