"""The seed's commands end to end through ``rlflow.trainer.main_ppo.main(argv)`` on a tiny local model."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

import rlflow.config.verl.devices as devices
from rlflow.models.checks import activation_checkpointing
from rlflow.cli import main as cli_main
from rlflow.config import load_config, make_plan
from rlflow.config.verl.build import build_trainer, run_notes
from rlflow.trainer.main_ppo import main

EXAMPLE = Path(__file__).parents[2] / "examples" / "config" / "grpo_math.yaml"
QUICK_START = ["algorithm.adv_estimator=grpo", "data.train_files=~/data/gsm8k/train.parquet",
               "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B", "actor_rollout_ref.rollout.n=8",
               "actor_rollout_ref.actor.use_kl_loss=True", "trainer.n_gpus_per_node=8"]
SEED_REWARD = '''
import re

def compute_reward(responses, ground_truths):
    rewards = []
    for response, gt in zip(responses, ground_truths):
        # Extract answer from response
        match = re.search(r'\\\\boxed{([^}]+)}', response)
        if match and match.group(1).strip() == gt.strip():
            rewards.append(1.0)
        else:
            rewards.append(0.0)
    return rewards
'''


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def steps(out: str) -> dict[int, dict[str, float]]:
    """The console logger's lines, parsed back: step -> metrics."""
    lines = {}
    for line in out.splitlines():
        if line.startswith("step:"):
            parts = line.split(" - ")
            lines[int(parts[0][5:])] = {k: float(v) for k, v in (p.rsplit(":", 1) for p in parts[1:])}
    return lines


def test_quick_start_command(tiny, capsys, monkeypatch, tmp_path):
    # as typed in the seed, on a machine without GPUs: a clear error that says how to run here
    assert main(QUICK_START) == 2
    err = capsys.readouterr().err
    assert "this machine has 0 CUDA device(s)" in err and "trainer.device=cpu trainer.n_gpus_per_node=1" in err
    # with that advice (and tiny sizes), the same command trains
    assert main(QUICK_START + tiny) == 0
    out, err = capsys.readouterr()
    logged = steps(out)
    # ends with a summary line, as the default job does; no "Seed set to" after step:0, no datasets bars
    assert re.search(r"\[rlflow\] 2 RL steps \(GRPO\) in \d+ s \(\+ setup \d+ s, validation \d+ s\); "
                     r"val-core/openai/gsm8k/reward/mean@1: \d\.\d\d \(before training\); metrics in ", out.splitlines()[-1])
    assert "Seed set to" not in out + err and "Generating train split" not in out + err
    assert sorted(logged) == [0, 1, 2]  # validation before training at step 0, then 2 RL steps
    assert "val-core/openai/gsm8k/reward/mean@1" in logged[0]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "response_length/mean", "timing_s/gen"):
        assert key in logged[2]
    assert logged[2]["actor/kl_coef"] == 0.001 and logged[2]["training/global_step"] == 2
    assert (tmp_path / "run" / "config.yaml").exists()


def test_seed_yaml_with_config_path_and_name(tiny, model_dir, data_dir, tmp_path, monkeypatch, capsys):
    config = tmp_path / "config"
    config.mkdir()
    text = (EXAMPLE.read_text().replace("~/data/gsm8k/train.parquet", f"{data_dir}/train.parquet")
            .replace("~/data/gsm8k/test.parquet", f"{data_dir}/test.parquet")
            .replace("~/models/Qwen2.5-7B-Instruct", str(model_dir)))
    (config / "grpo_math.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    sizes = ["trainer.device=cpu", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
             "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
             "data.max_response_length=4", "trainer.total_training_steps=2",
             "data.max_prompt_length=8"]  # the seed's 512 + 4 tokens would not fit the tiny model's 64 positions
    argv = ["--config-path", "config", "--config-name", "grpo_math", "trainer.experiment_name=grpo_math_qwen7b"]
    if importlib.util.find_spec("vllm") is None:  # name: vllm in the seed's YAML (tests/rollout run it with vLLM)
        assert main(argv + sizes[:2]) == 2
        assert "actor_rollout_ref.rollout.name=vllm: vllm is not installed" in capsys.readouterr().err
    assert main(argv + sizes) == 0
    run = tmp_path / "checkpoints" / "verl_examples" / "grpo_math_qwen7b"
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "2"  # save_freq=100: last step
    assert (run / "global_step_2" / "state.ckpt").exists()  # verl's layout: default_local_dir/global_step_N


