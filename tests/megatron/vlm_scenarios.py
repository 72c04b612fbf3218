"""Vision-language models (tiny Qwen2.5-VL and Qwen3.5) under the Megatron strategy, run on ranks forked by
test_vlm.py (importing this module adds its scenarios to ``worker.SCENARIOS``):

- ``vlm_convert``: Qwen2.5-VL and Qwen3.5 converted at tensor parallel = the launch's size (the language model split,
  the vision tower whole on every rank) against transformers on a batch with images (one, two of different sizes,
  none): log-probs, entropy and every gradient, the tower's included; the weights sent to the engines under
  transformers' names; ``vlm_convert_pp``: the same for Qwen2.5-VL at pipeline parallel = the launch's size (the
  tower and its gradients on the first stage);
- ``vlm_train``: one GRPO step of the Trainer at data parallel = the launch's size (micro-batches of one sample,
  half of them without an image: the tower's gradients reduced over the replicas), checkpointed; its metrics and
  weights, compared by the test with one process.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from .worker import SCENARIOS, full_weights, world_size


def tiny_qwen3_5_vl(tokenizer, seed: int):
    """``Qwen3_5ForConditionalGeneration``: the language model of ``qwen3_5_scenarios.tiny_qwen3_5`` (a Gated DeltaNet
    layer, then a gated-attention one rotating half of each head, its norms drawn at random) with 3-D positions in
    interleaved sections, and a 2-block vision tower (learned position embeddings) whose patches are the tiny
    processor's (14 x 14, 2 frames)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from rlflow.models.tiny_vlm import _vision_token_ids

    torch.manual_seed(seed)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision,
                                                          tie_word_embeddings=False, **_vision_token_ids(tokenizer)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def vlm_batch(kind: str, seed: int = 0):
    """``(model, multi_modal rows, prompt ids, prompt mask, response ids)``: a tiny VLM of ``kind`` (Qwen2.5-VL with
    4 heads and 2 key/value heads, or Qwen3.5: they split over 2 ranks) and its processor's rows (one image, two of
    different sizes, none, a wide one) with sampled-looking responses."""
    from rlflow.data import keys as K

    from ..vlm import batch, tiny_vlm

    model, processor = tiny_vlm("qwen2_5_vl", seed=seed)
    if kind == "qwen3_5":
        model = tiny_qwen3_5_vl(processor.tokenizer, seed)
    data = batch(processor)
    torch.manual_seed(1)
    response_ids = torch.randint(3, 40, (data[K.PROMPT_IDS].shape[0], 5))
    return model, list(data[K.MULTI_MODAL_INPUTS]), data[K.PROMPT_IDS], data[K.PROMPT_MASK], response_ids


def vlm_convert(out: Path, kinds=("qwen2_5_vl", "qwen3_5"), **layout) -> dict:
    import lightning_fabric as L

    from rlflow.strategies.megatron import MegatronStrategy

    world = world_size()
    strategy = MegatronStrategy(**(layout or {"tensor_parallel": world}))
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    results = {kind: compare(fabric, kind) for kind in kinds}
    fabric.strategy.teardown()
    return results


def vlm_convert_pp(out: Path) -> dict:
    """``vlm_convert`` of Qwen2.5-VL at pipeline parallel = the launch's size: the tower on the first stage only."""
    return vlm_convert(out, ("qwen2_5_vl",), pipeline_parallel=world_size())


def compare(fabric, kind: str) -> dict:
    from megatron.core import parallel_state as ps

    from rlflow.models.logprobs import TokenLogProbs
    from rlflow.strategies.megatron.grads import reduce_gradients
    from rlflow.strategies.megatron.slots import lm_slots
    from rlflow.strategies.megatron.weight_buckets import gather_full

    world = world_size()
    hf, rows, prompt_ids, prompt_mask, response_ids = vlm_batch(kind)
    weights = torch.randn(*response_ids.shape, 2)
    lp, ent = TokenLogProbs(hf)(prompt_ids, prompt_mask, response_ids, multi_modal=rows)
    ((lp * weights[..., 0]).sum() + (ent * weights[..., 1]).sum()).backward()
    hf_grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    shell = vlm_batch(kind)[0]
    module = fabric.setup_module(TokenLogProbs(shell))
    exported = {n: t.clone() for b in shell.weight_buckets(4096) for n, t in b}
    lp2, ent2 = module(prompt_ids, prompt_mask, response_ids, multi_modal=rows)
    fabric.backward((lp2 * weights[..., 0]).sum() + (ent2 * weights[..., 1]).sum())
    megatron = module._forward_module
    reduce_gradients(list(megatron.parameters()))  # divides by the world size: one replica here
    for p in megatron.parameters():
        p.grad.mul_(world // ps.get_data_parallel_world_size())  # one replica per data-parallel rank
    slots = [s for s in lm_slots(megatron.lm) if s.primary]  # this pipeline stage's
    grads = gather_full(slots, [s.read([p.grad for p in s.params]) for s in slots])
    stages = [None] * world  # every stage's (names, largest difference, largest tower gradient)
    dist.all_gather_object(stages, ([s.name for s in slots],
                                    max((g - hf_grads[s.name]).abs().max().item() for s, g in zip(slots, grads)),
                                    max([g.abs().max().item() for s, g in zip(slots, grads)
                                         if s.name.startswith("model.visual.")], default=0.0)))
    return {
        "log_probs": (lp2 - lp).abs().max().item(), "entropy": (ent2 - ent).abs().max().item(),
        "log_probs_scale": lp.abs().max().item(),
        "grad": max(gap for _, gap, _ in stages), "grad_scale": max(g.abs().max().item() for g in hf_grads.values()),
        "grad_names": sorted({n for names, _, _ in stages for n in names}) == sorted(hf_grads),
        "tower_grad": max(tower for _, _, tower in stages),
        "exported_names": sorted(exported) == sorted(n for n, _ in hf.named_parameters()),
        "exported": max((exported[n] - p).abs().max().item() for n, p in hf.named_parameters()),
        "layout": (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()),
    }


def vlm_train(out: Path) -> dict:
    from rlflow.strategies.megatron import MegatronStrategy

    from ..distributed.vision_worker import build

    trainer, data, record = build(str(out / "vlm_train"), MegatronStrategy(), world_size())
    trainer.fit(data)
    engine = dict(trainer.rollout.model.named_parameters(remove_duplicate=False))  # a full copy (ModelParallelStrategy)
    synced = max((engine[n].detach() - w).abs().max().item() for n, w in full_weights(trainer).items())
    checkpoint = trainer.save()  # RUN/global_step_1
    dist.barrier()
    trainer.fabric.strategy.teardown()
    return {"steps": record.steps, "checkpoint": str(checkpoint), "engine_diff": synced}


SCENARIOS.update({f.__name__: f for f in (vlm_convert, vlm_convert_pp, vlm_train)})
