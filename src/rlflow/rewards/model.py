"""Reward models: a Hugging Face sequence-classification model with a scalar head scores prompt + response.

verl: ``reward_model.enable=True``, ``reward_model.model.path`` (loaded as a sequence/token
classification model with one label), ``micro_batch_size_per_gpu``, ``max_length`` and
``model.input_tokenizer`` (non-null: decode with the policy's tokenizer and re-encode the chat with the
reward model's own chat template; null: the reward model reads the policy's token ids as they are).

The score of a sample is the head's output at the **last token** of prompt + response (verl reads its
token-classification logits at the last position of the attention mask; Hugging Face's
sequence-classification pooling is the same read at the last non-pad token). It is placed on the
sample's last response token like every reward (``token_rewards``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from rlflow.data import keys as K
from rlflow.rewards.base import Reward, column
from rlflow.rewards.overlong import response_lengths

TRUNCATION = ("left", "right", "error")


class ScalarHead(nn.Module):
    """``forward(input_ids, attention_mask) -> [B]``: the classification head read at each row's last token.

    Rows are right-padded (``attention_mask`` 1 then 0). For decoder models with a ``score`` head
    (Llama, Qwen2, Mistral, Gemma, ...) only the backbone runs over all tokens and the head over one
    position per row; other models run whole and their own pooling is used (``logits[:, 0]``).
    Being a module whose forward is the whole computation lets FSDP2 shard it like the policy.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        labels = getattr(getattr(model, "config", None), "num_labels", 1)
        if labels != 1:
            raise ValueError(f"a reward model needs a scalar head (num_labels=1), this one has {labels} labels")

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        last = attention_mask.sum(-1).clamp_min(1) - 1
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        head = getattr(self.model, "score", None)
        backbone = getattr(self.model, "base_model", None)
        if isinstance(head, nn.Module) and backbone is not None and backbone is not self.model:
            hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
            return head(hidden[rows, last]).squeeze(-1).float()
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits[:, 0].float() if logits.dim() == 2 else logits[rows, last, 0].float()


