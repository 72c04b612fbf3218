"""Loading and validating verl configs: overrides, unknown keys, not-supported features, devices (no model)."""

import pytest

import rlflow.algorithms
import rlflow.config.verl.devices as devices
from rlflow.config import ConfigError, NotSupportedError, load_config, make_plan
from rlflow.config.verl import tables
from rlflow.config.verl.loading import DEFAULTS_FILE, flatten
from rlflow.config.verl.run import unused_notes

QUICK_START = ["algorithm.adv_estimator=grpo", "data.train_files=~/data/gsm8k/train.parquet",
               "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B", "actor_rollout_ref.rollout.n=8",
               "actor_rollout_ref.actor.use_kl_loss=True", "trainer.n_gpus_per_node=8"]
CPU = ["trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.logger=[console]"]


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def plan(*overrides):
    return make_plan(load_config(QUICK_START + CPU + list(overrides)))


def test_quick_start_overrides_parse_with_hydra_grammar():
    cfg = load_config(QUICK_START + ["trainer.logger=[console,tensorboard]", "+actor_rollout_ref.model.override_config.x=1"])
    assert cfg["data.train_files"] == "~/data/gsm8k/train.parquet"  # Hydra's lexer rejects '~' unquoted; taken as text
    assert cfg["actor_rollout_ref.rollout.n"] == 8 and cfg["actor_rollout_ref.actor.use_kl_loss"] is True
    assert cfg["trainer.logger"] == ["console", "tensorboard"]
    assert cfg["actor_rollout_ref.model.override_config"] == {"x": 1}
    assert cfg["critic.ppo_mini_batch_size"] == 256  # verl's interpolation of the actor's value
    assert load_config(["trainer.logger=console"])["trainer.logger"] == ["console"]


@pytest.mark.parametrize("override, suggestion", [
    ("trainer.totl_epochs=3", "trainer.total_epochs"),
    ("actor_rollout_ref.actor.ppo_mini_bach_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("actor_rollout_ref.rollout.temprature=0.7", "actor_rollout_ref.rollout.temperature"),
    ("+trainer.experiment_nam=x", "trainer.experiment_name"),
])
def test_unknown_key_is_an_error_with_close_matches(override, suggestion):
    with pytest.raises(ConfigError, match="unknown config key") as e:
        load_config([override])
    assert suggestion in str(e.value)


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    (tmp_path / "c.yaml").write_text("data:\n  train_batch_sise: 8\n")
    with pytest.raises(ConfigError, match=r"data.train_batch_sise'.*data.train_batch_size.*c.yaml"):
        load_config([], config_file=tmp_path / "c.yaml")


@pytest.mark.parametrize("override, message", [
    ("data.train_batch_size=eight", "expected an integer"),
    ("trainer.logger=a,b", "multirun sweep"),
    ("~trainer.logger", "deleting keys"),
])
def test_bad_overrides(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([override])


def test_a_key_under_an_open_node_is_added_with_or_without_plus():
    cfg = load_config(["actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=fa3",
                       "+actor_rollout_ref.model.override_config.attention_dropout=0.1"])
    assert cfg["actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend"] == "fa3"
    assert cfg["actor_rollout_ref.model.override_config.attention_dropout"] == 0.1


def test_plus_on_a_key_the_tree_has_sets_it():
    """verl's trees differ between versions, so scripts write '+' for keys another version has."""
    cfg = load_config(["+data.train_batch_size=8", "+actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16"])
    assert cfg["data.train_batch_size"] == 8 and cfg["actor_rollout_ref.actor.fsdp_config.model_dtype"] == "bfloat16"
    assert "data.train_batch_size" in cfg.provided


@pytest.mark.parametrize("override, feature", [
    ("actor_rollout_ref.actor.strategy=deepspeed", "names no backend of rlflow (fsdp, fsdp2, megatron) nor of verl"),
    ("actor_rollout_ref.model.backend=deepspeed", "names no backend of rlflow (fsdp, fsdp2, megatron) nor of verl"),
    ("trainer.logger=[swanlab]", "swanlab logger"),
])
def test_recognised_features_fail_as_not_supported_yet(override, feature):
    with pytest.raises(NotSupportedError, match="not supported yet") as e:
        plan(override)
    assert feature in str(e.value) and override.split("=")[0] in str(e.value)


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.backend", "actor_rollout_ref.actor.strategy",
                                 "critic.strategy"])
