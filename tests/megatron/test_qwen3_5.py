"""Qwen3.5 (transformers' ``qwen3_5_text`` / ``qwen3_5_moe_text``: Gated DeltaNet and gated attention layers) under
the Megatron strategy on CPU processes (gloo), against transformers (strategies/megatron/qwen3_5.py).

Forked ranks (``forked.py``, scenarios in ``qwen3_5_scenarios.py``): the conversion at tensor parallel 1 and 2
(megatron-core's GatedDeltaNet, with its pure-torch chunked delta rule standing in for fla's kernel, and its gated
attention reproduce transformers' ``Qwen3_5ForCausalLM``), Qwen3.5-MoE at expert parallel 2, a sharded checkpoint
and a Megatron dist checkpoint across layouts, and GRPO steps at tensor parallel 2 against one process. The verl dry
run accepts the models and refuses what the conversion does not cover, by name.
"""

import pytest

from rlflow.strategies.megatron import ParallelLayout, megatron_available
from rlflow.strategies.megatron.qwen3_5 import check_layout

from . import qwen3_5_scenarios  # noqa: F401  (its scenarios, for the forked ranks)
from .forked import fork_launch
from .test_megatron import assert_same_run
from .worker import build

pytestmark = pytest.mark.skipif(not megatron_available(),
                                reason="megatron-core is not installed (pip install -e '.[megatron]')")


@pytest.mark.parametrize("tensor", [1, 2])
def test_qwen3_5_converted_equals_transformers(tmp_path, tensor):
    """A linear-attention layer then a full-attention one, left padding in a row, at tensor parallel 1 and 2 (each
    rank: half the attention and Gated DeltaNet heads, its q | k | v blocks of transformers' fused in_proj_qkv and
    conv1d): logits, log-probs, entropy, a teacher's top-k log-probs and every gradient equal transformers'; the
    weights go back to the engines under transformers' names, exactly the ones loaded."""
    r = fork_launch(tensor, tmp_path, ("qwen3_5_convert",))["qwen3_5_convert"]
    assert r["logits"] < 1e-5 * max(1.0, r["logits_scale"]), r["logits"]
    assert r["log_probs"] < 1e-5 and r["entropy"] < 1e-5 and r["topk_log_probs"] < 1e-5, r
    assert r["grad_names"] and r["grad"] < 1e-5 * r["grad_scale"], (r["grad"], r["grad_scale"])
    assert r["exported_names"] and r["exported"] == 0.0


def test_qwen3_5_moe_converted_at_expert_parallel_2_equals_transformers(tmp_path):
    """Qwen3.5-MoE (4 routed experts, top 2, a shared expert behind a sigmoid gate, per layer) with each rank holding
    2 experts: the same checks as the dense model's."""
    r = fork_launch(2, tmp_path, ("qwen3_5_moe_convert",))["qwen3_5_moe_convert"]
    assert r["logits"] < 1e-5 * max(1.0, r["logits_scale"]), r["logits"]
    assert r["log_probs"] < 1e-5 and r["entropy"] < 1e-5 and r["topk_log_probs"] < 1e-5, r
    assert r["grad_names"] and r["grad"] < 1e-5 * r["grad_scale"], (r["grad"], r["grad_scale"])
    assert r["exported_names"] and r["exported"] == 0.0


def test_qwen3_5_checkpoint_at_tensor_parallel_2_resumes_at_pipeline_parallel_2(tmp_path):
    """The strategy's sharded checkpoint after an AdamW step at TP 2, loaded at PP 2 into other weights: the
    log-probs are the saved model's and the first stage's AdamW moments (the Gated DeltaNet layer, with transformers'
    fused in_proj_qkv and conv1d) are the saved ones."""
    r = fork_launch(2, tmp_path, ("qwen3_5_checkpoint",))["qwen3_5_checkpoint"]
    assert r["log_probs"] < 1e-5, r
    assert len(r["sectioned"]) == 2 and r["moments"] == 0.0, r


def test_qwen3_5_dist_checkpoint_at_tensor_parallel_2_loads_at_pipeline_parallel_2_and_tensor_parallel_1(tmp_path):
    """verl's use_dist_checkpointing: megatron-core's own format (its GatedDeltaNet splits in_proj and conv1d into
    q/k/v/z/b/a pieces), written at TP 2 from one model, loaded at PP 2 and TP 1 into other weights."""
    r = fork_launch(2, tmp_path, ("qwen3_5_dist_ckpt",))["qwen3_5_dist_ckpt"]
    assert r["pp2"] < 1e-5 and r["tp1"] < 1e-5, r


