"""verl 0.9.1's own config tree: every key settable, its bundled configs and config groups as verl composes them."""

import pytest
import yaml

import rlflow.config.verl.devices as devices
from rlflow.config import ConfigError, load_config
from rlflow.config.verl.run import load_and_check, parse_args, unused_notes
from rlflow.config.trees import flatten
from rlflow.config.verl.validate import validate
from rlflow.config.verl.configs import VERL_CONFIG_DIR, verl_keys

@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


GENERATED = VERL_CONFIG_DIR / "_generated_ppo_trainer.yaml"
MEGATRON = VERL_CONFIG_DIR / "_generated_ppo_megatron_trainer.yaml"


def leaf_keys(path):
    return {k for k in flatten(yaml.safe_load(path.read_text())) if not k.endswith("_target_")}


def test_every_key_of_verl_0_9_1_is_in_the_tree_without_a_plus():
    known = set(load_config([]).flat)
    keys = leaf_keys(GENERATED) | leaf_keys(MEGATRON)
    assert len(keys) > 1000 and keys == verl_keys()
    # (a few nodes are a dict in one of verl's trees and null in the other: their children are known)
    unknown = [k for k in keys if k not in known and not any(j.startswith(k + ".") for j in known)]
    assert not unknown, unknown[:20]
    # a key verl 0.9.1 added, set the way verl's scripts set it (it was "not set yet; add it with +" before)
    cfg = load_config(["ray_kwargs.ray_init.runtime_env.py_executable=/usr/bin/python3",
                       "actor_rollout_ref.actor.fsdp_config.use_orig_params=true"])
    assert cfg["ray_kwargs.ray_init.runtime_env.py_executable"] == "/usr/bin/python3"


def verl_overrides(tiny):
    """What verl itself requires beside its generated file (``rollout.name: ???``), plus the tiny run."""
    return tiny + ["actor_rollout_ref.rollout.name=hf"]


@pytest.mark.parametrize("generated", [GENERATED, MEGATRON], ids=["fsdp", "megatron"])
def test_verl_generated_yaml_unchanged_passes_validation(generated, tiny):
    """verl 0.9.1's whole composed tree as the user's file: every key is provided, and none is a problem."""
    pytest.importorskip("megatron.core") if generated is MEGATRON else None
    cfg = load_config(verl_overrides(tiny), config_file=generated)
    assert len(cfg.provided) > 800
    assert validate(cfg) == []
    from rlflow.config import make_plan

    # keys at their default get no note: only those where rlflow's default differs from verl's, each with its
    # reason or "not used by this configuration" (critic keys without a critic); every key has a meaning:
    # tests/config/test_loading.py::test_every_verl_key_is_honoured_inert_or_not_supported
    notes = unused_notes(make_plan(cfg).cfg)
    assert 0 < len(notes) < 40, notes


def test_bundled_config_names_read_rlflow_copy_of_verl(tmp_path, tiny, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./config/ppo_megatron_trainer.yaml here: verl's own is meant
    pytest.importorskip("megatron.core")
    args = parse_args(["--config-path=config", "--config-name=ppo_megatron_trainer.yaml", *verl_overrides(tiny)])
    cfg = load_and_check(args)
    assert cfg["actor_rollout_ref.actor.strategy"] == "megatron" and cfg["critic.strategy"] == "megatron"
    assert cfg["actor_rollout_ref.actor.optim.optimizer"] == "adam"  # verl's Megatron default, not AdamW
    assert "actor_rollout_ref.actor.strategy" not in cfg.provided  # defaults of the config, not the user's
    # a file of that name in the user's folder wins, as in verl
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "ppo_megatron_trainer.yaml").write_text("trainer:\n  total_epochs: 3\n")
    cfg = load_and_check(args)
    assert cfg["actor_rollout_ref.actor.strategy"] == "fsdp" and cfg["trainer.total_epochs"] == 3


@pytest.mark.parametrize("group", ["model_engine=megatron", "actor@actor_rollout_ref.actor=megatron_actor"])
def test_config_groups_compose_as_in_verl(group):
    cfg = load_config([group])
    assert cfg["actor_rollout_ref.actor.strategy"] == "megatron"
    assert cfg["actor_rollout_ref.actor.megatron.tensor_model_parallel_size"] == 1
    assert load_config([]).flat["actor_rollout_ref.actor.strategy"] == "fsdp"  # the default is untouched


@pytest.mark.parametrize("overrides, message", [
    (["model_engine=veomni"], "VeOmni training engine.*a backend rlflow does not have"),
    (["model_engine=torchtitan"], "TorchTitan training engine"),
    (["hydra.searchpath=[pkg://verl_mlite.config]", "actor@actor_rollout_ref.actor=mlite_actor"],
     "verl_mlite.*not installed.*Megatron-lite"),
    (["model_engine=dpp"], "Could not find 'model_engine/dpp'.*dp megatron"),
])
def test_foreign_engines_and_bad_groups_are_one_clear_message(overrides, message):
    problems = []
    load_config(overrides, problems=problems)
    assert len(problems) == 1, problems
    assert pytest.raises(ConfigError, load_config, overrides).match(message)


def test_hydra_app_keys_get_a_note():
    cfg = load_config(["hydra.run.dir=outputs/x"])
    assert any("hydra.run.dir=outputs/x has no effect" in n for n in cfg.notes)
