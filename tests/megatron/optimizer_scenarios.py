"""Megatron scenarios of the optimizer's precision (test_precision_aware_megatron.py; importing this module adds them
to ``worker.SCENARIOS``):

- ``precision_tp``: GRPO steps at tensor parallel 2 with ``use_precision_aware_optimizer`` (the strategy's
  ``optimizer_overrides``): all dtypes float32 (the default optimizer's run, exactly), bf16 gradients and moments
  (close to it; the optimizer's state really in bf16, the gradients reduced in bf16), and the default.
- ``precision_verl``: verl's ``optim.use_precision_aware_optimizer`` keys through ``main_ppo`` at tensor parallel 2: a
  step, checkpointed, and a second resumed from it.
- ``offload_tp``: PPO (policy, reference, critic) at tensor parallel 2 with every role offloading (verl's
  ``megatron.*_offload``; on CPU the moves are no-ops): which roles' tensors are on the host during each role's
  forward and after each step, and the run without offload.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .worker import SCENARIOS, build, world_size

BF16 = {"use_precision_aware_optimizer": True, "main_grads_dtype": "bf16", "exp_avg_dtype": "bf16",
        "exp_avg_sq_dtype": "bf16"}


def _train(out: Path, overrides: dict | None) -> dict:
    from rlflow.strategies.megatron import MegatronStrategy

    strategy = MegatronStrategy(tensor_parallel=world_size(), optimizer_overrides=overrides)
    trainer, data, record = build(str(out), strategy, steps=2, devices=world_size())
    trainer.fit(data)
    optimizer = trainer.optimizer.optimizer  # Fabric's wrapper holds the strategy's
    params = [p for g in optimizer.param_groups for p in g["params"]]
    result = {"steps": record.steps, "optimizer": type(optimizer).__name__,
              "dtypes": sorted({str(t.dtype) for s in optimizer.state.values() for k, t in s.items() if k != "step"}),
              "state_bytes": optimizer.state_bytes() if hasattr(optimizer, "state_bytes") else None,
              "parameters": sum(p.numel() for p in params)}
    trainer.fabric.strategy.teardown()
    return result


def precision_tp(out: Path) -> dict:
    fp32 = {"use_precision_aware_optimizer": True, "main_grads_dtype": "fp32", "exp_avg_dtype": "fp32"}
    return {"default": _train(out / "default", None), "fp32": _train(out / "fp32", fp32),
            "bf16": _train(out / "bf16", BF16)}


def precision_verl(out: Path) -> dict:
    """``python -m rlflow.trainer.main_ppo`` with verl's precision-aware keys (bf16 gradients and moments; fp16 master
    weights through ``override_optimizer_config``), one step checkpointed, then resumed for a second."""
    from rlflow.config.verl.run import main

    A = "actor_rollout_ref.actor"
    base = [f"data.train_files={out}/verl/train.parquet", f"actor_rollout_ref.model.path={out}/verl/model",
            "trainer.device=cpu", "trainer.n_gpus_per_node=2", f"{A}.strategy=megatron",
            f"{A}.megatron.tensor_model_parallel_size=2", "data.train_batch_size=4", f"{A}.ppo_mini_batch_size=2",
            "actor_rollout_ref.rollout.n=2", "data.max_prompt_length=8", "data.max_response_length=4",
            f"trainer.default_local_dir={out}/verl/precision", "trainer.logger=[console]",
            "algorithm.adv_estimator=grpo", "trainer.save_freq=1", "trainer.val_before_train=false",
            "trainer.resume_mode=auto", f"{A}.optim.use_precision_aware_optimizer=true",
            f"{A}.optim.main_grads_dtype=bf16", f"{A}.optim.exp_avg_dtype=bf16", f"{A}.optim.exp_avg_sq_dtype=bf16",
            f"+{A}.optim.override_optimizer_config.main_params_dtype=fp16"]
    codes = (main(base + ["trainer.total_training_steps=1"]), main(base + ["trainer.total_training_steps=2"]))
    return {"codes": codes, "steps": sorted(p.name for p in (out / "verl/precision").glob("global_step_*"))}


OFFLOAD = {"policy": ["params", "grads", "optimizer"], "reference": ["params"], "critic": ["params", "optimizer"]}


def offload_tp(out: Path) -> dict:
    from rlflow.strategies.megatron import MegatronStrategy

    runs = {}
    for name, offload in (("offload", OFFLOAD), ("plain", None)):
        strategy = MegatronStrategy(tensor_parallel=world_size(), offload=offload)
        trainer, data, record = build(str(out / name), strategy, steps=2, devices=world_size(), critic=True)
        offloader, seen = strategy._offloader, []
        for role, module in offloader.modules.items():  # after the offloader's own hook: what the forward runs with
            module.register_forward_pre_hook(lambda *_, role=role: seen.append((role, tuple(sorted(offloader.on_host)))))
        after = []
        trainer.fabric._callbacks.append(type("AfterStep", (), {"on_step_end": lambda self, **kw: after.append(
            sorted(offloader.on_host))})())
        trainer.fit(data)
        optimizer_roles = sorted(r for r in strategy._optimizer_roles.values() if r)
        runs[name] = {"steps": record.steps, "seen": sorted(set(seen)), "after_step": after,
                      "optimizer_roles": optimizer_roles}
        trainer.fabric.strategy.teardown()
    return runs


SCENARIOS.update({f.__name__: f for f in (precision_tp, precision_verl, offload_tp)})