def test_qwen3_5_grpo_steps_at_tensor_parallel_2_equal_one_process(tmp_path):
    """Two GRPO steps (rollouts from the engine, KL and entropy terms, two optimizer steps per RL step) of a Qwen3.5
    policy at TP 2 give the losses, gradient norms and weights of the same Trainer with transformers' model on one
    process, and the engine holds exactly the trained weights after each sync."""
    got = fork_launch(2, tmp_path / "two", ("qwen3_5_train_tp",))["qwen3_5_train_tp"]
    trainer, data, record = build(str(tmp_path / "one"), "auto", kind="qwen3_5", steps=2)
    trainer.fit(data)
    assert_same_run(got, record.steps, steps=(1, 2))


def test_gated_delta_net_heads_that_do_not_split_and_moe_under_tensor_parallel_are_refused_by_name():
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(linear_num_key_heads=2, linear_num_value_heads=6)
    check_layout(ParallelLayout(tensor=2), config)
    with pytest.raises(ValueError, match="linear_num_value_heads=6 not divisible by tensor parallel 4"):
        check_layout(ParallelLayout(tensor=4), config)
    check_layout(ParallelLayout(expert=8), Qwen3_5MoeTextConfig())
    with pytest.raises(ValueError, match="Qwen3.5-MoE runs at tensor parallel 1 .*sequence parallelism"):
        check_layout(ParallelLayout(tensor=2), Qwen3_5MoeTextConfig())


def qwen3_5_folder(folder, **sizes):
    """A Qwen3.5 text model folder (config and tokenizer only: the dry run reads no weights) and prompts."""
    import pandas as pd
    from transformers import Qwen3_5TextConfig

    from rlflow.models.tiny import char_tokenizer

    from ..config.conftest import CHAT_TEMPLATE, verl_rows

    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder / "model")
    Qwen3_5TextConfig(vocab_size=len(tok), **sizes).save_pretrained(folder / "model")
    pd.DataFrame(verl_rows(8, "train", 0)).to_parquet(folder / "train.parquet")


def test_the_verl_dry_run_accepts_qwen3_5_and_refuses_what_does_not_split_and_lora_by_name(tmp_path, capsys):
    """Qwen3.5-9B-shaped (hidden 4096, 32 layers, 3 Gated DeltaNet layers per full-attention one): the dry run
    prints the Megatron plan with the parameters of both layer kinds (the estimate equals a small model's count) at
    tensor parallel 1 and 2; Gated DeltaNet heads that do not split over the tensor-parallel ranks and LoRA are
    refused."""
    import re

    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    from rlflow.config.verl.run import main
    from rlflow.strategies.megatron.memory import rank_memory

    small = Qwen3_5TextConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    model = Qwen3_5ForCausalLM(small)  # 3 linear-attention layers, 1 full: the estimate averages them
    assert rank_memory(small, ParallelLayout(), 1, 1, 8).total_parameters == sum(p.numel() for p in model.parameters())
    moe = Qwen3_5MoeTextConfig(**{k: v for k, v in small.to_dict().items() if k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")},
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    total = rank_memory(moe, ParallelLayout(), 1, 1, 8).total_parameters
    assert total == sum(p.numel() for p in Qwen3_5MoeForCausalLM(moe).parameters())
    qwen3_5_folder(tmp_path, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32)
    argv = ["--dry-run", f"actor_rollout_ref.model.path={tmp_path}/model", f"data.train_files={tmp_path}/train.parquet",
            "trainer.device=cpu", "trainer.n_gpus_per_node=1", "algorithm.adv_estimator=grpo", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.logger=[console]",
            "actor_rollout_ref.actor.strategy=megatron", f"trainer.default_local_dir={tmp_path}/run"]
    assert main(argv) == 0
    assert re.search(r"Megatron: TP 1.*Dry run: config and data are valid", capsys.readouterr().out, re.S)
    two = [a.replace("n_gpus_per_node=1", "n_gpus_per_node=2") for a in argv]
    assert main(two + ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]) == 0
    assert "Megatron: TP 2" in capsys.readouterr().out
    qwen3_5_folder(tmp_path, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, linear_num_key_heads=6,
                   linear_num_value_heads=12)  # attention's 16 heads, 4 key/value heads split over 4 ranks; these not
    four = [a.replace("n_gpus_per_node=1", "n_gpus_per_node=4") for a in argv]
    assert main(four + ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"]) != 0
    assert "Gated DeltaNet's linear_num_key_heads=6 not divisible by tensor parallel 4" in capsys.readouterr().err
    assert main(argv + ["actor_rollout_ref.model.lora.rank=4"]) != 0
    assert "does not adapt Qwen3.5" in capsys.readouterr().err
