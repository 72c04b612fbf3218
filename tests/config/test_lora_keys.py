"""LoRA through the verl entry point: verl's keys, the seed's keys, the native recipe keys, an adapter folder."""

import pytest
import torch

import rlflow.config.verl.devices as devices
from rlflow.config import ConfigError, load_config, make_plan
from rlflow.config.verl.loading import NotSupportedError
from rlflow.config.verl.build import build_trainer
from rlflow.config.verl.dryrun import dry_run
from rlflow.config.verl.native import load_native
from rlflow.config.verl.run import unused_notes
from rlflow.models import lora as L
from rlflow.models.policy import AdapterDisabledReference

M, SEED = "actor_rollout_ref.model", "actor_rollout_ref.actor.lora"
BASE = ["actor_rollout_ref.model.path=m", "data.train_files=t.parquet", "trainer.device=cpu", "trainer.n_gpus_per_node=1"]


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def plan(*overrides):
    return make_plan(load_config(BASE + list(overrides)))


def test_verl_keys_and_seed_keys_make_the_lora_config():
    verl = plan(f"{M}.lora_rank=8", f"{M}.lora_alpha=16", f"{M}.target_modules=[q_proj,v_proj]",
                f"{M}.exclude_modules=[lm_head]", f"{M}.use_rslora=true", f"{M}.use_dora=true")
    assert verl.lora == {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "exclude_modules": ["lm_head"],
                         "use_rslora": True, "use_dora": True, "task_type": "CAUSAL_LM"}
    seed = plan(f"{SEED}.enabled=true", f"{SEED}.target_modules=[q_proj,v_proj]")  # the seed's example: r 16, alpha 32
    assert {k: seed.lora[k] for k in ("r", "lora_alpha", "target_modules")} == \
        {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}
    assert plan(f"{M}.lora_rank=32").lora["target_modules"] == "all-linear"  # verl's default
    with pytest.raises(ConfigError, match=f"{SEED}.r=16 and {M}.lora_rank=8 disagree"):
        plan(f"{SEED}.enabled=true", f"{M}.lora_rank=8")
    with pytest.raises(ConfigError, match="LoRA rank must be a positive integer"):
        plan(f"{SEED}.enabled=true", f"{SEED}.r=0")
    with pytest.raises(ConfigError, match="lora_adapter_path='nowhere'.*adapter_config.json"):
        plan(f"{M}.lora_adapter_path=nowhere")
    megatron = plan(f"{SEED}.enabled=true", f"{SEED}.target_modules=[q_proj,v_proj]",
                    "actor_rollout_ref.actor.strategy=megatron")
    assert megatron.lora == seed.lora  # the same PEFT adapters, on Megatron's layers (rlflow.strategies.megatron.lora)
    off = plan(f"{M}.lora_alpha=64")  # LoRA off: the setting changes nothing, and says so
    assert off.lora is None and any(n.startswith(f"{M}.lora_alpha=64 has no effect") and "lora_rank > 0" in n
                                    for n in unused_notes(off.cfg))