@pytest.mark.parametrize("value, backend", [("veomni", "VeOmni"), ("torchtitan", "TorchTitan"),
                                            ("automodel", "NeMo AutoModel"), ("fsdp_turbo", "FSDP Turbo"),
                                            ("mlite", "Megatron Lite (verl_mlite)")])
def test_a_foreign_training_strategy_is_refused_naming_its_backend(key, value, backend):
    extra = ["critic.enable=True"] if key.startswith("critic") else []
    with pytest.raises(NotSupportedError) as e:
        plan(f"{key}={value}", *extra)
    assert f"{key}={value!r}: verl's {backend} engine, a training backend rlflow does not have" in str(e.value)


def test_a_custom_async_server_is_accepted_with_a_note_as_verl_since_0_6_never_reads_it():
    server = "actor_rollout_ref.rollout.agent.custom_async_server"
    p = plan(f"{server}.path=my_server.py", f"{server}.name=MyServer")
    notes = [n for n in unused_notes(p.cfg) if "custom_async_server" in n]
    assert len(notes) == 2 and all("no code of verl reads it since 0.6" in n for n in notes), notes
    assert p.rollout_kwargs == plan().rollout_kwargs


def test_an_unknown_training_strategy_lists_the_backends_there_are():
    with pytest.raises(NotSupportedError) as e:
        plan("actor_rollout_ref.actor.strategy=deepspeed")
    assert "'deepspeed', which names no backend of rlflow" in str(e.value)
    assert all(f"{k} ({name})" in str(e.value) for k, name in tables.FOREIGN_STRATEGIES.items())


def test_missing_algorithm_class_is_not_supported_yet(monkeypatch):
    monkeypatch.delattr(rlflow.algorithms, "RLOO", raising=False)
    with pytest.raises(NotSupportedError, match=r"algorithm.adv_estimator='rloo'.*RLOO.*not supported yet"):
        plan("algorithm.adv_estimator=rloo")
    with pytest.raises(ConfigError, match="Did you mean: grpo"):
        plan("algorithm.adv_estimator=grpoo")


def test_new_classes_plug_in_through_their_signature(monkeypatch):
    class RLOO(rlflow.algorithms.AdvantageEstimator):
        def __init__(self, gamma: float = 1.0, *, eps: float = 1e-6):
            self.gamma, self.eps = gamma, eps

    class GSPOLoss(rlflow.algorithms.PPOLoss):
        def __init__(self, tau_pos: float = 1.0, **kwargs):
            super().__init__(**kwargs)
            self.tau_pos = tau_pos

    monkeypatch.setattr(rlflow.algorithms, "RLOO", RLOO, raising=False)
    monkeypatch.setattr(rlflow.algorithms, "GSPOLoss", GSPOLoss, raising=False)
    p = plan("algorithm.adv_estimator=rloo", "algorithm.gamma=0.9", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
             "actor_rollout_ref.actor.tau_pos=2.0", "actor_rollout_ref.actor.kl_loss_coef=0.01")
    assert p.estimator_cls is RLOO and p.estimator_kwargs == {"gamma": 0.9}
    assert p.loss_cls is GSPOLoss and p.loss_kwargs["tau_pos"] == 2.0 and p.loss_kwargs["kl_coef"] == 0.01


def test_loss_scale_factor_reaches_the_loss():
    p = plan("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
             "actor_rollout_ref.actor.loss_scale_factor=512")
    loss = p.loss_cls(**p.loss_kwargs)
    assert (loss.agg, loss.loss_scale_factor) == ("seq-mean-token-sum-norm", 512)
    assert not any("loss_scale_factor" in note for note in unused_notes(p.cfg))


