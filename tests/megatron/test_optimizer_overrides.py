"""verl's ``optim.override_optimizer_config`` under the Megatron strategy: megatron-core ``OptimizerConfig`` fields.

Real megatron-core, no processes: the fields are checked against its ``OptimizerConfig`` and land in the one the
distributed optimizer is built from (that optimizer runs on GPUs only: ``test_gpu.py`` trains with CPU offload).
"""

import pytest

import rlflow.config.verl.devices as devices
from rlflow.config.verl.loading import ConfigError, NotSupportedError, load_config
from rlflow.config.verl.plan import make_plan
from rlflow.strategies.megatron import MegatronStrategy, megatron_available

pytestmark = pytest.mark.skipif(not megatron_available(),
                                reason="megatron-core is not installed (pip install -e '.[megatron]')")

A = "actor_rollout_ref.actor"
O = f"+{A}.optim.override_optimizer_config"
BASE = ["actor_rollout_ref.model.path=/nowhere", "algorithm.adv_estimator=grpo", "trainer.logger=[console]",
        f"{A}.strategy=megatron", "trainer.n_gpus_per_node=1"]
VERL_SCRIPTS = {"optimizer_offload_fraction": 1.0, "overlap_cpu_optimizer_d2h_h2d": True,
                "optimizer_cpu_offload": True}  # what verl's Megatron GRPO scripts set (the fourth needs TE)


def plan(*overrides):
    return make_plan(load_config(BASE + list(overrides)))


def test_overrides_reach_megatrons_optimizer_config():
    from megatron.core.optimizer import OptimizerConfig

    from rlflow.strategies.megatron.distopt import optimizer_config

    group = {"lr": 3e-4, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-6}
    config = optimizer_config(group, VERL_SCRIPTS)
    assert isinstance(config, OptimizerConfig)
    assert (config.optimizer_cpu_offload, config.optimizer_offload_fraction, config.overlap_cpu_optimizer_d2h_h2d) == (
        True, 1.0, True)
    assert (config.lr, config.adam_beta2, config.adam_eps, config.weight_decay) == (3e-4, 0.95, 1e-6, 0.1)
    plain = optimizer_config(group)
    assert (plain.optimizer_cpu_offload, plain.overlap_cpu_optimizer_d2h_h2d) == (False, False)
    assert MegatronStrategy(optimizer_overrides=VERL_SCRIPTS).optimizer_overrides == VERL_SCRIPTS
    with pytest.raises(ValueError, match="'offload_fraction' is not a field of megatron-core's OptimizerConfig"):
        MegatronStrategy(optimizer_overrides={"offload_fraction": 1.0})
    with pytest.raises(ValueError, match="'lr' comes from the Trainer's optimizer"):
        MegatronStrategy(optimizer_overrides={"lr": 1.0})


