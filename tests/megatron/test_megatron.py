"""The Megatron strategy on CPU processes (gloo) against transformers and against one process.

One launch of two ranks forked from this process (``forked.py``: no fresh interpreter, no import of
rlflow or megatron-core per rank) runs every two-process check: conversion and gradients at tensor
parallel 2 and at pipeline parallel 2, GRPO steps at tensor parallel 2 and pipeline parallel 2, a
checkpoint written at tensor parallel 2 resumed at pipeline parallel 2, a checkpoint of another model
refused, a Megatron dist checkpoint (verl's use_dist_checkpointing) written at tensor parallel 2 loaded at pipeline
parallel 2 and tensor parallel 1, expert parallel 2 on a Qwen3-MoE-shaped model, PPO with a critic at pipeline parallel 2, a
reward model scoring at tensor parallel 2, and the verl entry point. A second launch runs tensor
parallel 2 x data parallel 2 on four processes. The one-process references are the plain Hugging Face
runs of the same modules, in this process.
"""

from pathlib import Path

import pytest
import torch

from rlflow.strategies.megatron import megatron_available

from .forked import fork_launch
from .worker import build

pytestmark = pytest.mark.skipif(not megatron_available(),
                                reason="megatron-core is not installed (pip install -e '.[megatron]')")

TWO_PROCESSES = ("convert", "convert_pp", "train_tp", "train_pp", "resume_pp", "refuse", "moe_ep", "critic_pp",
                 "reward_model_tp", "verl_entry", "dist_ckpt")
METRICS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "critic/score/mean")


def verl_inputs(folder: Path) -> None:
    """A tiny model folder (4 heads, 2 key/value heads: splits over 2 ranks) and prompts in verl's layout."""
    import pandas as pd

    from rlflow.models.tiny import char_tokenizer, tiny_qwen2

    from ..config.conftest import CHAT_TEMPLATE, verl_rows

    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tiny_qwen2(len(tok), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
               seed=0).save_pretrained(folder / "model")
    tok.save_pretrained(folder / "model")
    pd.DataFrame(verl_rows(16, "train", 0)).to_parquet(folder / "train.parquet")


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron")
    verl_inputs(out / "verl")
    return out, fork_launch(2, out, TWO_PROCESSES)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same run on one process with the Hugging Face modules (``strategy="auto"``), by settings."""
    runs = {}

    def run(**settings):
        key = tuple(sorted(settings.items()))
        if key not in runs:
            out = tmp_path_factory.mktemp("one")
            trainer, data, record = build(str(out), "auto", **settings)
            trainer.fit(data)
            runs[key] = record.steps
        return runs[key]

    return run


def assert_same_run(got: dict, ref: dict, steps, atol=5e-5) -> None:
    """Same metrics and weights after every step; the generation engine holds exactly the trained weights."""
    for step in steps:
        assert ref[step]["metrics"]["actor/grad_norm"] > 0.1  # the reference really trains
        for key in METRICS:
            expected = pytest.approx(ref[step]["metrics"][key], abs=1e-5, rel=1e-4)
            assert got[step]["metrics"][key] == expected, (step, key)
        assert got[step]["weights"].keys() == ref[step]["weights"].keys()
        for name, weight in ref[step]["weights"].items():
            torch.testing.assert_close(got[step]["weights"][name], weight, atol=atol, rtol=1e-4, msg=name)
        assert got[step]["engine_diff"] == 0.0


def test_converted_models_equal_transformers_at_tensor_parallel_2(two):
    """Qwen2 (tied, q/k/v biases), Qwen3 (q/k norms) and Llama (untied): logits (gathered over the vocabulary
    for the check), log-probs, entropy and the log-probs of a teacher's top-k tokens (vocabulary-parallel), and
    the gradients of a loss of the three."""
    results = two[1]["convert"]
    difference, zeros = results["qwen2"]["remove_padding"]  # verl's use_remove_padding: zeros after each response
    assert difference < 1e-5 and zeros
    assert set(results) == {"qwen2", "qwen3", "llama"}
    for kind, r in results.items():
        assert r["logits"] < 1e-5 * max(1.0, r["logits_scale"]), (kind, r["logits"])
        assert r["log_probs"] < 1e-5 and r["entropy"] < 1e-5 and r["topk_log_probs"] < 1e-5, (kind, r)
        assert r["grad_names"] and r["grad"] < 1e-5 * r["grad_scale"], (kind, r["grad"], r["grad_scale"])
        # weight export: transformers' names, the original weights, 4 KiB buckets (a bigger tensor goes alone)
        assert r["exported_names"] and r["exported"] == 0.0, kind
        assert len(r["buckets"]) > 5 and all(size <= 4096 or count == 1 for count, size in r["buckets"]), r["buckets"]


def test_a_dist_checkpoint_written_at_tensor_parallel_2_loads_at_pipeline_parallel_2_and_tensor_parallel_1(two):
    """verl's use_dist_checkpointing: megatron-core's dist_checkpointing saves and loads over gloo on CPU (with the
    two workarounds of strategies/megatron/cpu.py); the log-probs after loading are those of the model saved (into
    a shell with other weights), at another layout. A Trainer starting from it sends its weights to the engine
    before the first rollout, the reference starts from it too, and another architecture's checkpoint is refused."""
    r = two[1]["dist_ckpt"]
    assert "metadata.json" in r["files"] and sum(f.endswith(".distcp") for f in r["files"]) >= 2
    assert r["pp2"] < 1e-5 and r["tp1"] < 1e-5, r
    assert r["engine"] == 0.0 and r["reference"] < 1e-5, r
    assert "does not match the model (KeyError" in r["refused"] and "q_layernorm" in r["refused"], r["refused"]


