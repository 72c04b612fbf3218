"""LoRA on the critic through the verl entry point (critic.model.lora_rank / lora_alpha / target_modules /
lora_adapter_path): PEFT adapters on the value model's backbone; its own weights stay as loaded, the adapter
and the (new) value head train."""

import pytest
import torch

import rlflow.config.verl.devices as devices
from rlflow.config import ConfigError, load_config, make_plan
from rlflow.config.verl.build import build_trainer
from rlflow.config.verl.dryrun import dry_run
from rlflow.config.verl.run import unused_notes
from rlflow.models import lora as L

CM = "critic.model"


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


@pytest.fixture
def ppo(tiny, model_dir):
    return tiny + ["algorithm.adv_estimator=gae", f"{CM}.path={model_dir}", "trainer.val_before_train=false"]


def test_keys_make_the_critics_lora_config(ppo):
    p = make_plan(load_config(ppo + [f"{CM}.lora_rank=4", f"{CM}.lora_alpha=8", f"{CM}.target_modules=[q_proj,v_proj]"]))
    assert p.critic_lora == {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "exclude_modules": None,
                             "task_type": "CAUSAL_LM"}
    assert p.lora is None  # the policy's LoRA is its own
    report, problems = dry_run(p)
    assert not problems and "lora=LoraConfig(r=4, target_modules=['q_proj', 'v_proj']" in report
    off = make_plan(load_config(ppo + [f"{CM}.lora_alpha=64"]))
    assert off.critic_lora is None and any(n.startswith(f"{CM}.lora_alpha=64 has no effect") and "lora_rank > 0" in n
                                           for n in unused_notes(off.cfg))
    with pytest.raises(ConfigError, match=f"{CM}.lora_adapter_path='nowhere'.*adapter_config.json"):
        make_plan(load_config(ppo + [f"{CM}.lora_adapter_path=nowhere"]))
    megatron = make_plan(load_config(ppo + [f"{CM}.lora_rank=4", f"{CM}.lora_alpha=8",
                                            f"{CM}.target_modules=[q_proj,v_proj]",
                                            "actor_rollout_ref.actor.strategy=megatron", "critic.strategy=megatron"]))
    assert megatron.critic_lora == p.critic_lora  # on Megatron's layers (tests/megatron/test_lora.py trains it)
    block = make_plan(load_config(ppo + [f"{CM}.lora.rank=4", f"{CM}.lora.alpha=8", f"{CM}.lora.type=canonical_lora",
                                         f"{CM}.lora.target_modules=[linear_q,linear_v]",
                                         "actor_rollout_ref.actor.strategy=megatron"]))
    assert block.critic_lora == p.critic_lora  # verl's Megatron LoRA block on the critic: the same adapters
    with pytest.raises(ConfigError, match=f"{CM}.lora.rank=4: verl's model.lora block is the Megatron strategy's"):
        make_plan(load_config(ppo + [f"{CM}.lora.rank=4"]))


def test_only_the_adapter_and_the_value_head_train(ppo, tmp_path):
    (tmp_path / "length.py").write_text("def compute_reward(responses, ground_truths):\n"
                                        "    return [float(len(r)) for r in responses]\n")  # returns for the critic
    p = make_plan(load_config(ppo + [f"{CM}.lora_rank=4", f"{CM}.lora_alpha=8", "critic.optim.lr=1e-2",
                                     "critic.optim.weight_decay=0.0", f"custom_reward_function.path={tmp_path}/length.py",
                                     "custom_reward_function.name=compute_reward"]))
    trainer, data = build_trainer(p)
    module = trainer.critic.module._forward_module  # inside Fabric's wrapper
    assert L.is_lora(module.lm) and module.lm.peft_config["default"].r == 4
    before = {n: t.detach().clone() for n, t in module.named_parameters()}
    trains = {n for n, t in module.named_parameters() if t.requires_grad}
    assert trains and all("lora_" in n or n.startswith("value_head.") for n in trains)
    assert any(n.startswith("value_head.") for n in trains) and any("lora_B" in n for n in trains)
    assert len(trainer.fit(data)) == 2
    after = dict(module.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed <= trains  # the backbone's own weights are as loaded
    assert any("lora_B" in n for n in changed) and "value_head.weight" in changed


def test_an_adapter_folder_trains_further(ppo, model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "critic-adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                   LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])).save_pretrained(folder)
    p = make_plan(load_config(ppo + [f"{CM}.lora_adapter_path={folder}", f"{CM}.lora_rank=8"]))
    assert p.critic_lora == str(folder)
    assert any("the adapter's own adapter_config.json" in n and f"{CM}.lora_rank" in n for n in p.notes)
    critic = build_trainer(p)[0].critic.module._forward_module
    assert critic.lm.peft_config["default"].r == 2
    assert any(t.requires_grad for n, t in critic.named_parameters() if "lora_A" in n)
