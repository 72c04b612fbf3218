"""verl 0.9.1's newer actor_rollout_ref.* / critic.* keys: the ones rlflow honours reach what is built; the rest are
accepted at verl's default and either refused with the feature they ask for or noted as changing nothing here."""

import json
import shutil

import pytest
import torch

import rlflow.config.verl.devices as devices
from rlflow.algorithms import ValueLoss
from rlflow.config import ConfigError, NotSupportedError, load_config, make_plan
from rlflow.config.verl.build import build_critic, build_policy, load_tokenizer, model_notes
from rlflow.config.verl.run import unused_notes
from rlflow.data import keys as K
from rlflow.models.tiny_vlm import save_model_folder, tiny_processor, tiny_qwen2_5_vl
from rlflow.models.vision import vision_tower

A, R, C, M = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "critic", "actor_rollout_ref.model"
PARALLEL = ["actor_rollout_ref.model.path=m", "data.train_files=t.parquet", "trainer.device=cpu",
            "trainer.n_gpus_per_node=2", "data.train_batch_size=4", f"{A}.ppo_mini_batch_size=2",
            "algorithm.adv_estimator=grpo", f"{M}.use_remove_padding=true"]


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


# ------------------------------------------------------------------------ verl 0.9's FSDP engine blocks
def test_the_fsdp_config_ulysses_size_is_the_sequence_parallel_size():
    p = make_plan(load_config(PARALLEL + [f"{A}.fsdp_config.ulysses_sequence_parallel_size=2"]))
    assert p.trainer_kwargs["sequence_parallel_size"] == 2
    assert not any("ulysses" in n for n in [*p.notes, *unused_notes(p.cfg)])  # the reference follows, as in verl
    # the role-level key, when above 1, wins (verl's FSDPActorConfig.__post_init__)
    assert make_plan(load_config(PARALLEL + [f"{A}.ulysses_sequence_parallel_size=2",
                                             f"{A}.fsdp_config.ulysses_sequence_parallel_size=1"])
                     ).trainer_kwargs["sequence_parallel_size"] == 2
    with pytest.raises(ConfigError, match=r"fsdp_config.ulysses_sequence_parallel_size=3 must divide"):
        make_plan(load_config(PARALLEL + [f"{A}.fsdp_config.ulysses_sequence_parallel_size=3"]))
    with pytest.raises(ConfigError, match=r"fsdp_config.ulysses_sequence_parallel_size=2: sequence parallelism "
                                          r"runs on packed sequences"):
        make_plan(load_config(PARALLEL + [f"{A}.fsdp_config.ulysses_sequence_parallel_size=2",
                                          f"{M}.use_remove_padding=false"]))


def test_the_critics_fsdp_block_sets_its_size_and_offload():
    gae = PARALLEL + ["algorithm.adv_estimator=gae", "critic.model.path=m", "critic.model.use_remove_padding=true"]
    p = make_plan(load_config(gae + [f"{A}.fsdp_config.ulysses_sequence_parallel_size=2",
                                     "critic.fsdp.ulysses_sequence_parallel_size=2"]))
    assert p.trainer_kwargs["sequence_parallel_size"] == 2 and not any("applies to every role" in n for n in p.notes)
    p = make_plan(load_config(gae + [f"{A}.fsdp_config.ulysses_sequence_parallel_size=2"]))
    assert any("ignored: critic.ulysses_sequence_parallel_size=1" in n for n in p.notes)
    p = make_plan(load_config(gae + ["critic.fsdp.optimizer_offload=true"]))
    assert p.devices.offload and any(n.startswith("critic.fsdp.optimizer_offload=True: on trainer.device=cpu")
                                     for n in p.notes)


def test_critic_offload_on_a_gpu_is_refused_naming_verl_09s_key(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 1)
    with pytest.raises(NotSupportedError, match="critic.fsdp.param_offload"):
        make_plan(load_config(["actor_rollout_ref.model.path=m", "data.train_files=t.parquet", "trainer.device=cuda",
                               "trainer.n_gpus_per_node=1", "algorithm.adv_estimator=gae", "critic.model.path=m",
                               "critic.fsdp.param_offload=true"]))


