"""Multi-token prediction (verl's model.mtp; strategies/megatron/mtp.py) on ranks forked by test_mtp.py (importing this
module adds ``mtp`` and ``mtp_verl`` to ``worker.SCENARIOS``). ``OUT/mimo`` holds a tiny MiMo checkpoint and
``OUT/verl`` the verl entry point's data (written by the test)."""

from __future__ import annotations

from pathlib import Path

import torch

from .worker import SCENARIOS, world_size

PREFIX = "model.mtp_layers.0."


def batch() -> tuple[torch.Tensor, ...]:
    """Three rows: real prompts of 5 tokens (one left-padded by 2), responses of 4 with one ending early."""
    torch.manual_seed(2)
    prompt_ids, response_ids = torch.randint(3, 40, (3, 5)), torch.randint(3, 40, (3, 4))
    prompt_mask, response_mask = torch.ones_like(prompt_ids), torch.ones_like(response_ids)
    prompt_ids[1, :2], prompt_mask[1, :2] = 0, 0
    response_ids[2, 2:], response_mask[2, 2:] = 0, 0
    return prompt_ids, prompt_mask, response_ids, response_mask


def _grad_norms(lm) -> dict[str, float | None]:
    """Gradient norm of each part the MTP loss could reach (None: no gradient)."""
    def norm(params) -> float | None:
        grads = [p.grad for p in params if p.grad is not None]
        return float(torch.stack([g.norm() for g in grads]).norm()) if grads else None

    return {"mtp": norm(lm.gpt.mtp.parameters()) if getattr(lm.gpt, "mtp", None) is not None else None,
            "decoder": norm(lm.gpt.decoder.parameters()), "embedding": norm(lm.gpt.embedding.parameters())}


def mtp(out: Path) -> dict:
    """The tiny MiMo as the policy at tensor parallel ``world``: without MTP, with MTP carried (enable_train=False),
    trained with and without detach_encoder. Each: log-probs of the batch, the MTP loss (``Policy``'s hand-off) and
    which parts its gradient reaches; then one AdamW step on the MTP loss changes the MTP weights."""
    import lightning_fabric as L

    from rlflow.models.critic import load_causal_lm
    from rlflow.models.logprobs import TokenLogProbs
    from rlflow.strategies.megatron import MegatronStrategy
    from rlflow.strategies.megatron.mtp import MTPOptions

    world, prompt_ids, prompt_mask, response_ids, response_mask = world_size(), *batch()
    runs = {"off": None, "carried": MTPOptions(train=False), "detached": MTPOptions(True, 0.1, detach_encoder=True),
            "attached": MTPOptions(True, 0.2)}
    result = {}
    for name, options in runs.items():
        strategy = MegatronStrategy(tensor_parallel=world, mtp=options)
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        module = fabric.setup_module(TokenLogProbs(load_causal_lm(str(out / "mimo"))))
        lm = module.lm
        log_probs, _ = module(prompt_ids, prompt_mask, response_ids, response_mask)
        r = {"log_probs": log_probs.detach().clone(),
             "mtp_trainable": any(p.requires_grad for p in lm.gpt.mtp.parameters()) if options else None}
        losses = getattr(module, "mtp_losses", None)
        taken = losses.take(float(response_mask.sum())) if losses is not None else None
        if taken is None:
            fabric.backward(log_probs.sum())
        else:
            r["loss"], r["stats"] = taken[0].item(), taken[1]
            fabric.backward(taken[0])  # the MTP loss alone: which parts does it reach?
        r["grads"] = _grad_norms(lm)
        if taken is not None:
            before = {n: p.detach().clone() for n, p in lm.gpt.mtp.named_parameters()}
            torch.optim.AdamW([p for p in lm.parameters() if p.grad is not None], lr=1e-2).step()
            r["mtp_changed"] = all(not torch.equal(before[n], p) for n, p in lm.gpt.mtp.named_parameters())
        fabric.strategy.teardown()
        result[name] = r
    return result


def mtp_verl(out: Path) -> dict:
    """``python -m rlflow.trainer.main_ppo`` with verl's MTP keys (MiMo example's) on the tiny MiMo, Megatron at tensor
    parallel 2, one GRPO step, checkpointed: its metrics and the checkpoint's MTP weights."""
    import json

    from rlflow.config.verl.run import main
    from rlflow.trainer.hf_export import load_policy_state

    run = out / "verl/run"
    mtp, roll = "actor_rollout_ref.model.mtp", "actor_rollout_ref.rollout"
    code = main([f"data.train_files={out}/verl/train.parquet", f"actor_rollout_ref.model.path={out}/mimo",
                 "trainer.device=cpu", f"trainer.n_gpus_per_node={world_size()}", "model_engine=megatron",
                 f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={world_size()}",
                 f"{mtp}.enable=True", f"{mtp}.enable_train=True", f"{mtp}.mtp_loss_scaling_factor=0.1",
                 f"{mtp}.detach_encoder=True", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                 f"{roll}.n=2", f"{roll}.name=hf", "data.max_prompt_length=8", "data.max_response_length=4",
                 f"trainer.default_local_dir={run}", "trainer.logger=[console]", "algorithm.adv_estimator=grpo",
                 "trainer.save_freq=1", "trainer.val_before_train=false", "trainer.total_training_steps=1"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    state = load_policy_state(run / "global_step_1/state.ckpt") if (run / "global_step_1/state.ckpt").exists() else {}
    return {"code": code, "metrics": rows, "mtp_state": {k: v for k, v in state.items() if k.startswith(PREFIX)}}


SCENARIOS.update(mtp=mtp, mtp_verl=mtp_verl)