def test_too_many_gpus_says_what_was_found_and_how_to_run():
    with pytest.raises(ConfigError) as e:
        make_plan(load_config(QUICK_START))
    msg = str(e.value)
    assert "trainer.n_gpus_per_node=8" in msg and "this machine has 0 CUDA device(s)" in msg
    assert "trainer.device=cpu trainer.n_gpus_per_node=1" in msg and "to run 8 CPU processes" in msg


def test_one_gpu_found_and_multi_process(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"has 1 CUDA device.*trainer.n_gpus_per_node=1"):
        make_plan(load_config(QUICK_START))
    p = make_plan(load_config(QUICK_START + ["trainer.device=cpu", "trainer.n_gpus_per_node=4"]))
    assert (p.devices.processes, p.devices.strategy) == (4, "fsdp2")
    assert p.trainer_kwargs["devices"] == 4 and p.trainer_kwargs["strategy"] == "fsdp2"


def test_batch_units_are_checked():
    with pytest.raises(ConfigError, match="multiple of actor_rollout_ref.actor.ppo_mini_batch_size"):
        plan("data.train_batch_size=10", "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    with pytest.raises(ConfigError, match=r"2 x 8 = 16 trajectories, not a multiple of .*=5"):
        plan("data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5")
    p = plan("data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
             "actor_rollout_ref.actor.ppo_micro_batch_size=4")  # deprecated global form / 1 process
    assert (p.trainer_kwargs["batch_size"], p.trainer_kwargs["mini_batch_size"], p.trainer_kwargs["micro_batch_size"]) == (4, 2, 4)


def test_keys_that_change_nothing_get_a_note():
    p = plan("critic.ppo_mini_batch_size=64", "actor_rollout_ref.rollout.gpu_memory_utilization=0.9",
             "algorithm.kl_ctrl.target_kl=0.2")
    notes = "\n".join([*p.notes, *unused_notes(p.cfg)])
    assert "critic.ppo_mini_batch_size=64 is not used by this configuration" in notes
    assert "gpu_memory_utilization=0.9 has no effect in rlflow: a vLLM/SGLang engine setting" in notes
    assert "algorithm.kl_ctrl.target_kl=0.2 is not used" in notes


def test_chained_modules_kl_in_reward_remax_and_rollout_correction():
    p = plan("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.2",
             "algorithm.kl_penalty=low_var_kl", "algorithm.adv_estimator=remax",
             "algorithm.rollout_correction.rollout_is=token")
    A = rlflow.algorithms
    assert p.kl_controller == (A.AdaptiveKLController, {"target_kl": 0.2})
    assert [cls for cls, _ in p.before] == [A.KLInReward, A.GreedyBaseline] and p.estimator_cls is A.ReMax
    assert p.before[0][1]["kind"] == "low_var_kl"
    assert p.after == [(A.TruncatedIS, {"level": "token", "threshold": 2.0})] and p.loss_kwargs["is_weights"] is True
    rc = "algorithm.rollout_correction"
    p = plan(f"{rc}.rollout_rs='token_k1,seq_max_k2'", f"{rc}.rollout_rs_threshold='0.6_1.6,2.5'")
    assert p.after == [(A.RejectionSampling, {"options": "token_k1,seq_max_k2", "threshold": "0.6_1.6,2.5"})]
    assert "is_weights" not in p.loss_kwargs  # rejection alone: no IS weights for the loss
    p = plan(f"{rc}.rollout_is=sequence", f"{rc}.rollout_rs=token_k1", f"{rc}.rollout_rs_threshold=2")
    assert [c for c, _ in p.after] == [A.TruncatedIS, A.RejectionSampling] and p.loss_kwargs["is_weights"] is True
    with pytest.raises(ConfigError, match="rollout_rs='token_k1', rollout_rs_threshold=None: .*must be set"):
        plan(f"{rc}.rollout_rs=token_k1")
    with pytest.raises(ConfigError, match="rollout_rs='seq_max_k1'.*unknown"):
        plan(f"{rc}.rollout_rs=seq_max_k1", f"{rc}.rollout_rs_threshold=2")


def test_bypass_mode_replaces_the_loss_and_moves_the_correction_into_it():
    """verl's apply_bypass_mode: old log-probs = the sampler's (RolloutAsOld first in the chain), the loss
    is verl's bypass loss (loss_type), the IS / RS settings go to it instead of the chain."""
    A, rc = rlflow.algorithms, "algorithm.rollout_correction"
    p = plan(f"{rc}.bypass_mode=true", f"{rc}.loss_type=reinforce", f"{rc}.rollout_is=sequence",
             f"{rc}.rollout_rs='token_k1,seq_max_k2'", f"{rc}.rollout_rs_threshold='0.6_1.6,2.5'",
             "actor_rollout_ref.actor.policy_loss.loss_mode=gspo")
    assert p.loss_cls is A.BypassLoss and [c for c, _ in p.before] == [A.RolloutAsOld] and p.after == []
    kw = p.loss_kwargs
    assert kw["loss_type"] == "reinforce" and "is_weights" not in kw
    assert (kw["weights"].level, kw["weights"].threshold) == ("sequence", 2.0)
    assert kw["rejection"].thresholds == {"token_k1": (0.6, 1.6), "seq_max_k2": (None, 2.5)}
    assert any("loss_mode='gspo' is replaced by verl's bypass loss" in n for n in p.notes)
    p = plan(f"{rc}.bypass_mode=true", "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode")
    assert p.loss_cls is A.BypassLoss and p.loss_kwargs["loss_type"] == "ppo_clip"  # verl's default
    assert p.loss_kwargs["weights"] is None and p.loss_kwargs["rejection"] is None
    assert not [n for n in p.notes if "bypass" in n]
    with pytest.raises(ConfigError, match=f"{rc}.loss_type='ppo': unknown; valid: ppo_clip, reinforce"):
        plan(f"{rc}.bypass_mode=true", f"{rc}.loss_type=ppo")
    with pytest.raises(ConfigError, match=f"loss_mode=bypass_mode needs {rc}.bypass_mode=True"):
        plan("actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode")
    notes = unused_notes(plan(f"{rc}.loss_type=reinforce").cfg)
    assert f"{rc}.loss_type='reinforce' has no effect in rlflow: only used with {rc}.bypass_mode=True" in notes


def test_every_verl_key_is_honoured_inert_or_not_supported(tmp_path):
    """Completeness: each key of the default tree is read by a GRPO or a PPO plan, or is in a table."""
    read = set()
    for extra in (["algorithm.use_kl_in_reward=false"], ["algorithm.adv_estimator=gae", "critic.model.path=x"]):
        p = plan(*extra)
        read |= p.cfg.read
    from rlflow.config.verl.algos import ESTIMATOR_POOL, KL_CTRL_POOL, KL_IN_REWARD_KEYS, loss_pool

    for pool in (ESTIMATOR_POOL, KL_CTRL_POOL, loss_pool(p.cfg)):  # read by whichever class takes the argument
        read |= {k for c in pool.values() for k in c.keys}
    read |= set(KL_IN_REWARD_KEYS)
    keys = flatten(load_config([]).tree)
    refused = {k for k, _, _ in tables.not_supported(keys)}
    missing = [k for k in keys if k not in read and k not in refused and not tables.inert_reason(k)]
    assert not missing, missing


def test_docs_page_lists_every_verl_key():
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "verl-compat.md").read_text()
    keys = flatten(load_config([]).tree)
    absent = [k for k in keys if f"`{k}`" not in doc and not any(
        f"`{p}`" in doc for p in tables.INERT if "*" in p and __import__("fnmatch").fnmatchcase(k, p))]
    assert not absent, absent
    assert DEFAULTS_FILE.exists()