class ModelReward(Reward):
    """Scores samples with a reward model, micro-batched, without gradients.

    Args:
        model: a ``*ForSequenceClassification`` model with ``num_labels=1`` (or any model whose
            ``score`` head maps hidden states to one number).
        tokenizer: the reward model's tokenizer. Given: prompt + response are re-encoded with it (the
            prompt's chat messages, ``raw_prompt``, plus ``{"role": "assistant", "content": response}``
            through its chat template, or prompt text + response text without one). ``None``: the
            reward model reads the policy's token ids (its vocabulary must be the policy's).
        micro_batch_size: rows per forward pass (``None``: the whole batch at once).
        max_length: the longest input in tokens; longer ones are cut by ``truncation`` and counted in
            ``reward/truncated``. ``None``: no limit.
        truncation: ``"left"`` (keep the end, where the score is read; default), ``"right"``, ``"error"``.
        shard: under a sharding strategy (FSDP2), shard the reward model across processes (default); False
            keeps a full copy per process (no collectives: use it with rollouts that score a different
            number of batches per process, such as dynamic sampling).
        name: the name in metrics and messages.

    ``stats``: ``reward/truncated`` (inputs cut this batch) besides the base counters.
    """

    thread_safe = False  # a sharded forward is collective: it runs on the calling thread

    def __init__(self, model: nn.Module, tokenizer=None, *, micro_batch_size: int | None = None,
                 max_length: int | None = None, truncation: str = "left", shard: bool = True,
                 name: str = "reward_model"):
        super().__init__()
        if truncation not in TRUNCATION:
            raise ValueError(f"truncation must be one of {TRUNCATION}, got {truncation!r}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or None, got {micro_batch_size}")
        if max_length is not None and max_length < 2:
            raise ValueError(f"max_length must be >= 2 or None, got {max_length}")
        model.eval().requires_grad_(False)
        self.module: nn.Module = ScalarHead(model)
        self.model, self.tokenizer = model, tokenizer
        self.micro_batch_size, self.max_length, self.truncation = micro_batch_size, max_length, truncation
        self.shard, self.name, self.fabric = shard, name, None
        keys = (K.RESPONSE_MASK,) + ((K.RAW_PROMPT, K.RESPONSE_TEXT) if tokenizer is not None else
                                     (K.PROMPT_IDS, K.PROMPT_MASK, K.RESPONSE_IDS))
        self.in_keys = keys

    @classmethod
    def from_pretrained(cls, path: str | Path, *, reencode: bool = True, trust_remote_code: bool = False,
                        **kwargs) -> "ModelReward":
        """Load a local model folder (weights, config, tokenizer); ``reencode=False`` reads the policy's ids;
        ``trust_remote_code``: run the folder's own model code (transformers' switch, off by default)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        trust = {"trust_remote_code": trust_remote_code}
        model = AutoModelForSequenceClassification.from_pretrained(path, **trust)
        tokenizer = AutoTokenizer.from_pretrained(path, **trust) if reencode else None
        return cls(model, tokenizer, **kwargs)

    def __repr__(self) -> str:
        kind = type(self.model).__name__
        source = "its own tokenizer" if self.tokenizer is not None else "the policy's token ids"
        return f"ModelReward({kind}, reads {source}, micro_batch_size={self.micro_batch_size})"

    # ------------------------------------------------------------------ placement
    def setup(self, fabric) -> None:
        """Place the model as the policy is placed: sharded by FSDP2 (``shard=True``), else on the device.

        The Trainer calls it once when it is built (DDP needs no wrapper: nothing is trained).
        """
        from rlflow.strategies import shards_parameters

        self.fabric = fabric
        if self.shard and shards_parameters(fabric.strategy):
            self.module = fabric.setup_module(self.module)
        else:
            self.module = fabric.to_device(self.module)

    def _sharded(self) -> bool:
        if self.fabric is None or not self.shard:
            return False
        from rlflow.strategies import shards_parameters

        return shards_parameters(self.fabric.strategy) and self.fabric.world_size > 1

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def score(self, batch: TensorDict) -> Tensor:
        self.stats["reward/truncated"] = 0.0
        sequences = self._reencoded(batch) if self.tokenizer is not None else self._policy_ids(batch)
        sequences = [self._truncate(seq, i, batch) for i, seq in enumerate(sequences)]
        size = self.micro_batch_size or max(1, len(sequences))
        chunks = [sequences[i : i + size] for i in range(0, len(sequences), size)]
        if self._sharded():  # every rank must run the same number of (collective) forward passes
            count = torch.tensor([len(chunks)], device=self.fabric.device)
            self.fabric.strategy.all_reduce(count, reduce_op="max")
            chunks += [[[self._pad_id()]]] * (int(count.item()) - len(chunks))
        device = next(self.module.parameters()).device
        scores = [self._forward(chunk, device) for chunk in chunks]
        return torch.cat(scores)[: len(sequences)].cpu() if scores else torch.zeros(0)

    def _forward(self, chunk: Sequence[list[int]], device) -> Tensor:
        length = max(len(s) for s in chunk)
        pad = self._pad_id()
        ids = torch.tensor([s + [pad] * (length - len(s)) for s in chunk], dtype=torch.long, device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (length - len(s)) for s in chunk], dtype=torch.long, device=device)
        return self.module(ids, mask)

    def _pad_id(self) -> int:
        for source in (self.tokenizer, getattr(self.model, "config", None)):
            pad = getattr(source, "pad_token_id", None)
            if pad is not None:
                return int(pad)
        return 0

    def _policy_ids(self, batch: TensorDict) -> list[list[int]]:
        """Prompt tokens then response tokens up to the last valid one (tool tokens inside included)."""
        prompt_ids, prompt_mask = batch[K.PROMPT_IDS].cpu(), batch[K.PROMPT_MASK].cpu().bool()
        response_ids, lengths = batch[K.RESPONSE_IDS].cpu(), response_lengths(batch[K.RESPONSE_MASK]).cpu()
        out = [p[m].tolist() + r[:n].tolist() for p, m, r, n in zip(prompt_ids, prompt_mask, response_ids, lengths)]
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        too_big = [i for i, s in enumerate(out) if vocab is not None and s and max(s) >= vocab]
        if too_big:
            raise ValueError(f"{self.name}: row {too_big[0]} holds token ids >= the reward model's vocabulary "
                             f"({vocab}): it does not share the policy's tokenizer. Pass its tokenizer "
                             "(ModelReward(model, tokenizer)) to re-encode (verl: reward_model.model.input_tokenizer)")
        return out

    def _reencoded(self, batch: TensorDict) -> list[list[int]]:
        """Each sample as the reward model's tokenizer (and chat template) writes prompt + response."""
        tok, texts = self.tokenizer, column(batch, K.RESPONSE_TEXT)
        out = []
        for prompt, response in zip(column(batch, K.RAW_PROMPT), texts):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
            if getattr(tok, "chat_template", None):
                chat = [*messages, {"role": "assistant", "content": response}]
                text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
                out.append(tok(text, add_special_tokens=False)["input_ids"])
            else:  # no template: the prompt's text, then the response
                text = "\n".join(m["content"] for m in messages) if isinstance(prompt, list) else str(prompt)
                out.append(tok(text + response, add_special_tokens=True)["input_ids"])
        return out

    def _truncate(self, seq: list[int], row: int, batch: TensorDict) -> list[int]:
        if not seq:
            return [self._pad_id()]
        if self.max_length is None or len(seq) <= self.max_length:
            return seq
        if self.truncation == "error":
            source = column(batch, K.DATA_SOURCE)[row] if K.DATA_SOURCE in batch.keys() else None
            raise ValueError(f"{self.name}: row {row} (data_source={source!r}) has {len(seq)} tokens > "
                             f"max_length={self.max_length} (truncation='error')")
        self.stats["reward/truncated"] += 1
        return seq[-self.max_length:] if self.truncation == "left" else seq[: self.max_length]


def preference_loss(chosen: Tensor, rejected: Tensor) -> Tensor:
    """Bradley-Terry loss of a reward model on preference pairs: ``mean(-log sigmoid(r_chosen - r_rejected))``.

    ``chosen``, ``rejected``: ``[N]`` scores of the preferred and the other response of each pair.
    """
    return -torch.nn.functional.logsigmoid(chosen - rejected).mean()