def test_pipeline_parallel_gradients_equal_transformers(two):
    """Pipeline parallel 2: log-probs, entropy and every parameter's gradient (each on its stage; Qwen2's tied
    embedding is used on both stages and its two gradients add up) equal transformers'."""
    for kind, r in two[1]["convert_pp"].items():
        assert r["log_probs"] < 1e-5 and r["entropy"] < 1e-5 and r["topk_log_probs"] < 1e-5, (kind, r)
        assert r["grad_names"] and r["grad"] < 1e-5 * r["grad_scale"], (kind, r["grad"], r["grad_scale"])


def test_tensor_parallel_grpo_steps_equal_one_process(two, one_process):
    assert_same_run(two[1]["train_tp"], one_process(), steps=(1, 2, 3))


def test_pipeline_parallel_grpo_steps_equal_one_process(two, one_process):
    assert_same_run(two[1]["train_pp"], one_process(), steps=(1, 2))


def test_checkpoint_at_tensor_parallel_resumes_at_pipeline_parallel(two, one_process):
    """Step 1 saved by tensor parallel 2, steps 2 and 3 trained by pipeline parallel 2: the uninterrupted run's."""
    resumed = two[1]["resume_pp"]
    assert sorted(resumed) == [2, 3]
    assert_same_run(resumed, one_process(), steps=(2, 3))


def test_megatron_checkpoint_resumes_on_one_process(two, one_process, tmp_path):
    """The tensor-parallel run's step-1 checkpoint, resumed by the plain one-process Trainer (no Megatron)."""
    trainer, data, record = build(str(tmp_path), "auto", resume=str(two[0] / "tp/global_step_1"))
    trainer.fit(data)
    assert sorted(record.steps) == [2, 3]
    assert_same_run(record.steps, one_process(), steps=(2, 3))


def test_checkpoint_of_another_model_is_refused(two):
    error = two[1]["refuse"]["error"]
    assert error and "the model does not match the one that wrote it" in error
    assert "the checkpoint's state_dict was written for another model" in error
    assert "self_attn.q_proj.bias is not in the model" in error  # Qwen2 has q/k/v biases, Llama none


def test_megatron_checkpoint_exports_to_hugging_face(two, tmp_path):
    """``rlflow export`` reads a Megatron checkpoint (written at tensor parallel 2) like an FSDP2 one."""
    from transformers import AutoModelForCausalLM

    from rlflow.trainer.hf_export import export_hf

    out, results = two
    exported = AutoModelForCausalLM.from_pretrained(export_hf(out / "tp/global_step_3", tmp_path / "hf"))
    trained = results["train_tp"][3]["weights"]
    params = dict(exported.named_parameters())
    assert params.keys() == trained.keys()
    for name, weight in trained.items():
        torch.testing.assert_close(params[name], weight, atol=0, rtol=0, msg=name)


def test_expert_parallel_moe_equals_one_process(two, one_process):
    """A Qwen3-MoE-shaped model (4 experts, top-2), experts split over 2 processes (which are also 2
    data-parallel ranks: one mini-batch per step, so the runs see the same mini-batches)."""
    assert_same_run(two[1]["moe_ep"], one_process(kind="qwen3_moe", mini_batches=1, steps=2), steps=(1, 2))


def test_critic_pipeline_parallel_equals_one_process(two, one_process):
    got, ref = two[1]["critic_pp"], one_process(critic=True, steps=2)
    assert_same_run(got, ref, steps=(1, 2))
    for step in (1, 2):
        for key in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean"):
            assert got[step]["metrics"][key] == pytest.approx(ref[step]["metrics"][key], abs=1e-5, rel=1e-4), key


def test_reward_model_scores_under_tensor_parallel_equal_one_process(two, one_process):
    """A reward model (a ``ModelReward``: nothing trains it) is held whole on each rank; the scores, and so
    the run, are the one-process run's."""
    got, ref = two[1]["reward_model_tp"], one_process(rm=True, steps=2)
    scored = ref[1]["metrics"]["critic/score/mean"]
    assert scored != one_process()[1]["metrics"]["critic/score/mean"]  # the reward model, not the function, scored
    assert_same_run(got, ref, steps=(1, 2))


def test_tensor_x_data_parallel_on_four_processes_equals_one_process(tmp_path, one_process):
    got = fork_launch(4, tmp_path, ["train_tp_dp"])["train_tp_dp"]
    assert_same_run(got, one_process(mini_batches=1, steps=2), steps=(1, 2))


def test_verl_entry_point_trains_with_megatron_in_both_spellings(two):
    """``actor.tensor_model_parallel_size=2`` (the seed's) trains a step and checkpoints it; verl's
    ``actor.megatron.pipeline_model_parallel_size=2`` resumes it and trains the next."""
    result = two[1]["verl_entry"]
    assert result["codes"] == (0, 0)
    assert result["steps"] == ["global_step_1", "global_step_2"]
    assert not result["step_1_rewritten"]  # the second run resumed after step 1