def test_native_recipe_maps_to_the_same_plan(tmp_path):
    (tmp_path / "r.yaml").write_text(
        "policy: {path: m}\nrollout: {n: 4, temperature: 0.7, max_new_tokens: 64}\nestimator: grpo\n"
        "loss: {clip_ratio: 0.25, kl_coef: 0.01}\ndata: {train: t.parquet, max_prompt_length: 32}\n"
        "trainer: {batch_size: 8, mini_batch_size: 4, lr: 1.0e-5, max_steps: 3, device: cpu}\n")
    from rlflow.config.verl.native import load_native

    native = make_plan(load_native(tmp_path / "r.yaml", ["rollout.n=2"]))
    verl = make_plan(load_config([  # recipe paths are relative to the recipe; "m" is a hub id (no such folder there)
        "actor_rollout_ref.model.path=m", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.temperature=0.7",
        "data.max_response_length=64", "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.clip_ratio=0.25",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.01",
        f"data.train_files={tmp_path}/t.parquet", "data.max_prompt_length=32", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.optim.lr=1e-5",
        "trainer.total_training_steps=3", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", "trainer.logger=[console,jsonl]",
        "trainer.total_epochs=1", "trainer.default_local_dir=runs/rlflow"]))
    for field in ("policy_kwargs", "rollout_kwargs", "estimator_kwargs", "loss_kwargs", "data_kwargs"):
        assert getattr(native, field) == getattr(verl, field), field
    drop = {"optimizer"}
    assert {k: v for k, v in native.trainer_kwargs.items() if k not in drop} == \
        {k: v for k, v in verl.trainer_kwargs.items() if k not in drop}
    with pytest.raises(ConfigError, match="rollout.n"):
        load_native(tmp_path / "r.yaml", ["rollout.nn=2"])


