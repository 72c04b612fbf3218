"""Qwen3.5 (Gated DeltaNet + gated attention) under the Megatron strategy, run on ranks forked by test_qwen3_5.py
(importing this module adds its scenarios to ``worker.SCENARIOS``):

- ``qwen3_5_convert``: a tiny Qwen3.5 built in code (a linear-attention layer, then a full-attention one) converted
  at the launch's tensor-parallel size against transformers: logits, log-probs, entropy, a teacher's top-k
  log-probs, every gradient, and the weights exported back under transformers' names (``worker.convert``);
  ``qwen3_5_moe_convert``: the same for Qwen3.5-MoE at expert parallel = the launch's size;
- ``qwen3_5_checkpoint``: a sharded checkpoint written at tensor parallel 2, loaded at pipeline parallel 2;
  ``qwen3_5_dist_ckpt``: the same with a Megatron dist checkpoint, loaded at pipeline parallel 2 and tensor parallel 1;
- ``qwen3_5_train_tp``: two GRPO steps of the Trainer at tensor parallel 2.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .worker import SCENARIOS, convert, world_size


def tiny_qwen3_5(common: dict, seed: int, moe: bool = False):
    """``Qwen3_5ForCausalLM`` (hidden 64, 4 heads of 16, a quarter of each rotated; Gated DeltaNet with 2 key and 4
    value heads of 16) with every norm weight drawn at random: transformers starts the zero-centred ones at 0 and
    the gated one at 1, where a norm taken for the other kind would go unnoticed."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    torch.manual_seed(seed)
    sizes = dict(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    if moe:
        common = {k: v for k, v in common.items() if k != "intermediate_size"}
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                           shared_expert_intermediate_size=48, **sizes, **common))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**sizes, **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):  # distinct router scores, open gates
                p.normal_(0, 0.5)
    return model


def qwen3_5_convert(out: Path, kind: str = "qwen3_5", **layout) -> dict:
    """``worker.convert`` for one Qwen3.5 model (at tensor parallel = the launch's size, or ``layout``)."""
    return convert(out, kinds=(kind,), **layout)[kind]


def qwen3_5_moe_convert(out: Path) -> dict:
    """``qwen3_5_convert`` for Qwen3.5-MoE (4 routed experts, top 2, and a gated shared expert per layer), with the
    experts split over the launch's ranks (expert parallel; tensor parallel 1)."""
    return qwen3_5_convert(out, "qwen3_5_moe", expert_parallel=world_size())


def qwen3_5_checkpoint(out: Path) -> dict:
    """One AdamW step at tensor parallel 2, saved with the strategy's sharded checkpoint (Gated DeltaNet's fused
    in_proj_qkv / conv1d saved whole: a rank's q | k | v blocks are not one shard of them), loaded at pipeline
    parallel 2 into a model with other weights: the log-probs are those of the model saved, and the loaded AdamW
    moments are the saved ones (compared in transformers' layout, gathered)."""
    import lightning_fabric as L

    from rlflow.models.logprobs import TokenLogProbs
    from rlflow.strategies.megatron import MegatronStrategy
    from rlflow.strategies.megatron.slots import lm_slots
    from rlflow.strategies.megatron.weight_buckets import gather_full

    from .worker import tiny_model

    torch.manual_seed(1)
    prompt_ids, response_ids = torch.randint(3, 40, (3, 6)), torch.randint(3, 47, (3, 5))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0
    prompt_ids[0, :2] = 0

    def setup(seed, **layout):
        fabric = L.Fabric(accelerator="cpu", devices=world_size(), strategy=MegatronStrategy(**layout))
        fabric.launch()
        module = fabric.setup_module(TokenLogProbs(tiny_model("qwen3_5", seed=seed)))
        return fabric, module, fabric.setup_optimizers(torch.optim.AdamW(module.parameters(), lr=1e-2))

    def moments(module, optimizer):  # exp_avg of this stage's transformers tensors, full
        slots = [s for s in lm_slots(module._forward_module.lm) if s.primary]
        full = gather_full(slots, [s.read([optimizer.state[p]["exp_avg"] for p in s.params]) for s in slots])
        return {s.name: t for s, t in zip(slots, full)}

    fabric, module, optimizer = setup(3, tensor_parallel=2)
    fabric.backward(module(prompt_ids, prompt_mask, response_ids)[0].sum())
    optimizer.step()
    with torch.no_grad():
        expected = module(prompt_ids, prompt_mask, response_ids)[0]
    saved = moments(module, optimizer)
    fabric.save(out / "qwen3_5_ckpt", {"model": module, "optimizer": optimizer})
    fabric.strategy.teardown()

    fabric, module, optimizer = setup(7, pipeline_parallel=2)
    fabric.backward(module(prompt_ids, prompt_mask, response_ids)[0].sum())  # AdamW state to load into
    optimizer.step()
    fabric.load(out / "qwen3_5_ckpt", {"model": module, "optimizer": optimizer})
    with torch.no_grad():
        got = module(prompt_ids, prompt_mask, response_ids)[0]
    loaded = moments(module, optimizer)
    fabric.strategy.teardown()
    return {"log_probs": (got - expected).abs().max().item(),
            "moments": max((loaded[n] - saved[n]).abs().max().item() for n in loaded),
            "moment_names": sorted(loaded), "sectioned": [n for n in loaded if "in_proj_qkv" in n or "conv1d" in n]}