# ------------------------------------------------------------------------ the critic's loss
def test_critic_loss_scale_factor_divides_the_seq_mean_token_sum_norm_value_loss(tiny):
    p = make_plan(load_config(tiny + ["algorithm.adv_estimator=gae", "critic.model.path=x",
                                      "critic.loss_agg_mode=seq-mean-token-sum-norm", "critic.loss_scale_factor=2"]))
    assert p.value_loss_kwargs["loss_scale_factor"] == 2
    torch.manual_seed(0)
    batch = {K.VALUES: torch.randn(3, 4), K.OLD_VALUES: torch.randn(3, 4), K.RETURNS: torch.randn(3, 4),
             K.RESPONSE_MASK: torch.ones(3, 4)}
    from tensordict import TensorDict

    td = TensorDict(batch, batch_size=[3])
    scaled = ValueLoss(**p.value_loss_kwargs)(td).loss
    default = ValueLoss(**(p.value_loss_kwargs | {"loss_scale_factor": None}))(td).loss
    assert torch.allclose(scaled, default * 4 / 2)  # verl's default divisor is the response length, 4
    with pytest.raises(ConfigError, match="critic.loss_scale_factor"):
        make_plan(load_config(tiny + ["algorithm.adv_estimator=gae", "critic.model.path=x", "critic.loss_scale_factor=0"]))


# ------------------------------------------------------------------------ the rollout
def test_rollout_seed_is_the_vllm_engines_seed(tiny):
    pytest.importorskip("vllm")  # a plan with rollout.name=vllm needs vLLM installed (the README venv has none)
    vllm = tiny + [f"{R}.name=vllm"]
    assert make_plan(load_config(vllm + [f"{R}.seed=7"])).rollout_kwargs["engine_seed"] == 7
    assert make_plan(load_config(vllm + ["data.seed=3"])).rollout_kwargs["engine_seed"] == 3  # unset: data.seed


def test_rollout_seed_under_the_hf_rollout_gets_a_note(tiny):
    p = make_plan(load_config(tiny + [f"{R}.seed=7"]))  # the HF rollout: the trainer's stream
    assert any(n.startswith(f"{R}.seed=7 has no effect in rlflow: with name=vllm, the engine's seed")
               for n in unused_notes(p.cfg))


# ------------------------------------------------------------------------ what is loaded
def test_tokenizer_path_and_hf_config_path_say_what_is_loaded(tiny, model_dir, tmp_path):
    tokenizer_dir, config_dir = tmp_path / "tok", tmp_path / "cfg"
    shutil.copytree(model_dir, tokenizer_dir)
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(
        json.loads((model_dir / "tokenizer_config.json").read_text()) | {"chat_template": "{{ 'T' }}"}))
    (tokenizer_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_dir.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (config_dir / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 0.125}))
    p = make_plan(load_config(tiny + [f"{M}.tokenizer_path={tokenizer_dir}", f"{M}.hf_config_path={config_dir}",
                                      "algorithm.adv_estimator=gae", f"critic.model.path={model_dir}",
                                      f"critic.model.hf_config_path={config_dir}"]))
    policy = build_policy(p)
    assert policy.tokenizer.chat_template == "{{ 'T' }}" == load_tokenizer(p).chat_template
    assert policy.model.config.rms_norm_eps == 0.125
    assert build_critic(p).module.lm.config.rms_norm_eps == 0.125
    plain = make_plan(load_config(tiny))
    assert build_policy(plain).model.config.rms_norm_eps != 0.125
    assert load_tokenizer(plain).chat_template != "{{ 'T' }}"


# ------------------------------------------------------------------------ vision-language models
@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-model")
    processor = tiny_processor()
    save_model_folder(tiny_qwen2_5_vl(processor.tokenizer, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0),
                      processor, root)
    return root


