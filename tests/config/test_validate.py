"""Whole-config validation before anything heavy loads: each bad input is named, all are reported at once."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import rlflow.config.verl.devices as devices
from rlflow.cli import main as cli_main
from rlflow.config import ConfigError, ConfigProblems
from rlflow.config.verl.run import load_and_check, parse_args

EXAMPLE = Path(__file__).parents[2] / "examples" / "config" / "grpo_math.yaml"
A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Bad files next to good ones: a CSV, model folders without config.json / weights / tokenizer, a reward file."""
    root = tmp_path_factory.mktemp("bad")
    (root / "train.csv").write_text("prompt\n1+1\n")
    (root / "no_config").mkdir()
    (root / "no_config" / "weights.bin").write_bytes(b"")
    (root / "no_weights").mkdir()
    (root / "no_weights" / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 64}))
    (root / "no_tokenizer").mkdir()
    (root / "no_tokenizer" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (root / "no_tokenizer" / "pytorch_model.bin").write_bytes(b"")
    (root / "reward.py").write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                    "    return 0.0\n")
    pd.DataFrame({"question": ["1+1"], "answer": ["2"]}).to_parquet(root / "questions.parquet")
    return root


def message(argv: list[str]) -> str:
    """The one error message the command line would print for ``argv`` ('' when the config is fine)."""
    try:
        load_and_check(parse_args(argv))
    except ConfigError as e:
        return str(e)
    return ""


def test_the_tiny_config_is_valid(tiny):
    assert message(tiny) == ""


