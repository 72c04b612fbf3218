"""Qwen3.5 (Gated DeltaNet + gated attention) under the Megatron strategy, run on ranks forked by test_qwen3_5.py
(importing this module adds its scenarios to ``worker.SCENARIOS``):

- ``qwen3_5_convert``: a tiny Qwen3.5 built in code (a linear-attention layer, then a full-attention one) converted
  at the launch's tensor-parallel size against transformers: logits, log-probs, entropy, a teacher's top-k
  log-probs, every gradient, and the weights exported back under transformers' names (``worker.compare``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .worker import SCENARIOS, compare, world_size


def tiny_qwen3_5(common: dict, seed: int):
    """``Qwen3_5ForCausalLM`` (hidden 64, 4 heads of 16, a quarter of each rotated; Gated DeltaNet with 2 key and 4
    value heads of 16) with every norm weight drawn at random: transformers starts the zero-centred ones at 0 and
    the gated one at 1, where a norm taken for the other kind would go unnoticed."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(head_dim=16, layer_types=["linear_attention", "full_attention"],
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                               linear_value_head_dim=16, linear_conv_kernel_dim=4, **common)
    model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def qwen3_5_convert(out: Path) -> dict:
    import lightning as L

    from rlflow.strategies.megatron import MegatronStrategy

    fabric = L.Fabric(accelerator="cpu", devices=world_size(), strategy=MegatronStrategy(tensor_parallel=world_size()))
    fabric.launch()
    torch.manual_seed(1)
    prompt_ids = torch.randint(3, 40, (3, 6))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0  # left padding
    prompt_ids[0, :2] = 0
    response_ids = torch.randint(3, 47, (3, 5))
    topk_ids = torch.randint(0, 47, (3, 5, 4))
    result = compare(fabric, "qwen3_5", prompt_ids, prompt_mask, response_ids, torch.randn(3, 5, 6), topk_ids)
    fabric.strategy.teardown()
    return result


SCENARIOS.update({f.__name__: f for f in (qwen3_5_convert,)})
