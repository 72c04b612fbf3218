"""MoE routing replay from the rollout (verl's R3) on ranks forked by test_router_replay.py (importing this module
adds ``moe_rollout_replay`` to ``worker.SCENARIOS``)."""

from __future__ import annotations

from pathlib import Path

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.models.logprobs import TokenLogProbs

from .worker import SCENARIOS, build, char_tokenizer, tiny_model, world_size

Tensor = torch.Tensor


def expected_experts(batch: TensorDict, layer: int) -> list[tuple[int, int, Tensor]]:
    """``(row, decoder position, the rollout's k experts)`` of every token the rollout routed: each row's real prompt
    tokens come first (position ``0..p-1``), then its response."""
    P = batch[K.PROMPT_IDS].shape[1]
    out = []
    for row in range(batch.batch_size[0]):
        real = int(batch[K.PROMPT_MASK][row].sum())
        columns = torch.cat([batch[K.PROMPT_ROUTED_EXPERTS][row, P - real :], batch[K.ROUTED_EXPERTS][row]])
        out += [(row, pos, experts[layer]) for pos, experts in enumerate(columns) if experts[layer, 0] >= 0]
    return out


def moe_rollout_replay(out: Path) -> dict:
    """An HF rollout of a Qwen3-MoE-shaped model records its routing; the Megatron policy (expert parallel 2), its
    routers then changed, scores the rows in another order with gradients: with R3 every routed token goes to the
    rollout's experts, without replay not; at pipeline parallel 2 (no gradients) each stage's layer replays its own
    part. Then two GRPO steps in the Trainer with R3."""
    import lightning_fabric as L
    import torch.distributed as dist

    from rlflow.rollout import HFRollout
    from rlflow.strategies.megatron import MegatronStrategy

    world = world_size()
    tok = char_tokenizer()
    torch.manual_seed(1)
    prompt_ids = torch.randint(3, 40, (3, 6))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_ids[0, :2], prompt_mask[0, :2] = tok.pad_token_id, 0
    rollout = HFRollout(n=2, max_new_tokens=5, seed=0, return_routed_experts=True)
    rollout.bind(tiny_model("qwen3_moe", seed=3), tok)
    batch = rollout(TensorDict({K.PROMPT_IDS: prompt_ids, K.PROMPT_MASK: prompt_mask}, batch_size=[3]))
    order = torch.tensor([4, 0, 5, 2, 1, 3])  # another order of the rows, as a shuffled mini-batch has
    shuffled = batch[order]
    result = {"unrouted": int((batch[K.ROUTED_EXPERTS][..., 0] < 0).sum())}
    runs = {"R3": dict(expert_parallel=world, router_replay="R3"), "plain": dict(expert_parallel=world),
            # pipeline parallel: each stage replays its own layer's routing (the old-log-prob pass, no gradients)
            "R3_pp": dict(pipeline_parallel=world, router_replay="R3")}
    for name, options in runs.items():
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=MegatronStrategy(**options))
        fabric.launch()
        module = fabric.setup_module(TokenLogProbs(tiny_model("qwen3_moe", seed=3)))
        layers = module._forward_module.lm.gpt.decoder.layers
        with torch.no_grad():  # the update's weights differ from the rollout's: here, the routers' (the same on
            torch.manual_seed(7)  # every rank: each stage takes its layers' draws)
            drawn = [torch.empty_like(layers[0].mlp.router.weight).normal_(0, 0.5) for _ in range(2)]
            for layer in layers:
                layer.mlp.router.weight.copy_(drawn[layer.layer_number - 1])
        seen = []
        hooks = [layer.mlp.router.register_forward_hook(lambda m, a, o: seen.append(o[1].clone())) for layer in layers]
        routing = (shuffled[K.PROMPT_ROUTED_EXPERTS], shuffled[K.ROUTED_EXPERTS])
        grad = name != "R3_pp"
        with torch.set_grad_enabled(grad):
            lp, _ = module(shuffled[K.PROMPT_IDS], shuffled[K.PROMPT_MASK], shuffled[K.RESPONSE_IDS],
                           routed_experts=routing if options.get("router_replay") else None)
        if grad:
            fabric.backward(lp.sum())
        for h in hooks:
            h.remove()
        mine = {}
        for layer, routing_map in zip(layers, seen):  # (S x B') x experts, as the router saw the tokens
            chosen = routing_map.view(-1, order.numel(), routing_map.shape[-1])
            expected = expected_experts(shuffled, layer.layer_number - 1)
            mine[layer.layer_number - 1] = (len(expected), all(
                set(chosen[pos, row].nonzero().flatten().tolist()) == set(experts.tolist())
                for row, pos, experts in expected))
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        merged = dict(sorted({k: v for ranks in everyone for k, v in ranks.items()}.items()))
        result[name] = {"same": [same for _, same in merged.values()], "tokens": sum(n for n, _ in merged.values()),
                        "grads": grad and any(p.grad is not None and p.grad.abs().sum() > 0
                                              for p in module._forward_module.parameters())}
        fabric.strategy.teardown()
    result["trainer"] = replay_steps(out / "rollout_replay", MegatronStrategy(expert_parallel=world,
                                     router_replay="R3"), routing=True)
    return result