# (overrides, texts the message must contain): one bad value each; every message names the key
BAD_VALUES = [
    (["data.max_response_length=0"], ["data.max_response_length=0: must be >= 1"]),
    (["data.max_prompt_length=-3"], ["data.max_prompt_length=-3: must be >= 1"]),
    (["data.train_batch_size=0"], ["data.train_batch_size=0: must be >= 1"]),
    ([f"{R}.temperature=-0.5"], [f"{R}.temperature=-0.5: must be >= 0"]),
    ([f"{R}.top_p=1.5"], [f"{R}.top_p=1.5: must be in (0, 1]"]),
    ([f"{R}.top_k=-2"], [f"{R}.top_k=-2: must be >= -1"]),
    ([f"{R}.n=0"], [f"{R}.n=0: must be >= 1"]),
    ([f"{R}.val_kwargs.n=0"], [f"{R}.val_kwargs.n=0: must be >= 1"]),
    ([f"{A}.clip_ratio=0"], [f"{A}.clip_ratio=0: must be > 0"]),
    ([f"{A}.clip_ratio_c=0.5"], [f"{A}.clip_ratio_c=0.5: must be > 1"]),
    ([f"{A}.kl_loss_coef=-1"], [f"{A}.kl_loss_coef=-1: must be >= 0"]),
    ([f"{A}.entropy_coeff=nan"], [f"{A}.entropy_coeff=nan: must be a finite number"]),
    ([f"{A}.optim.lr=0"], [f"{A}.optim.lr=0: must be > 0"]),
    ([f"{A}.optim.lr_warmup_steps_ratio=2"], ["lr_warmup_steps_ratio=2: must be in [0, 1]"]),
    ([f"{A}.ppo_epochs=0"], [f"{A}.ppo_epochs=0: must be >= 1"]),
    ([f"{A}.ppo_micro_batch_size_per_gpu=0"], ["ppo_micro_batch_size_per_gpu=0: must be >= 1"]),
    ([f"{A}.optim.betas=[0.9]"], [f"{A}.optim.betas=[0.9]: must be two numbers in [0, 1)"]),
    (["algorithm.gamma=1.5"], ["algorithm.gamma=1.5: must be in [0, 1]"]),
    (["algorithm.lam=-0.1"], ["algorithm.lam=-0.1: must be in [0, 1]"]),
    (["trainer.n_gpus_per_node=0"], ["trainer.n_gpus_per_node=0: must be >= 1"]),
    (["data.truncation=sideways"], ["data.truncation='sideways': choose from error, left, right, middle"]),
    ([f"{A}.loss_agg_mode=token-meen"], [f"{A}.loss_agg_mode='token-meen'", "did you mean token-mean"]),
    (["algorithm.kl_penalty=k4"], ["algorithm.kl_penalty='k4': choose from"]),
    (["trainer.resume_mode=sometimes"], ["trainer.resume_mode='sometimes': choose from auto, disable, resume_path"]),
    (["trainer.resume_mode=resume_path"], ["trainer.resume_mode=resume_path needs trainer.resume_from_path"]),
    (["trainer.val_only=true", "data.val_files=null"], ["trainer.val_only=True needs data.val_files"]),
    (["trainer.logger=[console,foo]"], ["trainer.logger: unknown logger 'foo'"]),
    (["trainer.logger=[swanlab]"], ["trainer.logger='swanlab': the swanlab logger is not supported yet"]),
    (["algorithm.adv_estimator=grpoo"], ["algorithm.adv_estimator='grpoo': not a registered advantage estimator",
                                         "Did you mean: grpo"]),
    ([f"{A}.policy_loss.loss_mode=no_such_pkg.losses:MyLoss"], ["no importable module 'no_such_pkg.losses'"]),
    (["algorithm.adv_estimator=missing_est.py:MedianGRPO"], ["algorithm.adv_estimator='missing_est.py:MedianGRPO': "
                                                              "no such file"]),
    (["data.train_batch_size=4", f"{A}.ppo_mini_batch_size=3"],
     [f"data.train_batch_size=4 must be a multiple of {A}.ppo_mini_batch_size=3"]),
    ([f"{A}.ppo_micro_batch_size_per_gpu=3"], ["= 4 trajectories, not a multiple of", "ppo_micro_batch_size_per_gpu=3"]),
    ([f"{A}.ppo_micro_batch_size_per_gpu=2", f"{A}.ppo_micro_batch_size=2"],
     [f"set only one of {A}.ppo_micro_batch_size_per_gpu=2 and {A}.ppo_micro_batch_size=2"]),
    (["algorithm.filter_groups.enable=true"], ["algorithm.filter_groups.enable=True needs algorithm.filter_groups.metric"]),
    (["reward_model.reward_manager=batch"], ["reward_model.reward_manager=batch needs custom_reward_function.path"]),
    (["reward_model.reward_manager=fancy"], ["reward_model.reward_manager='fancy': choose from naive, batch"]),
    ([f"{A}.ulysses_sequence_parallel_size=2"], [f"{A}.ulysses_sequence_parallel_size=2 must divide the number of "
                                                 "processes (1)"]),
    (["trainer.device=cuda", "trainer.n_gpus_per_node=2"], ["trainer.n_gpus_per_node=2 asks for 2 GPU(s)",
                                                            "this machine has 0 CUDA device(s)"]),
    (["actor_rollout_ref.model.external_lib=no_such_module_xyz"], ["external_lib='no_such_module_xyz': no importable"]),
    (["data.max_prompt_length=60", "data.max_response_length=10"],
     ["data.max_prompt_length + data.max_response_length = 60 + 10 = 70 tokens exceeds the model's "
      "max_position_embeddings=64"]),
    (["data.train_batch_size=16", f"{A}.ppo_mini_batch_size=16"], ["data.train_batch_size=16 > 12 training prompts"]),
    (["data.train_batch_size=eight"], ["data.train_batch_size='eight': expected an integer"]),
    (["trainer.totl_epochs=3"], ["unknown config key 'trainer.totl_epochs'", "Did you mean: trainer.total_epochs"]),
    (["actor_rollout_ref.model.path=./no/such/model"], ["actor_rollout_ref.model.path='./no/such/model': no such folder"]),
    (["data.train_files=missing.parquet"], ["data.train_files='missing.parquet': no such file"]),
    (["custom_reward_function.path=missing_reward.py"], ["custom_reward_function.path='missing_reward.py': no such file"]),
]


@pytest.mark.parametrize("overrides, expected", BAD_VALUES, ids=[" ".join(o)[:60] for o, _ in BAD_VALUES])
def test_bad_value_is_named(tiny, overrides, expected):
    text = message(tiny + overrides)
    for part in expected:
        assert part in text, (part, text)