def test_verl_keys_reach_the_strategy(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    p = plan("trainer.device=cpu", *(f"{O}.{k}={v}" for k, v in VERL_SCRIPTS.items()))
    assert p.trainer_kwargs["strategy"].optimizer_overrides == VERL_SCRIPTS
    assert any("go to megatron-core's OptimizerConfig" in n and "CPU memory" in n for n in p.notes)
    with pytest.raises(ConfigError, match=r"override_optimizer_config: 'offload_fraction' is not a field"):
        plan("trainer.device=cpu", f"{O}.offload_fraction=1.0")
    monkeypatch.setattr(devices, "cuda_count", lambda: 1)
    with pytest.raises(NotSupportedError, match=r"override_optimizer_config.optimizer_cpu_offload=True: offloading"):
        plan("trainer.device=cuda", f"{O}.optimizer_cpu_offload=True")


P = f"{A}.optim"
PRECISION = [f"{P}.use_precision_aware_optimizer=true", f"{P}.main_grads_dtype=bf16", f"{P}.exp_avg_dtype=bf16",
             f"{P}.exp_avg_sq_dtype=fp32"]


@pytest.mark.parametrize("device, gpus", [("cpu", 0), ("cuda", 1)])
def test_precision_aware_keys_reach_the_strategy_on_cpu_and_gpu(monkeypatch, device, gpus):
    """verl's optim.use_precision_aware_optimizer with its dtypes (override_optimizer_config over them, as in verl):
    the strategy's optimizer_overrides, which make the Trainer's AdamW a PrecisionAwareAdamW."""
    monkeypatch.setattr(devices, "cuda_count", lambda: gpus)
    p = plan(f"trainer.device={device}", *PRECISION, f"{O}.exp_avg_sq_dtype=fp16", f"{O}.main_params_dtype=fp16")
    assert p.trainer_kwargs["strategy"].optimizer_overrides == {
        "use_precision_aware_optimizer": True, "main_grads_dtype": "bf16", "exp_avg_dtype": "bf16",
        "exp_avg_sq_dtype": "fp16", "main_params_dtype": "fp16"}
    assert any("make the Trainer's AdamW rlflow's PrecisionAwareAdamW" in n for n in p.notes)
    assert not any("use_precision_aware_optimizer" in n and "has no effect" in n for n in p.notes)


def test_precision_aware_dtypes_without_the_switch_change_nothing_and_say_so(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    from rlflow.config.verl.key_notes import unused_notes

    cfg = load_config(BASE + ["trainer.device=cpu", f"{P}.exp_avg_dtype=bf16"])
    assert make_plan(cfg).trainer_kwargs["strategy"].optimizer_overrides == {}
    assert any(f"{P}.exp_avg_dtype='bf16' has no effect" in n and "use_precision_aware_optimizer=True" in n
               for n in unused_notes(cfg))


@pytest.mark.parametrize("override, message", [
    (f"{O}.exp_avg_sq_dtype=fp8", r"exp_avg_sq_dtype=fp8: rlflow's precision-aware AdamW .* Transformer Engine"),
    (f"{P}.main_grads_dtype=fp16", r"main_grads_dtype='fp16': choose fp32, bf16"),
    ("critic.optim.use_precision_aware_optimizer=false", "rlflow trains every role with one Megatron strategy"),
])
def test_precision_aware_refusals_name_the_key(monkeypatch, override, message):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    extra = ["algorithm.adv_estimator=gae", "critic.model.path=/nowhere"] if override.startswith("critic") else []
    with pytest.raises(ConfigError, match=message):
        plan("trainer.device=cpu", *PRECISION, override, *extra)


def test_precision_aware_settings_reach_megatrons_optimizer_config():
    """With the distributed optimizer (CUDA, Transformer Engine) the dtypes go to megatron-core's OptimizerConfig as
    torch dtypes, and Megatron's DDP reduces in the main gradients' dtype (tests/megatron/test_gpu.py runs it)."""
    import dataclasses

    import torch
    from megatron.core.optimizer import OptimizerConfig

    from rlflow.strategies.megatron.distopt import as_megatron, reduces_in_fp32

    overrides = {"use_precision_aware_optimizer": True, "main_grads_dtype": "bf16", "exp_avg_dtype": "fp8",
                 "exp_avg_sq_dtype": "bf16"}
    fields = as_megatron(overrides)
    assert (fields["main_grads_dtype"], fields["exp_avg_dtype"]) == (torch.bfloat16, torch.uint8)
    assert not reduces_in_fp32(overrides) and reduces_in_fp32({}) and reduces_in_fp32({**overrides, "main_grads_dtype": "fp32"})
    assert {"use_precision_aware_optimizer", "exp_avg_dtype"} <= {f.name for f in dataclasses.fields(OptimizerConfig)}
    # distributed_optimizer=True takes fp8 second moments (Transformer Engine's FusedAdam); rlflow's own AdamW not
    MegatronStrategy(distributed_optimizer=True, optimizer_overrides={**overrides, "exp_avg_sq_dtype": "fp8"})
    with pytest.raises(ValueError, match="exp_avg_sq_dtype=fp8"):
        MegatronStrategy(optimizer_overrides={**overrides, "exp_avg_sq_dtype": "fp8"})
