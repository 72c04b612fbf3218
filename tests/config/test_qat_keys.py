"""verl's quantization-aware training keys (actor.qat, actor.fsdp_config.qat, actor.megatron.qat): the policy built
from them is fake-quantized, the dry run and a 2-step run go through the entry point, and what rlflow cannot do
(Megatron, w4a4, LoRA) is refused by name. The critic's blocks quantize the critic."""

import pytest

import rlflow.config.verl.devices as devices
from rlflow.cli import main as cli_main
from rlflow.config import ConfigError, NotSupportedError, load_config, make_plan
from rlflow.config.verl.build import build_critic, build_policy
from rlflow.config.verl.run import unused_notes
from rlflow.models.qat import NVFP4Linear
from rlflow.trainer.main_ppo import main
from tests.config.test_main_ppo import steps

A = "actor_rollout_ref.actor"


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


@pytest.mark.parametrize("block", [f"{A}.qat", f"{A}.fsdp_config.qat"])
def test_either_block_quantizes_the_policy(tiny, block):
    p = make_plan(load_config(tiny + [f"{block}.enable=true", f"{block}.ignore_patterns=[lm_head,down_proj]"]))
    assert p.policy_kwargs["qat"] == {"mode": "w4a16", "group_size": 16, "ignore_patterns": ["lm_head", "down_proj"]}
    assert any(n.startswith(f"{block}.enable=True: quantization-aware training") and "HF" not in n for n in p.notes)
    policy = build_policy(p)
    quantized = {n for n, m in policy.model.named_modules() if isinstance(m, NVFP4Linear)}
    assert "model.layers.0.self_attn.q_proj" in quantized and "model.layers.0.mlp.down_proj" not in quantized
    assert not any(f"{block}.ignore_patterns" in n for n in unused_notes(p.cfg))  # read, so no "no effect" note


def test_off_by_default_and_the_other_blocks_keys_are_noted(tiny):
    p = make_plan(load_config(tiny + [f"{A}.qat.group_size=32"]))
    assert "qat" not in p.policy_kwargs
    assert any(n.startswith(f"{A}.qat.group_size=32 has no effect") and "qat.enable=True" in n
               for n in unused_notes(p.cfg))
    p = make_plan(load_config(tiny + [f"{A}.qat.enable=true", f"{A}.qat.quantization_config_path=q.json"]))
    assert any("quantization_config_path" in n and "FP4 kernels" in n for n in unused_notes(p.cfg))


def test_enabled_blocks_must_agree(tiny):
    both = [f"{A}.qat.enable=true", f"{A}.fsdp_config.qat.enable=true"]
    assert make_plan(load_config(tiny + both)).policy_kwargs["qat"]["group_size"] == 16
    with pytest.raises(ConfigError, match=f"{A}.fsdp_config.qat.group_size=32 differs from {A}.qat.group_size=16"):
        make_plan(load_config(tiny + both + [f"{A}.fsdp_config.qat.group_size=32"]))


@pytest.mark.parametrize("override, match", [
    ([f"{A}.qat.mode=w4a4"], f"{A}.qat.mode='w4a4': QAT with 4-bit activations .* experimental"),
    ([f"{A}.qat.mode=int8"], "unknown QAT mode"),
    ([f"{A}.qat.group_size=0"], "must be a positive integer"),
    (["actor_rollout_ref.model.lora_rank=4"], "quantization-aware training with LoRA is not supported"),
    ([f"{A}.megatron.qat.enable=true"], "reads the megatron block under strategy=megatron only"),
    (["critic.megatron.qat.enable=true"], "set critic.fsdp.qat.enable=True"),
])
def test_refusals_name_the_key(tiny, model_dir, override, match):
    enable = [] if "megatron" in override[0] else [f"{A}.qat.enable=true"]
    critic = ["algorithm.adv_estimator=gae", f"critic.model.path={model_dir}"] if "critic" in override[0] else []
    with pytest.raises(ConfigError, match=match):
        make_plan(load_config(tiny + critic + enable + override))


def test_the_critic_block_quantizes_the_critic(tiny, model_dir, capsys):
    gae = tiny + ["algorithm.adv_estimator=gae", f"critic.model.path={model_dir}", "trainer.val_before_train=false",
                  "critic.ppo_micro_batch_size_per_gpu=2", "critic.fsdp.qat.enable=true"]
    p = make_plan(load_config(gae))
    assert p.critic_kwargs["qat"]["group_size"] == 16 and "qat" not in p.policy_kwargs
    critic = build_critic(p)
    quantized = {n for n, m in critic.module.named_modules() if isinstance(m, NVFP4Linear)}
    assert {"value_head", "lm.model.layers.0.mlp.up_proj"} <= quantized and "lm.lm_head" not in quantized
    assert not any(isinstance(m, NVFP4Linear) for m in build_policy(p).model.modules())
    assert main(gae + [f"{A}.fsdp_config.qat.enable=true"]) == 0
    assert sorted(steps(capsys.readouterr().out)) == [1, 2]


def test_megatron_strategy_is_refused_by_name(tiny):
    megatron = [f"{A}.strategy=megatron", "critic.strategy=megatron", f"{A}.megatron.qat.enable=true"]
    with pytest.raises(NotSupportedError, match=f"{A}.megatron.qat.enable=True: quantization-aware training under "
                                                "the Megatron strategy"):
        make_plan(load_config(tiny + megatron))


def test_dry_run_and_two_steps_through_the_entry_point(tiny, tmp_path, capsys):
    args = tiny + [f"{A}.qat.enable=True", "actor_rollout_ref.rollout.name=hf", "trainer.val_before_train=false"]
    note = f"{A}.qat.enable=True: quantization-aware training: the policy's linear layers compute with NVFP4"
    assert cli_main(["train", "--dry-run"] + args) == 0
    assert note in capsys.readouterr().out
    assert main(args) == 0
    out = capsys.readouterr().out
    assert note in out and "has no effect" not in out
    logged = steps(out)
    assert sorted(logged) == [1, 2]
    for metrics in logged.values():  # the rollout sampled from the policy the trainer scores
        assert metrics["training/rollout_probs_diff_max"] < 1e-5