def qwen3_5_dist_ckpt(out: Path) -> dict:
    """A Megatron dist checkpoint (verl's use_dist_checkpointing; megatron-core's own GatedDeltaNet sharding) written
    at tensor parallel 2, loaded at pipeline parallel 2 and at tensor parallel 1 into other weights: the log-probs
    are the saved model's."""
    import lightning_fabric as L

    from rlflow.models.logprobs import TokenLogProbs
    from rlflow.strategies.megatron import MegatronStrategy, dist_checkpoint

    from .worker import tiny_model

    folder = out / "qwen3_5_dist_ckpt"
    torch.manual_seed(1)
    prompt_ids, response_ids = torch.randint(3, 40, (3, 6)), torch.randint(3, 47, (3, 5))
    prompt_mask = torch.ones_like(prompt_ids)
    with torch.no_grad():
        expected, _ = TokenLogProbs(tiny_model("qwen3_5", seed=3))(prompt_ids, prompt_mask, response_ids)

    def fabric_for(**strategy):
        fabric = L.Fabric(accelerator="cpu", devices=world_size(), strategy=MegatronStrategy(**strategy))
        fabric.launch()
        return fabric

    fabric = fabric_for(tensor_parallel=2)
    dist_checkpoint.save(fabric.setup_module(TokenLogProbs(tiny_model("qwen3_5", seed=3)))._forward_module, folder)
    fabric.strategy.teardown()
    result = {}
    for name, layout in (("pp2", {"pipeline_parallel": 2}), ("tp1", {})):
        fabric = fabric_for(**layout, dist_checkpoints={"policy": str(folder)})
        module = fabric.setup_module(TokenLogProbs(tiny_model("qwen3_5", seed=7)))
        with torch.no_grad():
            result[name] = (module(prompt_ids, prompt_mask, response_ids)[0] - expected).abs().max().item()
        fabric.strategy.teardown()
    return result


def qwen3_5_train_tp(out: Path) -> dict:
    """Two GRPO steps of the Trainer with a Qwen3.5 policy at tensor parallel 2 (``worker.build``)."""
    from rlflow.strategies.megatron import MegatronStrategy

    from .worker import run_training

    return run_training(out / "qwen3_5_tp", MegatronStrategy(tensor_parallel=2), kind="qwen3_5", steps=2)


SCENARIOS.update({f.__name__: f for f in (qwen3_5_convert, qwen3_5_moe_convert, qwen3_5_checkpoint,
                                          qwen3_5_dist_ckpt, qwen3_5_train_tp)})
