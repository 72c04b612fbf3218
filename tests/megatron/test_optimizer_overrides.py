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