def test_freeze_vision_tower_freezes_only_the_vision_tower(tiny, vlm_dir):
    p = make_plan(load_config(tiny + [f"{M}.path={vlm_dir}", f"{A}.freeze_vision_tower=true"]))
    policy = build_policy(p)
    tower = {id(q) for q in vision_tower(policy.model).parameters()}
    params = list(policy.model.parameters())
    assert tower and all(not q.requires_grad for q in params if id(q) in tower)
    assert all(q.requires_grad for q in params if id(q) not in tower)
    trained = build_policy(make_plan(load_config(tiny + [f"{M}.path={vlm_dir}"])))
    assert all(q.requires_grad for q in vision_tower(trained.model).parameters())


def test_freeze_vision_tower_on_a_text_model_is_a_note(tiny):
    p = make_plan(load_config(tiny + [f"{A}.freeze_vision_tower=true"]))
    policy = build_policy(p)
    assert all(q.requires_grad for q in policy.model.parameters())
    assert any("freeze_vision_tower=True" in n and "no vision tower" in n for n in model_notes(p))


# ------------------------------------------------------------------------ refused, and inert
@pytest.mark.parametrize("override, feature", [
    (f"{M}.mtp.enable=true", "multi-token prediction"),
    (f"{R}.disaggregation.enabled=true", "prefill/decode disaggregation"),
    (f"{R}.quantization=torchao", "quantized rollouts"),
])
def test_keys_that_would_change_the_run_are_refused_naming_the_feature(tiny, override, feature):
    with pytest.raises(ConfigError) as e:  # a NotSupportedError (more than one when others interpolate the key)
        make_plan(load_config(tiny + [override]))
    key = override.split("=")[0]
    assert f"{key}=" in str(e.value) and f"{feature}" in str(e.value) and "not supported" in str(e.value)


def test_rollout_routing_is_recorded_by_the_hf_rollout_and_refused_for_a_server(tiny):
    """enable_rollout_routing_replay (verl's R3, the rollout's side): HFRollout records the routed experts; a server
    rollout cannot return them, refused naming the feature (tests/megatron/test_verl_keys.py: vLLM's reason)."""
    hf = make_plan(load_config(tiny + [f"{R}.enable_rollout_routing_replay=true", f"{R}.name=hf"]))
    assert hf.rollout_cls.__name__ == "HFRollout" and hf.rollout_kwargs["return_routed_experts"]
    assert any(n.startswith(f"{R}.enable_rollout_routing_replay=True: the rollout records") for n in hf.notes)
    with pytest.raises(ConfigError, match=f"{R}.enable_rollout_routing_replay=True: MoE routing replay from the "
                                          "rollout with ServerRollout .* not supported"):
        make_plan(load_config(tiny + [f"{R}.enable_rollout_routing_replay=true", f"{R}.name=vllm",
                                      f"{R}.server.url=http://127.0.0.1:9"]))


@pytest.mark.parametrize("override, reason", [
    (f"{M}.tiled_mlp.enabled=true", "a memory setting"),
    (f"{R}.prometheus.enable=true", "no Prometheus metrics"),
    (f"{R}.scheduling_policy=priority", "vLLM's request order"),
    (f"{A}.fsdp_config.use_orig_params=true", "an FSDP1 setting"),
    (f"{A}.calculate_entropy=true", "always computes the entropy"),
    (f"{M}.lora.alpha=8", "only used with model.lora.rank > 0"),
    ("critic.fsdp.reshard_after_forward=false", "an FSDP tuning knob"),
])
def test_keys_that_change_nothing_here_say_so(tiny, override, reason):
    p = make_plan(load_config(tiny + [override]))
    key = override.split("=")[0]
    assert any(n.startswith(f"{key}=") and "has no effect in rlflow" in n and reason in n for n in unused_notes(p.cfg))
