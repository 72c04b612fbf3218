"""LoRA and MoE routing-replay scenarios of the Megatron strategy, run on ranks forked by test_lora.py and
test_router_replay.py (importing this module adds them to ``worker.SCENARIOS``):

- ``lora_tp``: a PEFT LoRA policy converted at tensor parallel 2 against PEFT (log-probs, adapter gradients, the
  adapter-disabled reference, merged weights); ``lora_train_tp``, ``lora_train_pp``, ``lora_critic_tp``: GRPO / PPO
  steps with LoRA; ``lora_verl``: verl's ``model.lora.*`` block through ``main_ppo``.
- ``moe_replay``: MoE routing replay (R2) at expert parallel 2, with and without, and in the Trainer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlflow.models.logprobs import TokenLogProbs

from .routing_scenarios import replay_steps
from .worker import SCENARIOS, lora_config, run_training, tiny_model, world_size


def lora_tp(out: Path) -> dict:
    """A PEFT LoRA policy at tensor parallel 2 against the same PEFT model on one process: log-probs, entropy and
    the adapter's gradients (under PEFT's names, gathered); no gradient on the base weights; the reference (adapter
    off) equal to the base model's log-probs; the merged weights equal PEFT's merge_and_unload."""
    import lightning_fabric as L
    from peft import get_peft_model

    from rlflow.models.lora import merged_copy
    from rlflow.strategies.megatron import MegatronStrategy
    from rlflow.strategies.megatron.grads import reduce_gradients
    from rlflow.strategies.megatron.slots import lm_slots
    from rlflow.strategies.megatron.weight_buckets import gather_full

    world = world_size()
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=MegatronStrategy(tensor_parallel=world))
    fabric.launch()

    def peft_model():
        model = get_peft_model(tiny_model("qwen2", seed=3), lora_config())
        torch.manual_seed(4)
        with torch.no_grad():  # B starts at zero: give it values, so that the adapter changes the outputs
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.2)
        return model

    torch.manual_seed(1)
    prompt_ids, response_ids = torch.randint(3, 40, (3, 6)), torch.randint(3, 47, (3, 5))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0
    weights = torch.randn(3, 5, 2)
    hf = peft_model()
    lp, ent = TokenLogProbs(hf)(prompt_ids, prompt_mask, response_ids)
    ((lp * weights[..., 0]).sum() + (ent * weights[..., 1]).sum()).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.requires_grad}
    with torch.no_grad(), hf.disable_adapter():
        base_lp, _ = TokenLogProbs(hf)(prompt_ids, prompt_mask, response_ids)
    merged = dict(merged_copy(hf).named_parameters())

    shell = peft_model()
    module = fabric.setup_module(TokenLogProbs(shell))
    lp2, ent2 = module(prompt_ids, prompt_mask, response_ids)
    fabric.backward((lp2 * weights[..., 0]).sum() + (ent2 * weights[..., 1]).sum())
    megatron = module._forward_module
    trainable = [p for p in megatron.parameters() if p.requires_grad]
    reduce_gradients(trainable)
    for p in trainable:
        p.grad.mul_(world)
    slots = [s for s in lm_slots(megatron.lm) if ".lora_" in s.name]
    grads = dict(zip((s.name for s in slots), gather_full(slots, [s.read([p.grad for p in s.params]) for s in slots])))
    with torch.no_grad(), shell.disable_adapter():
        ref_lp, _ = module(prompt_ids, prompt_mask, response_ids)
    exported = {n: t.clone() for b in shell.weight_buckets(4096) for n, t in b}
    only = {n for b in shell.weight_buckets(4096, only_adapted=True) for n, _ in b}
    fabric.strategy.teardown()
    return {
        "log_probs": (lp2 - lp).abs().max().item(), "entropy": (ent2 - ent).abs().max().item(),
        "adapter_effect": (lp - base_lp).abs().max().item(),
        "grad_names": sorted(grads) == sorted(hf_grads), "trainable": len(trainable) == len(hf_grads),
        "grad": max((grads[n] - g).abs().max().item() for n, g in hf_grads.items()),
        "grad_scale": max(g.abs().max().item() for g in hf_grads.values()),
        "base_grads": [n for n, p in megatron.named_parameters() if not p.requires_grad and p.grad is not None],
        "reference": (ref_lp - base_lp).abs().max().item(),
        "exported_names": sorted(exported) == sorted(merged),
        "exported": max((exported[n] - p).abs().max().item() for n, p in merged.items()),
        "only_adapted": sorted(only),
    }


def lora_train_tp(out: Path) -> dict:
    from rlflow.strategies.megatron import MegatronStrategy

    return run_training(out / "lora", MegatronStrategy(tensor_parallel=2), steps=2, lora=True)


def lora_train_pp(out: Path) -> dict:
    from rlflow.strategies.megatron import MegatronStrategy

    return run_training(out / "lora_pp", MegatronStrategy(pipeline_parallel=2), steps=2, lora=True)


def lora_critic_tp(out: Path) -> dict:
    """PPO with a LoRA critic (its adapter and value head train) at tensor parallel 2."""
    from rlflow.strategies.megatron import MegatronStrategy

    return run_training(out / "lora_critic", MegatronStrategy(tensor_parallel=2), steps=2, critic=True,
                        critic_lora=True)


def moe_replay(out: Path) -> dict:
    """MoE routing replay (R2) at expert parallel 2 on a Qwen3-MoE-shaped model: a pass without gradients records the
    routing; after the router weights change, a pass with gradients (its rows in another order) routes as recorded,
    while the same pass without replay routes otherwise."""
    import lightning_fabric as L

    from rlflow.strategies.megatron import MegatronStrategy

    world = world_size()

    def choices(module):  # each MoE layer's experts per token, from the router's routing map (tokens x experts)
        seen = []
        hooks = [layer.mlp.router.register_forward_hook(lambda m, a, o: seen.append(o[1].clone()))
                 for layer in module._forward_module.lm.gpt.decoder.layers]
        return seen, hooks

    torch.manual_seed(1)
    prompt_ids, response_ids = torch.randint(3, 40, (4, 6)), torch.randint(3, 47, (4, 5))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0
    result = {}
    for replay in (True, False):
        fabric = L.Fabric(accelerator="cpu", devices=world,
                          strategy=MegatronStrategy(expert_parallel=world, router_replay=replay))
        fabric.launch()
        module = fabric.setup_module(TokenLogProbs(tiny_model("qwen3_moe", seed=3)))
        seen, hooks = choices(module)
        with torch.no_grad():
            old, _ = module(prompt_ids, prompt_mask, response_ids)
        recorded = [m for m in seen]
        with torch.no_grad():  # the update's weights differ: here, the routers'
            for layer in module._forward_module.lm.gpt.decoder.layers:
                layer.mlp.router.weight.normal_(0, 0.5)
        seen.clear()
        order = torch.tensor([2, 0, 3, 1])  # another order of the rows, as a shuffled mini-batch has
        lp, _ = module(prompt_ids[order], prompt_mask[order], response_ids[order])
        fabric.backward(lp.sum())
        for h in hooks:
            h.remove()
        # the tokens' routing in the update, back in the recording pass's row order, at the real positions
        S0 = recorded[0].shape[0] // prompt_ids.shape[0]
        same = []
        for before, after in zip(recorded, seen):
            E = before.shape[-1]
            b = before.view(S0, -1, E)[:, : prompt_ids.shape[0]]
            a = after.view(-1, order.numel(), E)[:, torch.argsort(order)]
            real = (prompt_mask.sum(-1) + response_ids.shape[1]).tolist()
            same.append(all(torch.equal(b[:n, i], a[:n, i]) for i, n in enumerate(real)))
        result["replay" if replay else "plain"] = {"same": same, "old": old, "grads": any(
            p.grad is not None and p.grad.abs().sum() > 0 for p in module._forward_module.parameters())}
        fabric.strategy.teardown()
    result["trainer"] = replay_steps(out / "replay", MegatronStrategy(expert_parallel=world, router_replay=True))
    return result


def lora_verl(out: Path) -> dict:
    """verl's Megatron LoRA block through ``main_ppo`` at tensor parallel 2: a step, checkpointed, then resumed for a
    second; the adapter trains and the checkpoint holds its factors under PEFT's names."""
    from rlflow.config.verl.run import main

    base = [f"data.train_files={out}/verl/train.parquet", f"actor_rollout_ref.model.path={out}/verl/model",
            "trainer.device=cpu", "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=megatron",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "actor_rollout_ref.model.lora.rank=4",
            "actor_rollout_ref.model.lora.alpha=8", "actor_rollout_ref.actor.use_kl_loss=true",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
            "data.max_prompt_length=8", "data.max_response_length=4", f"trainer.default_local_dir={out}/verl/lora",
            "trainer.logger=[console]", "algorithm.adv_estimator=grpo", "trainer.save_freq=1",
            "trainer.val_before_train=false", "trainer.resume_mode=auto"]
    codes = (main(base + ["trainer.total_training_steps=1"]), main(base + ["trainer.total_training_steps=2"]))
    import torch.distributed.checkpoint as dcp

    keys = list(dcp.FileSystemReader(str(out / "verl/lora/global_step_2/state.ckpt")).read_metadata().state_dict_metadata)
    return {"codes": codes, "steps": sorted(p.name for p in (out / "verl/lora").glob("global_step_*")),
            "factors": sorted(k for k in keys if ".lora_" in k and k.startswith("policy."))}


SCENARIOS.update({f.__name__: f for f in (lora_tp, lora_train_tp, lora_train_pp, lora_critic_tp, moe_replay,
                                          lora_verl)})