def test_bad_files_and_model_folders_are_named(tiny, files, data_dir):
    cases = [
        ([f"data.train_files={files}/train.csv"], "unsupported file type '.csv'"),
        ([f"data.val_files=[{data_dir}/test.parquet,{files}/missing.parquet]"], "missing.parquet': no such file"),
        ([f"data.train_files={files}"], "is a folder; give the data file(s) in it"),
        ([f"data.train_files={files}/questions.parquet", "data.train_batch_size=1", f"{A}.ppo_mini_batch_size=1"],
         "data.prompt_key='prompt': " + f"{files}/questions.parquet has no such column (columns: question, answer)"),
        ([f"actor_rollout_ref.model.path={files}/no_config"],
         f"actor_rollout_ref.model.path: {files}/no_config: no config.json, so not a Hugging Face model folder"),
        ([f"actor_rollout_ref.model.path={files}/no_weights"], f"{files}/no_weights: no weights (model.safetensors"),
        ([f"actor_rollout_ref.model.path={files}/no_tokenizer"], f"{files}/no_tokenizer: no tokenizer files"),
        ([f"custom_reward_function.path={files}/reward.py"],
         "custom_reward_function.name='compute_score': " + f"{files}/reward.py defines no function 'compute_score' "
         "(it defines functions: my_score). Set custom_reward_function.name=my_score."),
    ]
    for overrides, expected in cases:
        assert expected in message(tiny + overrides), (overrides, message(tiny + overrides))



def test_a_dry_run_needs_no_weights(tiny, files):
    """A dry run reads config.json and the tokenizer (a 70B layout can be planned from a config alone)."""
    without = [f"actor_rollout_ref.model.path={files}/no_weights"]
    assert "no weights" in message(tiny + without)
    assert "no weights" not in message(["--dry-run"] + tiny + without)
    assert "no tokenizer files" in message(["--dry-run"] + tiny + without)  # the dry run reads the tokenizer

