"""FSDP2 on 2 CPU processes (gloo), launched with torchrun as users launch it.

One GRPO step on 2 processes equals one process on the same global batch;
sharded checkpoints move between world sizes (2 -> 1 -> 2); a failing rank
takes the whole job down in bounded time; export gives a plain HF folder.
The 2-process jobs that read no other run are launch.py's FSDP2_JOBS: one launch, shared with other files.
"""

import pytest
import torch

from .launch import assert_same_weights, assert_updates, run_ok
from .worker import build


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The reference: 3 steps on one process, no sharding."""
    out = tmp_path_factory.mktemp("single")
    trainer, data, record = build(str(out), "auto", steps=3, devices=1)
    trainer.fit(data)
    assert_updates(record.steps)
    return record.steps, out


def test_two_processes_equal_one_and_checkpoints_cross_world_sizes(single_process, fsdp2_launched, tmp_path):
    reference, _ = single_process
    two, two_dir = fsdp2_launched["fsdp2"]
    assert two[1]["metrics"]["actor/pg_loss"] == pytest.approx(reference[1]["metrics"]["actor/pg_loss"], abs=1e-5)
    assert two[1]["metrics"]["critic/score/mean"] == pytest.approx(reference[1]["metrics"]["critic/score/mean"], abs=1e-6)
    assert_same_weights(two[1]["weights"], reference[1]["weights"])
    ckpt = two_dir / "global_step_1"
    assert (ckpt / "state.ckpt").is_dir()  # sharded (torch.distributed.checkpoint)

    one = run_ok(1, tmp_path / "one", "fsdp2", 2, ckpt)  # written by 2 ranks, resumed on 1
    assert list(one) == [2]
    assert_same_weights(one[2]["weights"], reference[2]["weights"])

    again = run_ok(2, tmp_path / "again", "fsdp2", 3, tmp_path / "one" / "global_step_2")  # 1 -> 2
    assert list(again) == [3]
    assert_same_weights(again[3]["weights"], reference[3]["weights"])
    assert again[3]["metrics"]["actor/pg_loss"] == pytest.approx(reference[3]["metrics"]["actor/pg_loss"], abs=1e-5)


def test_a_failing_rank_ends_every_rank(fsdp2_launch):
    """The launch's last job fails on rank 1: the launch ends (rank 0, waiting in a collective, is stopped)."""
    proc, root = fsdp2_launch
    assert proc.returncode != 0
    assert "injected failure on rank 1" in proc.stdout + proc.stderr
    assert not (root / "failing" / "result.pt").exists()


def test_export_writes_a_plain_hf_folder(single_process, fsdp2_launched, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlflow.cli import main as cli_main
    from rlflow.trainer.hf_export import export_hf

    reference, out = single_process
    sharded, sharded_dir = fsdp2_launched["fsdp2"]
    cases = [(out / "global_step_3", reference[3]["weights"]),  # one file
             (sharded_dir / "global_step_1", sharded[1]["weights"])]  # sharded folder
    for i, (ckpt, expected) in enumerate(cases):
        folder = export_hf(ckpt, tmp_path / f"hf{i}") if i else tmp_path / f"hf{i}"
        if not i:  # the command users run
            assert cli_main(["export", str(ckpt), str(folder)]) == 0
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert AutoTokenizer.from_pretrained(folder).pad_token == "<pad>"
        assert_same_weights(dict(model.named_parameters()), expected)


def test_ddp_two_processes_equal_one(single_process, fsdp2_launched):
    reference, _ = single_process
    ddp, _ = fsdp2_launched["ddp"]
    assert ddp[1]["metrics"]["actor/pg_loss"] == pytest.approx(reference[1]["metrics"]["actor/pg_loss"], abs=1e-5)
    assert_same_weights(ddp[1]["weights"], reference[1]["weights"])


def test_shared_prompts_under_ddp_and_fsdp2_equal_one_process(fsdp2_launched, tmp_path):
    """Two (greedy) samples per prompt, two rows per micro-batch: one process and DDP run each prompt once for its
    two rows (rlflow.models.shared_prompt), FSDP2 the padded pass (sharded layers do not share); all equal."""
    from rlflow.models import shared_prompt

    passes = []
    original = shared_prompt.prompt_cache
    shared_prompt.prompt_cache = lambda *a: passes.append((a[2].shape[0], len(a[4]))) or original(*a)
    try:
        trainer, data, record = build(str(tmp_path / "one"), "auto", steps=1, devices=1, samples=2)
        trainer.fit(data)
    finally:
        shared_prompt.prompt_cache = original
    assert passes and set(passes) == {(2, 1)}  # the update's micro-batches: 2 rows, 1 distinct prompt each
    reference = record.steps
    for strategy in ("ddp", "fsdp2"):
        two, _ = fsdp2_launched[f"{strategy}_samples2"]
        assert two[1]["metrics"]["actor/pg_loss"] == pytest.approx(reference[1]["metrics"]["actor/pg_loss"], abs=1e-5)
        assert_same_weights(two[1]["weights"], reference[1]["weights"])


def test_bf16_mixed_precision_keeps_fp32_master_weights(single_process, fsdp2_launched):
    """FSDP2 with bf16 parameters in compute and fp32 gradient reduction (gloo runs it on CPU)."""
    reference, _ = single_process
    ref = reference[1]
    bf16 = fsdp2_launched["bf16"][0][1]
    assert all(w.dtype == torch.float32 for w in bf16["weights"].values())  # the sharded masters stay fp32
    assert bf16["metrics"]["actor/pg_loss"] == pytest.approx(ref["metrics"]["actor/pg_loss"], rel=1e-2)
    assert bf16["metrics"]["actor/grad_norm"] == pytest.approx(ref["metrics"]["actor/grad_norm"], rel=1e-2)
    assert bf16["metrics"]["actor/grad_norm"] != ref["metrics"]["actor/grad_norm"]  # bf16 compute really ran
    # AdamW's first step moves each weight by about lr (1e-2) in the gradient's sign: bf16 may flip a few signs
    for name, w in bf16["weights"].items():
        assert (w - ref["weights"][name]).abs().max() <= 2.5e-2, name