def test_verl_megatron_lora_block_makes_the_lora_config():
    """verl's model.lora.* (Megatron-Bridge's names) with the Megatron strategy: PEFT adapters on the projections
    each Megatron layer fuses; what has no counterpart is refused by name, what changes nothing gets a note."""
    MEG, LB = "actor_rollout_ref.actor.strategy=megatron", f"{M}.lora"
    p = plan(MEG, f"{LB}.rank=32", f"{LB}.alpha=64", f"{LB}.lora_A_init_method=kaiming")
    assert p.lora == {"r": 32, "lora_alpha": 64, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                     "up_proj", "down_proj"],
                      "exclude_modules": None, "use_rslora": False, "use_dora": False, "task_type": "CAUSAL_LM"}
    assert any(n.startswith(f"{LB}: PEFT adapters of rank 32") and "one adapter per projection" in n for n in p.notes)
    assert not any(n.startswith(f"{LB}.lora_A_init_method") for n in unused_notes(p.cfg))  # read, and in the note
    canonical = plan(MEG, f"{LB}.rank=8", f"{LB}.type=canonical_lora", f"{LB}.target_modules=[linear_q,linear_v]")
    assert canonical.lora["target_modules"] == ["q_proj", "v_proj"]
    assert plan(MEG, f"{LB}.rank=8", f"{LB}.target_modules=[]", f"{LB}.exclude_modules=[linear_fc2,linear_k]"
                ).lora["target_modules"] == ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]
    for override, match in ((f"{LB}.type=dora", "this Megatron LoRA variant"),
                            (f"{LB}.target_modules=[router]", "LoRA on 'router'"),
                            (f"{LB}.target_modules=['*.layers.0.*.linear_qkv']", "no wildcards"),
                            (f"{LB}.dropout=0.1", "LoRA dropout under the Megatron strategy"),
                            (f"{LB}.adapter_path=/a", "Megatron-Bridge adapter checkpoints")):
        with pytest.raises(NotSupportedError, match=match):
            plan(MEG, f"{LB}.rank=8", override)
    with pytest.raises(ConfigError, match="the Megatron strategy's LoRA .* with fsdp"):
        plan(f"{LB}.rank=8", "actor_rollout_ref.actor.strategy=fsdp")
    with pytest.raises(ConfigError, match="both turn LoRA on"):
        plan(MEG, f"{LB}.rank=8", f"{M}.lora_rank=8")


def test_native_keys_equal_verl_keys(tmp_path):
    (tmp_path / "r.yaml").write_text("policy: {path: m, lora: {r: 8, alpha: 16, target_modules: [q_proj], use_dora: true}}\n"
                                     "data: {train: t.parquet}\ntrainer: {device: cpu}\n")
    native = make_plan(load_native(tmp_path / "r.yaml"))
    assert native.lora == plan(f"{M}.lora_rank=8", f"{M}.lora_alpha=16", f"{M}.target_modules=[q_proj]",
                               f"{M}.use_dora=true").lora


def test_seed_keys_train_with_the_adapter_and_its_reference(tiny, model_dir, tmp_path):
    """The seed's LoRA block through the verl entry point's plan and builders: PEFT adapters, the
    adapter-disabled reference, a dry run that says so, and an adapter folder (exported from the
    checkpoint) that trains further."""
    overrides = tiny + [f"{SEED}.enabled=true", f"{SEED}.r=4", f"{SEED}.alpha=8", "actor_rollout_ref.actor.use_kl_loss=true",
                        "trainer.val_before_train=false", "trainer.save_freq=2"]
    p = make_plan(load_config(overrides))
    report, problems = dry_run(p)
    assert not problems and "lora=LoraConfig(r=4, target_modules='all-linear'" in report
    assert "trainable" in report and "the reference is the model with its adapter off" in report
    trainer, data = build_trainer(p)
    assert L.is_lora(trainer.policy.model) and isinstance(trainer.reference, AdapterDisabledReference)
    assert trainer.policy.model.peft_config["default"].r == 4
    assert len(trainer.fit(data)) == 2
    from rlflow.trainer.hf_export import export_hf

    from safetensors.torch import load_file, save_file

    adapter = export_hf(tmp_path / "run" / "global_step_2", tmp_path / "hf") / L.ADAPTER_DIR
    weights = load_file(adapter / "adapter_model.safetensors")
    save_file({k: torch.full_like(v, 0.5) for k, v in weights.items()}, adapter / "adapter_model.safetensors")
    again = make_plan(load_config(tiny + [f"{M}.lora_adapter_path={adapter}", f"{M}.lora_rank=4", f"{SEED}.r=8"]))
    assert any("the adapter's own adapter_config.json" in n and f"{SEED}.r" in n for n in again.notes)
    assert not any("lora" in n for n in unused_notes(again.cfg))  # one note, not a second "has no effect"
    trained = dict(L.trainable_parameters(build_trainer(again)[0].policy.model))
    assert len(trained) == len(weights) and all(bool((p == 0.5).all()) for p in trained.values())  # trainable, loaded
