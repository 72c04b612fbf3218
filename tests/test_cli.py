import re

import pytest

from rlflow.cli import main


def test_default_job_prints_accuracy_line_and_saves_curve(tmp_path, capsys):
    assert main(["train", "--steps", "3", "--run-dir", str(tmp_path), "--no-progress"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"held-out accuracy: [01]\.\d\d -> [01]\.\d\d", lines[-1]), lines[-1]
    assert re.match(r"3 GRPO steps in \d+ s \(\+ setup and warm start \d+ s, validation \d+ s\); metrics in ", lines[-2])
    assert (tmp_path / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "summary.json").exists() and (tmp_path / "metrics.jsonl").exists()


def test_unknown_subcommand_is_an_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fly"])
    assert exc.value.code == 2
    assert "invalid choice: 'fly'" in capsys.readouterr().err


def test_prepare_task_writes_the_model_and_parquet_files(tmp_path, monkeypatch, capsys):
    from rlflow.tasks import prepare as export

    monkeypatch.setattr(export, "warm_started_model", lambda task, seed, **_: (task.model(seed), task.tokenizer()))
    assert main(["prepare-task", "addition", str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert {p.name for p in tmp_path.iterdir()} == {"model", "train.parquet", "test.parquet"}
    assert (tmp_path / "model" / "config.json").exists() and (tmp_path / "model" / "tokenizer.json").exists()


def test_the_vision_job_refuses_the_vllm_rollout(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--task", "vision", "--rollout", "vllm"])
    assert exc.value.code == 2
    assert "--task vision generates with transformers (--rollout hf)" in capsys.readouterr().err


def test_launch_slurm_dry_run_writes_a_valid_sbatch_script(tmp_path, capsys):
    """Trainer nodes run torchrun under srun with the rendezvous on the first node; a vLLM server node's URL
    reaches the trainer. Run with stand-ins for scontrol/srun/curl (SLURM is not here), the script's own
    logic (node slicing, the health wait) runs as written and each srun gets the expected command."""
    import os
    import subprocess

    script = tmp_path / "job.sbatch"
    assert main(["launch", "--slurm", "--nodes", "2", "--gpus-per-node", "8", "--rollout-nodes", "1", "--dry-run",
                 "--partition", "gpu", "--out", str(script), "actor_rollout_ref.model.path=/models/qwen",
                 "algorithm.adv_estimator=grpo"]) == 0
    text = script.read_text()
    assert text == capsys.readouterr().out
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0  # valid bash
    assert "#SBATCH --nodes=3" in text and "#SBATCH --partition=gpu" in text and "# FILL IN" in text

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {"scontrol": 'printf "n1\\nn2\\nn3\\n"', "curl": "exit 0", "srun": f'echo "$*" >> {tmp_path}/sruns; sleep 0.2'}
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_ID": "7"}
    assert subprocess.run(["bash", str(script)], env=env, timeout=60).returncode == 0
    server, trainer = sorted((tmp_path / "sruns").read_text().splitlines(), key=lambda s: "torchrun" in s)
    assert server.startswith("--nodes=1 --ntasks=1 -w n3 --export=ALL,VLLM_SERVER_DEV_MODE=1 python -m "
                             "vllm.entrypoints.openai.api_server --model /models/qwen --host 0.0.0.0 --port 8000")
    assert trainer.startswith("--nodes=2 --ntasks=2 --ntasks-per-node=1 -w n1,n2 torchrun --nnodes=2 "
                              "--nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=n1:29500 --rdzv-id=7 "
                              "-m rlflow.trainer.main_ppo trainer.nnodes=2 trainer.n_gpus_per_node=8")
    assert "actor_rollout_ref.rollout.server.url=http://n3:8000" in trainer and "algorithm.adv_estimator=grpo" in trainer


def test_launch_slurm_refuses_what_it_cannot_write(tmp_path, capsys):
    out = str(tmp_path / "job.sbatch")
    assert main(["launch", "--slurm", "--nodes", "2", "--gpus-per-node", "8", "--rollout-nodes", "1", "--dry-run",
                 "--out", out]) == 2
    assert "--rollout-nodes needs the model the servers load" in capsys.readouterr().err
    assert main(["launch", "--slurm", "--nodes", "2", "--gpus-per-node", "8", "--dry-run", "--out", out,
                 "trainer.nnodes=4"]) == 2
    assert "sets trainer.nnodes from --nodes" in capsys.readouterr().err