def replay_steps(folder: Path, strategy, routing: bool = False) -> dict:
    """Two GRPO steps of the Qwen3-MoE-shaped model in the Trainer (two mini-batches per step, so the second update
    runs on weights the first changed): the policy's routing-replay counts and the gradient norms."""
    trainer, data, record = build(str(folder), strategy, devices=world_size(), kind="qwen3_moe", steps=2,
                                  routing=routing)
    trainer.fit(data)
    out = {"counts": trainer.policy.module._forward_module.lm.routing_replay.counts,
           "grad_norm": [record.steps[s]["metrics"]["actor/grad_norm"] for s in (1, 2)] if record.steps else None}
    trainer.fabric.strategy.teardown()
    return out


def verl_moe_inputs(folder: Path) -> None:
    """The Qwen3-MoE-shaped model's folder (with a chat template) and prompts in verl's layout, for ``moe_r3_verl``."""
    import pandas as pd

    from ..config.conftest import CHAT_TEMPLATE, verl_rows

    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tiny_model("qwen3_moe", seed=3).save_pretrained(folder / "model")
    tok.save_pretrained(folder / "model")
    pd.DataFrame(verl_rows(16, "train", 0)).to_parquet(folder / "train.parquet")


def moe_r3_verl(out: Path) -> dict:
    """verl's R3 keys through ``main_ppo`` at expert parallel 2 (rollout.name=hf): a GRPO step with two mini-batches.
    Its update would stop on a batch without the rollout's routing (R3 replays it in every pass with gradients)."""
    from rlflow.config.verl.run import main

    verl = out / "verl_moe"
    code = main([f"data.train_files={verl}/train.parquet", f"actor_rollout_ref.model.path={verl}/model",
                 "trainer.device=cpu", "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=megatron",
                 "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                 "actor_rollout_ref.actor.megatron.router_replay.mode=R3",
                 "actor_rollout_ref.rollout.enable_rollout_routing_replay=True", "actor_rollout_ref.rollout.name=hf",
                 "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                 "actor_rollout_ref.rollout.n=2", "data.max_prompt_length=8", "data.max_response_length=4",
                 f"trainer.default_local_dir={verl}/run", "trainer.logger=[console]", "algorithm.adv_estimator=grpo",
                 "trainer.val_before_train=false", "trainer.total_training_steps=1", "trainer.save_freq=-1"])
    return {"code": code}


SCENARIOS.update({"moe_rollout_replay": moe_rollout_replay, "moe_r3_verl": moe_r3_verl})
