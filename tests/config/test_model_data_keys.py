"""verl's model and data keys through the verl entry point: chat-template arguments, remote-code model
folders, model config overrides (each shown to change what is built, and a bad one named)."""

import json
import shutil

import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import load_config, make_plan
from rlflow.config.verl.build import build_critic, build_data, build_policy, load_tokenizer
from rlflow.config.verl.loading import ConfigError
from rlflow.config.verl.run import unused_notes
from rlflow.models.tiny import char_tokenizer, tiny_qwen2
from rlflow.trainer.main_ppo import main

# Qwen3's switch in miniature: thinking on (the default) opens with "=", thinking off adds an empty block "#:".
THINKING_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}="
                     "{% if enable_thinking is defined and not enable_thinking %}#:{% endif %}{% endif %}")
KW = "data.apply_chat_template_kwargs"


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("thinking-model")
    tok = char_tokenizer()
    tok.chat_template = THINKING_TEMPLATE
    tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
               seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def first_prompt(overrides):
    plan = make_plan(load_config(overrides))
    tokenizer = load_tokenizer(plan)
    data = build_data(plan, tokenizer)
    train = data.collate(data.train[:1], tokenizer)
    val = next(data.val_batches(tokenizer))
    return plan, tokenizer, train, val


def test_chat_template_kwargs_reach_every_prompt_rendering(tiny, thinking_model, tmp_path):
    base = tiny + [f"actor_rollout_ref.model.path={thinking_model}"]
    _, tok, train, val = first_prompt(base)
    plan, _, train_off, val_off = first_prompt(base + [f"+{KW}.enable_thinking=false"])
    assert train["prompt_text"][0].endswith("=") and train_off["prompt_text"][0].endswith("=#:")
    assert val_off["prompt_text"][0].endswith("=#:")
    # the ids: the same prompt plus the two characters of the empty thinking block (one row: no padding)
    assert train_off["prompt_ids"][0].tolist() == train["prompt_ids"][0].tolist() + tok.convert_tokens_to_ids(["#", ":"])
    assert not [n for n in unused_notes(plan.cfg) if KW in n]  # read: no "has no effect" note, and used
    assert plan.data_kwargs["chat_template_kwargs"] == {"enable_thinking": False}


def test_chat_template_kwargs_reach_the_multi_turn_agent_loop(tiny, thinking_model):
    mt = "actor_rollout_ref.rollout.multi_turn"
    plan = make_plan(load_config(tiny + [f"actor_rollout_ref.model.path={thinking_model}", f"{mt}.enable=true",
                                         f"+{KW}.enable_thinking=false"]))
    assert plan.agent["template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("override, message", [
    (f"+{KW}.tokenize=true", f"{KW}.tokenize: rlflow sets tokenize itself"),
    (f"{KW}=5", f"{KW}=5: must be a mapping"),
])
def test_bad_chat_template_kwargs_are_named(tiny, override, message, capsys):
    assert main(tiny + [override, "--dry-run"]) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- remote code
CUSTOM_CODE = '''
from transformers import Qwen2Config, Qwen2ForCausalLM


class TinyCustomConfig(Qwen2Config):
    model_type = "rlflow_tiny_custom"


class TinyCustomForCausalLM(Qwen2ForCausalLM):
    config_class = TinyCustomConfig
'''