def test_ppo_with_critic(tiny, model_dir, capsys):
    assert main(tiny + ["algorithm.adv_estimator=gae", f"critic.model.path={model_dir}",
                        "critic.ppo_micro_batch_size_per_gpu=2", "algorithm.lam=0.95", "trainer.val_before_train=false"]) == 0
    logged = steps(capsys.readouterr().out)
    assert {"critic/vf_loss", "critic/values/mean", "critic/vf_explained_var", "critic/lr"} <= set(logged[2])
    assert logged[2]["critic/lr"] == 1e-5


def test_custom_reward_function_files(tiny, tmp_path, capsys):
    (tmp_path / "reward_function.py").write_text(SEED_REWARD)
    base = tiny + [f"custom_reward_function.path={tmp_path}/reward_function.py", "trainer.val_before_train=false"]
    assert main(base) == 2  # the default name is compute_score: the error points at compute_reward
    assert "custom_reward_function.name=compute_reward" in capsys.readouterr().err
    trainer, _ = build_trainer(make_plan(load_config(base + ["custom_reward_function.name=compute_reward"])))
    assert trainer.reward.form == "batch" and trainer.reward.name == "compute_reward"
    # a batch function whose scores are visible: the response length
    (tmp_path / "length.py").write_text("def compute_reward(responses, ground_truths):\n"
                                        "    return [float(len(r)) for r in responses]\n")
    assert main(tiny + [f"custom_reward_function.path={tmp_path}/length.py", "custom_reward_function.name=compute_reward",
                        "trainer.val_before_train=false", "trainer.logger=[console,file]"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["critic/score/mean"] > 0 and rows[-1]["reward/errors"] == 0


def test_troubleshooting_keys_land_on_objects(tiny, capsys):
    overrides = tiny + [
        "actor_rollout_ref.rollout.log_prob_micro_batch_size=4", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.fsdp_config.offload_policy=true",
        "actor_rollout_ref.actor.lr=5e-7", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.01", "actor_rollout_ref.actor.max_grad_norm=0.5",
        "actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.rollout.top_p=0.95",
        "actor_rollout_ref.actor.clip_ratio=0.3", "algorithm.kl_ctrl.target_kl=0.1",
    ]
    plan = make_plan(load_config(overrides))
    trainer, _ = build_trainer(plan)
    assert trainer.policy.micro_batch_size == 4
    assert activation_checkpointing(trainer.policy.model)
    assert type(trainer.fabric.strategy).__name__ == "SingleDeviceStrategy"
    assert any("strategy=fsdp2 on 1 process" in n for n in plan.notes)
    assert plan.devices.offload and any("offload_policy=True" in n for n in plan.notes)
    assert trainer.optimizer.param_groups[0]["lr"] == 5e-7
    assert trainer.loss.kl_coef == 0.01 and trainer.max_grad_norm == 0.5
    assert trainer.loss.clip_low == trainer.loss.clip_high == 0.3
    assert trainer.rollout.temperature == trainer.policy.temperature == 0.7 and trainer.rollout.top_p == 0.95
    from rlflow.config.verl.run import unused_notes

    assert "algorithm.kl_ctrl.target_kl=0.1 is not used by this configuration" in "\n".join(unused_notes(plan.cfg))
    assert main(tiny + ["actor_rollout_ref.actor.strategy=deepspeed"]) == 2
    err = capsys.readouterr().err
    assert "actor_rollout_ref.actor.strategy='deepspeed': " in err and "not supported yet" in err


def test_scoring_token_budgets_land_on_objects(tiny, model_dir, capsys):
    """verl's log-prob / value token budgets reach Policy, reference and Critic; the micro sizes are unused then."""
    R, REF = "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
    overrides = tiny + [
        "algorithm.adv_estimator=gae", f"critic.model.path={model_dir}", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.ppo_epochs=2",  # old log-probs are computed
        f"{R}.log_prob_use_dynamic_bsz=true", f"{R}.log_prob_max_token_len_per_gpu=40",
        f"{R}.log_prob_micro_batch_size_per_gpu=2", f"{REF}.log_prob_use_dynamic_bsz=true",
        f"{REF}.log_prob_max_token_len_per_gpu=30", "critic.use_dynamic_bsz=true",
        "critic.forward_max_token_len_per_gpu=50", "trainer.total_training_steps=1", "trainer.val_before_train=false"]
    plan = make_plan(load_config(overrides))
    trainer, _ = build_trainer(plan)
    assert (trainer.policy.micro_batch_size, trainer.policy.max_tokens_per_micro_batch) == (None, 40)
    assert (trainer.reference.micro_batch_size, trainer.reference.max_tokens_per_micro_batch) == (None, 30)
    assert (trainer.critic.micro_batch_size, trainer.critic.max_tokens_per_micro_batch) == (None, 50)
    assert trainer.max_tokens_per_micro_batch == 32768  # critic.use_dynamic_bsz: its ppo_max_token_len_per_gpu too
    from rlflow.config.verl.run import unused_notes

    assert f"{R}.log_prob_micro_batch_size_per_gpu=2 is not used" in "\n".join(unused_notes(plan.cfg))
    off = build_trainer(make_plan(load_config(tiny + [f"{R}.log_prob_micro_batch_size_per_gpu=2",
                                                      "actor_rollout_ref.actor.use_kl_loss=true"])))[0]
    assert (off.policy.micro_batch_size, off.policy.max_tokens_per_micro_batch) == (2, None)
    assert (off.reference.micro_batch_size, off.reference.max_tokens_per_micro_batch) == (2, None)
    assert main(overrides) == 0
    assert "critic/values/mean" in steps(capsys.readouterr().out)[1]


def test_dry_run_prints_the_batch_arithmetic(tiny, capsys):
    argv = ["--dry-run", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "trainer.total_training_steps=null", "trainer.total_epochs=2", "trainer.test_freq=2", "trainer.save_freq=3"]
    assert cli_main(["train"] + tiny + argv) == 0
    out = capsys.readouterr().out
    expected = [r"trajectories per step\s+4 prompts x 2 samples\s+= 8",
                r"mini-batches per step\s+train_batch_size / ppo_mini_batch_size = 4 / 2\s+= 2 mini-batches",
                r"trajectories per mini-batch\s+ppo_mini_batch_size x n = 2 x 2\s+= 4",
                r"grad. accumulation\s+4 / 2\s+= 2 forward/backward passes",
                r"steps per epoch\s+12 // 4 .*= 3 \(0 prompts unused per epoch\)",
                r"total RL steps\s+total_epochs x steps per epoch = 2 x 3\s+= 6",
                r"validation: every 2 steps and at the last, and before training", "every 3 steps and at the last",
                r"data sources: openai/gsm8k \(12\)", r"parameters: policy 0.0\d M", r"TFLOP per step",
                r"policy=Policy.from_pretrained\(path=", r"HFRollout\(n=2, .*max_new_tokens=4",
                r"Dry run: config and data are valid"]
    for pattern in expected:
        assert re.search(pattern, out), pattern
    assert "train_batch_size: 4" not in out and "add --show-config" in out  # summary only; the config on request
    assert cli_main(["train"] + tiny + argv + ["--show-config"]) == 0
    assert "Resolved config (every verl key)" in (out := capsys.readouterr().out) and "train_batch_size: 4" in out
    assert "H100" not in out  # a CPU run gets no GPU time estimate
    assert not (Path(tiny[-3].split("=", 1)[1])).exists()  # nothing trained, nothing written
    # an over-long prompt with truncation=error is a problem found before any training
    assert main(tiny + ["--dry-run", "data.max_prompt_length=4"]) == 1
    assert "PROBLEMS" in capsys.readouterr().out


def test_resume_mode_auto_continues_from_the_saved_step(tiny, capsys):
    base = tiny + ["trainer.save_freq=1", "trainer.val_before_train=false"]
    assert main(base) == 0
    assert sorted(steps(capsys.readouterr().out)) == [1, 2]
    assert main(base + ["trainer.total_training_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 2" in out and sorted(steps(out)) == [3]
    assert main(base + ["trainer.total_training_steps=1", "trainer.resume_mode=disable"]) == 0
    assert sorted(steps(capsys.readouterr().out)) == [1]


def test_validation_metrics_by_verl_names(tiny, data_dir, tmp_path, capsys):
    import pandas as pd

    from tests.config.conftest import verl_rows

    pd.DataFrame(verl_rows(3, "test", 2, source="math_dapo")).to_parquet(tmp_path / "dapo.parquet")
    assert main(tiny + [f"data.val_files=[{data_dir}/test.parquet,{tmp_path}/dapo.parquet]", "trainer.val_only=true",
                        "actor_rollout_ref.rollout.val_kwargs.n=2", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"]) == 0
    logged = steps(capsys.readouterr().out)[0]
    for key in ("val-core/openai/gsm8k/reward/mean@2", "val-core/openai/gsm8k/reward/best@2/mean",
                "val-aux/openai/gsm8k/reward/worst@2/mean", "val-core/math_dapo/acc/mean@2",
                "val-core/math_dapo/acc/best@2/mean", "val-core/math_dapo/acc/maj@2/mean",
                "val-aux/math_dapo/reward/mean@2"):
        assert key in logged, key
    assert logged["val-aux/math_dapo/reward/mean@2"] == -1.0  # DAPO scores a wrong answer -1
    assert logged["val-core/math_dapo/acc/mean@2"] == 0.0


def test_data_options(tiny, data_dir, capsys):
    argv = tiny + [f"data.train_files=[{data_dir}/train.parquet,{data_dir}/train.parquet]", "data.max_prompt_length=5",
                   "data.filter_overlong_prompts=true", "trainer.val_before_train=false", "data.shuffle=false"]
    plan = make_plan(load_config(argv))
    trainer, data = build_trainer(plan)
    assert all(len(r["prompt"][0]["content"]) <= 4 for r in data.train)  # "a+b" + "=" within 5 tokens
    assert len(data.train) < 24 and any("dropped" in n for n in run_notes(plan, data, trainer))
    from rlflow.data.prompts import collate

    batch = collate([{**data.train[0], "prompt": "123456789"}], trainer.policy.tokenizer, 4, "middle")
    assert trainer.policy.tokenizer.decode(batch["prompt_ids"][0]) == "1289"


def test_unknown_data_source_fails_before_training(tiny, tmp_path, capsys):
    import pandas as pd

    from tests.config.conftest import verl_rows

    pd.DataFrame(verl_rows(4, "train", 0, source="my/data")).to_parquet(tmp_path / "x.parquet")
    assert main(tiny + [f"data.train_files={tmp_path}/x.parquet"]) == 2
    assert "no built-in reward for data_source='my/data'" in capsys.readouterr().err


def test_gsm8k_preprocess_script_on_a_local_copy(tmp_path):
    import importlib.util

    import pandas as pd

    raw = tmp_path / "grade_school_math" / "data"
    raw.mkdir(parents=True)
    rows = [{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                         "May. How many clips did Natalia sell altogether in April and May?",
             "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                       "altogether in April and May.\n#### 72"},
            {"question": "q2", "answer": "a lot\n#### 1,080"}]
    for split in ("train", "test"):
        (raw / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    spec = importlib.util.spec_from_file_location("gsm8k_pre", Path(__file__).parents[2] / "scripts" / "data_preprocess" / "gsm8k.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--local_dataset_path", str(tmp_path), "--local_save_dir", str(tmp_path / "out")]) == 0
    df = pd.read_parquet(tmp_path / "out" / "train.parquet")
    assert list(df.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    first = df.iloc[0]
    assert first["data_source"] == "openai/gsm8k" and first["ability"] == "math"
    assert first["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert df.iloc[1]["reward_model"]["ground_truth"] == "1080"
    assert first["prompt"][0]["content"].endswith('Let\'s think step by step and output the final answer after "####".')
    assert first["extra_info"]["index"] == 0 and first["extra_info"]["split"] == "train"
    assert (tmp_path / "out" / "test.parquet").exists()
    from rlflow.data.prompts import PromptData

    data = PromptData(str(tmp_path / "out" / "train.parquet"))  # rlflow reads what the script wrote
    assert data.train[0]["ground_truth"] == "72" and data.train[0]["data_source"] == "openai/gsm8k"


def test_native_recipe_trains_through_rlflow_train(model_dir, data_dir, tmp_path, capsys):
    (tmp_path / "recipe.yaml").write_text(
        f"policy: {{path: {model_dir}}}\nrollout: {{n: 2, max_new_tokens: 4}}\nestimator: grpo\n"
        f"loss: {{clip_ratio: 0.2, kl_coef: 0.001}}\ndata: {{train: {data_dir}/train.parquet, max_prompt_length: 8}}\n"
        f"trainer: {{batch_size: 4, mini_batch_size: 2, max_steps: 2, device: cpu, run_dir: {tmp_path}/native}}\n")
    assert cli_main(["train", "--config", str(tmp_path / "recipe.yaml"), "trainer.max_steps=1"]) == 0
    logged = steps(capsys.readouterr().out)
    assert sorted(logged) == [1] and logged[1]["actor/kl_coef"] == 0.001
    assert (tmp_path / "native" / "metrics.jsonl").exists()  # the native defaults log to console and jsonl


def test_chained_algorithms_train(tiny):
    """KL in the reward (adaptive), ReMax's greedy baseline, truncated IS and a covariance loss, chained."""
    plan = make_plan(load_config(tiny + [
        "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.adv_estimator=remax",
        "algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov"]))
    trainer, data = build_trainer(plan)
    assert repr(trainer.estimator) == "Chain(KLInReward, ReMax, TruncatedIS, CovSelection)"
    assert [s.name for s in trainer.experience.stages] == ["greedy_baseline"]  # a stage of the stream, timed alone
    history = trainer.fit(data)
    assert len(history) == 2 and "actor/pg_loss" in history[-1]
    kl, _, is_weights, _ = trainer.estimator.modules
    assert {"actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"} <= set(kl.stats)
    assert "rollout_corr/rollout_is_mean" in is_weights.stats
    assert "remax/greedy_score/mean" in history[-1] and "timing_s/greedy_baseline" in history[-1]


def launch_two_processes(tiny, *extra):
    """``python -m rlflow.trainer.main_ppo`` with ``trainer.device=cpu trainer.n_gpus_per_node=2``: its output."""
    import os
    import subprocess
    import sys

    args = [a for a in tiny if not a.startswith("trainer.n_gpus_per_node")] + [
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=fsdp2", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "rlflow.trainer.main_ppo", *args], env=env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "launching 2 processes with torchrun" in out and "step:2 - " in out
    assert out.count("Initializing distributed") == 1  # rank 0 speaks for both: no per-process repeats
    return out


def test_two_cpu_processes_and_sequence_parallel_through_the_users_launcher(tiny, tmp_path):
    """`trainer.device=cpu trainer.n_gpus_per_node=2` runs 2 gloo processes (torchrun) with FSDP2, and verl's
    ulysses_sequence_parallel_size=2 makes them one group that splits every sequence. One launch for both (each
    starts four interpreters); plain data-parallel FSDP2 through the launcher also runs in
    test_resume_any_layout.py and test_multinode.py."""
    out = launch_two_processes(
        tiny, "trainer.save_freq=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_kl_loss=true")  # the reference is split too
    assert (tmp_path / "run" / "global_step_2" / "state.ckpt").is_dir()  # sharded by 2 ranks
    assert "sequence parallelism: 1 group(s) of 2 processes" in out and "actor/kl_loss" in out
