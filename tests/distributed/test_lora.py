"""LoRA under FSDP2 on 2 CPU processes (gloo), launched once with torchrun, against one process.

The launch (a job of tests/conftest.py's shared one) trains 2 GRPO-style steps with a KL loss against the adapter-disabled reference, checks the
generation engine (a merged copy, synced with merged weights) after every step, saves sharded
checkpoints and resumes from the first one. Compared here: loss and weights equal one process's,
the engine's log-probs equal the policy's, the checkpoint holds the adapter alone, the resumed run
equals the uninterrupted one, and the sharded checkpoint exports to a merged model.
"""

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from .launch import FSDP2_JOBS, assert_same_weights
from .worker import build


def test_lora_fsdp2_two_processes_equal_one(fsdp2_launched, tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    from rlflow.models.tiny import tiny_qwen2
    from rlflow.trainer.hf_export import export_hf

    trainer, data, record = build(str(tmp_path / "one"), "auto", steps=2, devices=1, lora=1)
    trainer.fit(data)
    assert FSDP2_JOBS["lora"] == ("fsdp2", 2, "lora=1")
    one, (two, two_dir) = record.steps, fsdp2_launched["lora"]
    for step in (1, 2):
        a, b = one[step]["metrics"], two[step]["metrics"]
        assert a["actor/grad_norm"] > 0.01  # the adapter really trains (B starts at 0, so A's first gradient is 0)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), (step, key)
        assert a["test/engine_gap"] < 1e-5 and b["test/engine_gap"] < 1e-5, step  # merged weights reached the engine
        assert_same_weights(two[step]["weights"], one[step]["weights"])
    assert one[2]["metrics"]["actor/kl_loss"] > 1e-4  # the reference (adapter off) differs from the trained policy
    assert_same_weights(two["resumed"]["weights"], two[2]["weights"])

    ckpt = two_dir / "global_step_2"
    saved = [k for k in FileSystemReader(ckpt / "state.ckpt").read_metadata().state_dict_metadata
             if k.startswith("policy.")]
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)  # the adapter's shards, no base weights

    base = tmp_path / "base"  # the worker's base model (same seed), as a folder for export
    tiny_qwen2(len(tokenizer), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
               seed=0).save_pretrained(base)
    merged = AutoModelForCausalLM.from_pretrained(export_hf(ckpt, tmp_path / "hf", base_model=base))
    ids = torch.randint(3, len(tokenizer), (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, trainer.policy.model(input_ids=ids).logits,
                                   atol=1e-5, rtol=0)