@pytest.fixture(scope="module")
def remote_code_model(model_dir, tmp_path_factory):
    """The tiny model saved as a folder whose config maps its classes to a Python file in the folder."""
    path = tmp_path_factory.mktemp("remote-code") / "custom"
    shutil.copytree(model_dir, path)
    (path / "custom_model.py").write_text(CUSTOM_CODE)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="rlflow_tiny_custom", architectures=["TinyCustomForCausalLM"],
                  auto_map={"AutoConfig": "custom_model.TinyCustomConfig",
                            "AutoModelForCausalLM": "custom_model.TinyCustomForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_remote_code_folder_fails_without_trust_remote_code_naming_the_key(tiny, remote_code_model, capsys):
    assert main(tiny + [f"actor_rollout_ref.model.path={remote_code_model}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "trust_remote_code=True" in err  # transformers' own message ...
    assert "actor_rollout_ref.model.trust_remote_code=True" in err  # ... and the verl key that allows it


def test_trust_remote_code_loads_the_folders_own_classes(tiny, remote_code_model, capsys):
    overrides = tiny + [f"actor_rollout_ref.model.path={remote_code_model}",
                        "actor_rollout_ref.model.trust_remote_code=true"]
    assert main(overrides + ["--dry-run"]) == 0
    assert "trust_remote_code=True" in capsys.readouterr().out  # the Policy.from_pretrained call it prints
    policy = build_policy(make_plan(load_config(overrides)))
    assert type(policy.model).__name__ == "TinyCustomForCausalLM"
    assert type(policy.model.config).__name__ == "TinyCustomConfig"


def test_trust_remote_code_reaches_the_critic_and_a_vllm_engine(tiny, remote_code_model):
    path = f"actor_rollout_ref.model.path={remote_code_model}"
    plan = make_plan(load_config(tiny + [path, "actor_rollout_ref.model.trust_remote_code=true",
                                         "algorithm.adv_estimator=gae", f"critic.model.path={remote_code_model}"]))
    assert type(build_critic(plan).module.lm).__name__ == "TinyCustomForCausalLM"  # critic's follows the actor's
    pytest.importorskip("vllm")
    plan = make_plan(load_config(tiny + [path, "actor_rollout_ref.model.trust_remote_code=true",
                                         "actor_rollout_ref.rollout.name=vllm",
                                         "+actor_rollout_ref.model.override_config.attention_dropout=0.5"]))
    assert plan.rollout_kwargs["engine_kwargs"] == {"trust_remote_code": True,
                                                    "hf_overrides": {"attention_dropout": 0.5}}


# ---------------------------------------------------------------------------------------------- override_config
OC = "actor_rollout_ref.model.override_config"


def test_override_config_changes_the_built_models_config(tiny):
    plan = make_plan(load_config(tiny + [f"+{OC}.attention_dropout=0.25", f"+{OC}.attn_implementation=eager",
                                         f"+{OC}.rope_parameters.rope_theta=500.0"]))
    assert not [n for n in unused_notes(plan.cfg) if OC in n]
    model = build_policy(plan).model
    assert model.config.attention_dropout == 0.25
    assert model.model.layers[0].self_attn.attention_dropout == 0.25  # the built layer read it
    assert model.config._attn_implementation == "eager"
    assert model.config.rope_parameters["rope_theta"] == 500.0
    assert model.model.rotary_emb.inv_freq[1].item() == pytest.approx(500.0 ** (-2 / 16))  # head_dim 16


def test_override_config_model_config_entry_and_the_critic(tiny, model_dir):
    plan = make_plan(load_config(tiny + [f"+{OC}.model_config.attention_dropout=0.5", "algorithm.adv_estimator=gae",
                                         f"critic.model.path={model_dir}",
                                         "+critic.model.override_config.attention_dropout=0.125"]))
    assert build_policy(plan).model.config.attention_dropout == 0.5  # verl's Megatron layout: model_config holds them
    assert build_critic(plan).module.lm.config.attention_dropout == 0.125


def test_an_override_the_config_does_not_have_is_named(tiny, capsys):
    assert main(tiny + [f"+{OC}.rope_theta=1000000.0", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"{OC}.rope_theta=1000000.0: Qwen2Config has no attribute 'rope_theta'" in err
    assert "rope_parameters.rope_theta" in err  # transformers 5 keeps it there
    with pytest.raises(ConfigError, match=f"{OC}.attention_dropot=0.1: Qwen2Config has no .*attention_dropout"):
        build_policy(make_plan(load_config(tiny + [f"+{OC}.attention_dropot=0.1"])))
