"""Tiny models and tokenizers built in code: nothing is downloaded.

Used by the default job, the tests and the notebooks. The tokenizer is
character-level over a small alphabet, wrapped as a regular
``PreTrainedTokenizerFast`` so every code path is the one real models take.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
DEFAULT_ALPHABET = string.digits + "+-*=?: abcdefghijklmnopqrstuvwxyz#"


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character of ``alphabet``, plus pad/bos/eos.

    Prompts are left-padded, as generation needs.
    """
    vocab = {PAD: 0, BOS: 1, EOS: 2}
    for ch in dict.fromkeys(alphabet):  # keep order, drop repeats
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, padding_side="left"
    )
    return fast


def _config(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_positions,
            pad_token_id, bos_token_id, eos_token_id, **extra) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size, max_position_embeddings=max_positions,
        pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **extra,
    )


def tiny_qwen2_reward_model(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_positions: int = 64,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    seed: int | None = None,
) -> Qwen2ForSequenceClassification:
    """A randomly initialised Qwen2 reward model: ``Qwen2ForSequenceClassification`` with one label."""
    config = _config(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_positions,
                     pad_token_id, bos_token_id, eos_token_id, num_labels=1)
    if seed is not None:
        torch.manual_seed(seed)
    return Qwen2ForSequenceClassification(config)


def tiny_qwen2(
    vocab_size: int,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_positions: int = 64,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    seed: int | None = None,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM (about 0.5M parameters at the defaults)."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    if seed is not None:
        torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)
