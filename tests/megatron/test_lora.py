"""LoRA under the Megatron strategy (strategies/megatron/lora.py) on two CPU processes (gloo) against PEFT on one.

One launch of two forked ranks (``forked.py``) runs ``lora_tp`` (a PEFT LoRA policy converted at tensor parallel 2:
log-probs, entropy, the adapter's gradients, the adapter-disabled reference, the merged weights) and
``lora_train_tp`` (two GRPO steps of a LoRA policy at tensor parallel 2); the one-process reference is the same
Trainer with the PEFT model, in this process.
"""

import pytest
import torch

from rlflow.strategies.megatron import megatron_available

from . import lora_scenarios  # noqa: F401  (its scenarios, for the forked ranks)
from .forked import fork_launch
from .test_megatron import assert_same_run, verl_inputs
from .worker import build, tiny_model

pytestmark = pytest.mark.skipif(not megatron_available(),
                                reason="megatron-core is not installed (pip install -e '.[megatron]')")


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron-lora")
    verl_inputs(out / "verl")
    return fork_launch(2, out, ("lora_tp", "lora_train_tp", "lora_train_pp", "lora_critic_tp", "lora_verl"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    trainer, data, record = build(str(tmp_path_factory.mktemp("one")), "auto", steps=2, lora=True)
    trainer.fit(data)
    return record.steps


def test_tensor_parallel_lora_equals_peft_on_one_process(two):
    """q/v/o/up/down adapted (k and gate not: the fused layers' other parts stay the base model's): log-probs,
    entropy and every adapter gradient equal PEFT's; the base weights get none; with the adapter off the policy
    scores as the base model (the KL reference); the engines receive PEFT's merge_and_unload weights, and only the
    adapted ones when only those changed."""
    r = two["lora_tp"]
    assert r["adapter_effect"] > 0.05  # the adapter changes the log-probs, so the comparisons below see it
    assert r["log_probs"] < 1e-5 and r["entropy"] < 1e-5, r
    assert r["grad_names"] and r["trainable"] and r["grad"] < 1e-5 * r["grad_scale"], r
    assert r["base_grads"] == []
    assert r["reference"] < 1e-5, r
    assert r["exported_names"] and r["exported"] < 1e-6, r
    assert r["only_adapted"] == sorted(f"model.layers.{i}.{m}.weight" for i in range(2) for m in (
        "mlp.down_proj", "mlp.up_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"))


def test_tensor_parallel_lora_grpo_steps_equal_one_process(two, one_process):
    """Two GRPO steps (two optimizer steps each, a KL term against the adapter-disabled reference): the same
    metrics and merged weights as PEFT on one process, the engine holds them, and the weights no adapter touches
    are the initial model's."""
    got = two["lora_train_tp"]
    assert_same_run(got, one_process, steps=(1, 2))
    assert got[2]["metrics"]["actor/kl_loss"] > 0
    initial = dict(tiny_model("qwen2").named_parameters(remove_duplicate=False))
    for name, weight in got[2]["weights"].items():
        adapted = any(f"{m}.weight" in name for m in ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
        moved = (weight - initial[name]).abs().max().item()
        assert (moved > 0) if adapted else (moved == 0), name


def test_pipeline_parallel_lora_grpo_steps_equal_one_process(two, one_process):
    """The same at pipeline parallel 2: each stage holds its layers' adapters; the merged weights the engine receives
    after each step (only the adapted ones after the first sync) come from both stages."""
    assert_same_run(two["lora_train_pp"], one_process, steps=(1, 2))


def test_lora_critic_at_tensor_parallel_2_equals_one_process(two, tmp_path):
    """PPO with a LoRA critic (its adapter and its new value head train; its base weights do not): the critic's
    loss, gradient norm and values, and the policy's run, as on one process."""
    trainer, data, record = build(str(tmp_path), "auto", steps=2, critic=True, critic_lora=True)
    trainer.fit(data)
    got = two["lora_critic_tp"]
    assert_same_run(got, record.steps, steps=(1, 2))
    for step in (1, 2):
        for key in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean"):
            assert got[step]["metrics"][key] == pytest.approx(record.steps[step]["metrics"][key], abs=1e-5, rel=1e-4)
    assert record.steps[2]["metrics"]["critic/grad_norm"] > 0


def test_verl_megatron_lora_block_trains_and_resumes_through_main_ppo(two):
    """``actor_rollout_ref.model.lora.rank=4`` with ``actor.strategy=megatron`` at tensor parallel 2: a step and its
    checkpoint, then a second run resumes it; the checkpoint holds the adapter's factors under PEFT's names."""
    r = two["lora_verl"]
    assert r["codes"] == (0, 0) and r["steps"] == ["global_step_1", "global_step_2"], r
    assert len(r["factors"]) == 2 * 2 * 7 and all(k.endswith(".default.weight") for k in r["factors"]), r["factors"]