SEED_PPO_YAML = """
algorithm:
  adv_estimator: gae  # Use GAE instead of GRPO
  gamma: 0.99
  lam: 0.95

critic:
  model:
    path: Qwen/Qwen2.5-7B-Instruct  # Can be same or different from actor
  ppo_mini_batch_size: 64

actor_rollout_ref:
  actor:
    use_kl_loss: true
    kl_loss_coef: 0.02
    clip_ratio: 0.2  # PPO clipping
"""


def test_seed_ppo_critic_config(tmp_path):
    (tmp_path / "ppo.yaml").write_text(SEED_PPO_YAML)
    p = make_plan(load_config(CPU, config_file=tmp_path / "ppo.yaml"))
    assert p.estimator_cls is rlflow.algorithms.GAE and p.estimator_kwargs == {"gamma": 0.99, "lam": 0.95}
    assert p.critic_path == "Qwen/Qwen2.5-7B-Instruct" and p.loss_kwargs["kl_coef"] == 0.02
    # the Trainer updates actor and critic on one mini-batching: the value the user set applies to both
    assert p.trainer_kwargs["mini_batch_size"] == 64
    assert any("critic.ppo_mini_batch_size=64 applies to the actor too" in n for n in p.notes)
    with pytest.raises(ConfigError, match="set them equal"):
        make_plan(load_config(CPU + ["actor_rollout_ref.actor.ppo_mini_batch_size=32"], config_file=tmp_path / "ppo.yaml"))


def test_dynamic_bsz_and_remove_padding_reach_the_objects():
    p = plan("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512")
    assert p.trainer_kwargs["max_tokens_per_micro_batch"] == 512
    assert p.policy_kwargs["remove_padding"] is True  # verl's default use_remove_padding=true
    assert plan().trainer_kwargs["max_tokens_per_micro_batch"] is None
    assert p.policy_kwargs["max_tokens_per_micro_batch"] == 512  # the log-prob keys follow the actor's (verl)
    assert (p.ref_micro_batch_size, p.ref_max_tokens) == (None, 512)
    assert plan().policy_kwargs["max_tokens_per_micro_batch"] is None and plan().ref_max_tokens is None