def test_hub_id_offline_fails_at_once_with_one_clear_message(tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    text = message(tiny + ["actor_rollout_ref.model.path=Qwen/Not-A-Real-Model-0.5B"])
    assert "the hub model 'Qwen/Not-A-Real-Model-0.5B' is not in the Hugging Face cache" in text
    assert "HF_HUB_OFFLINE=1 is set" in text and "hf download Qwen/Not-A-Real-Model-0.5B" in text
    assert "huggingface-cli" not in text


def test_every_problem_comes_in_one_message(tiny):
    """Four problems of four kinds (unknown key, range, file, devices), one launch, one message."""
    text = message(tiny + ["trainer.totl_epochs=3", "data.max_response_length=0", "data.train_files=missing.parquet",
                           "trainer.device=cuda"])
    assert text.startswith("4 problems in the config:")
    for part in ("trainer.totl_epochs", "data.max_response_length=0", "missing.parquet': no such file",
                 "0 CUDA device(s)"):
        assert part in text


def test_seed_example_config_reports_all_its_problems_at_once(capsys):
    """The seed's grpo_math.yaml on this machine: data, model and GPUs, in one run, exit code 2."""
    argv = ["--config-path", str(EXAMPLE.parent), "--config-name", EXAMPLE.stem]
    with pytest.raises(ConfigProblems) as e:
        load_and_check(parse_args(argv))
    text = str(e.value)
    for part in ("data.train_files='~/data/gsm8k/train.parquet': no such file",
                 "data.val_files='~/data/gsm8k/test.parquet': no such file",
                 "actor_rollout_ref.model.path='~/models/Qwen2.5-7B-Instruct': no such folder",
                 "trainer.n_gpus_per_node=8 asks for 8 GPU(s)"):
        assert part in text, part


def test_a_config_error_comes_back_without_importing_torch(tmp_path):
    """The command line checks the whole config before torch, transformers or Lightning load."""
    code = ("import sys; from rlflow.cli import main; rc = main(['train', 'data.train_files=missing.parquet']); "
            "print(rc, sorted(m for m in ('torch', 'transformers', 'lightning_fabric') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.stdout.split("\n")[0] == "2 []", out.stdout + out.stderr
    assert "data.train_files='missing.parquet': no such file" in out.stderr
    assert cli_main.__module__ == "rlflow.cli"



def test_export_of_a_missing_folder_says_so_without_importing_torch(tmp_path):
    """``rlflow export`` names a wrong checkpoint path before torch and transformers load."""
    code = ("import sys; from rlflow.cli import main; rc = main(['export', 'runs/x/global_step_9', 'out']); "
            "print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.stdout.split("\n")[0] == "2 []", out.stdout + out.stderr
    assert "checkpoint folder runs/x/global_step_9 does not exist" in out.stderr

def test_recipe_keys_typos_suggest_native_keys(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("policy: {path: m}\nrolout: {n: 2}\ntrainer: {batch_sise: 4}\n")
    text = message(["--config", str(recipe), "rollout.nn=2"])
    assert "unknown config key 'rolout.n'" in text and "Did you mean: rollout.n" in text
    assert "unknown config key 'trainer.batch_sise'" in text and "trainer.batch_size" in text
    assert "unknown config key 'rollout.nn' (on the command line: neither a native recipe key nor a verl key)" in text
    assert "Did you mean: rollout.n" in text.split("rollout.nn")[1]



def test_recipe_values_are_named_by_the_recipe_key_too(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("policy: {path: m}\nrollout: {n: 0}\ndata: {train: t.parquet}\n")
    text = message(["--config", str(recipe), "rollout.temperature=-1"])
    assert "rollout.n: actor_rollout_ref.rollout.n=0: must be >= 1" in text
    assert "rollout.temperature: actor_rollout_ref.rollout.temperature=-1: must be >= 0" in text
    assert f"data.train: data.train_files='{tmp_path}/t.parquet': no such file" in text

def test_recipe_paths_are_relative_to_the_recipe_file(tmp_path, model_dir, data_dir, monkeypatch):
    """A recipe runs from any folder: its model, data and reward paths are taken from its own folder."""
    import shutil

    folder = tmp_path / "project" / "recipes"
    folder.mkdir(parents=True)
    shutil.copytree(model_dir, tmp_path / "project" / "model")
    shutil.copy(data_dir / "train.parquet", tmp_path / "project" / "train.parquet")
    (folder / "score.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                     "    return 1.0\n")
    (folder / "r.yaml").write_text(
        "policy: {path: ../model}\nrollout: {n: 2, max_new_tokens: 4}\nreward: score.py:compute_score\n"
        "data: {train: ../train.parquet, max_prompt_length: 8}\n"
        "trainer: {batch_size: 4, mini_batch_size: 2, max_steps: 1, device: cpu, run_dir: runs/x}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_and_check(parse_args(["--config", str(folder / "r.yaml")]))
    assert cfg["actor_rollout_ref.model.path"] == str(folder / "../model")
    assert cfg["data.train_files"] == str(folder / "../train.parquet")
    assert cfg["custom_reward_function.path"] == str(folder / "score.py")
    assert cfg["trainer.default_local_dir"] == "runs/x"  # outputs stay relative to where the run starts



def test_every_recipe_reads_the_task_that_prepare_task_writes_at_the_repository_root():
    """``rlflow prepare-task addition runs/task`` (from the root) then any recipe: paths relative to recipes/yaml."""
    from omegaconf import OmegaConf

    from rlflow.config.verl.loading import flatten
    from rlflow.config.verl.native import _shorthand, anchor_paths, to_verl

    root = Path(__file__).resolve().parents[2]
    for recipe in sorted((root / "recipes" / "yaml").glob("*.yaml")):  # load_native without the defaults (fast)
        tree = OmegaConf.to_container(OmegaConf.load(recipe))
        tree.pop("verl", None)
        cfg = flatten(anchor_paths(to_verl(flatten(_shorthand(tree)), recipe.name), recipe.parent.resolve()))
        assert Path(cfg["actor_rollout_ref.model.path"]).resolve() == root / "runs" / "task" / "model", recipe.name
        assert Path(cfg["data.train_files"]).resolve() == root / "runs" / "task" / "train.parquet", recipe.name

def test_default_job_flags_with_a_recipe_name_the_native_keys(tmp_path, capsys):
    (tmp_path / "r.yaml").write_text("policy: {path: m}\n")
    with pytest.raises(SystemExit):
        cli_main(["train", "--config", str(tmp_path / "r.yaml"), "--steps", "5"])
    assert "--steps belongs to the default job; with a config, use trainer.max_steps=N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["train", "data.train_files=x.parquet", "--steps", "5"])
    assert "use trainer.total_training_steps=N" in capsys.readouterr().err


def test_choice_tables_match_the_code_they_stand_for():
    """checks.py holds torch-free copies of the names the algorithms accept; they must not drift."""
    from rlflow import registry
    from rlflow.algorithms import functional
    from rlflow.algorithms.correction import LEVELS
    from rlflow.config.verl import checks

    assert checks.AGG_MODES == functional.AGG_MODES
    assert set(checks.KL_KINDS) == set(functional._KL)
    assert set(checks.CHOICES["algorithm.rollout_correction.rollout_is"]) - {None} == set(LEVELS)
    import rlflow.algorithms

    missing = {cls for reg in (registry.ESTIMATORS, registry.POLICY_LOSSES) for cls in reg.builtins.values()
               if not hasattr(rlflow.algorithms, cls)}
    assert missing == {"OptimalTokenBaseline", "TIROptimalTokenBaseline"}  # verl names rlflow reports "not supported yet"
