"""Megatron's precision-aware optimizer under the Megatron strategy over gloo (2 forked ranks, tensor parallel 2),
from Python and from verl's keys (``optimizer_scenarios.py``); the dry run's memory line."""

import pytest
import torch

from rlflow.config.verl.run import main
from rlflow.strategies.megatron import megatron_available

from . import optimizer_scenarios  # noqa: F401  (its scenarios, for the forked ranks)
from .forked import fork_launch
from .test_megatron import assert_same_run, verl_inputs

pytestmark = pytest.mark.skipif(not megatron_available(),
                                reason="megatron-core is not installed (pip install -e '.[megatron]')")

A = "actor_rollout_ref.actor"
KEYS = [f"{A}.optim.use_precision_aware_optimizer=true", f"{A}.optim.main_grads_dtype=bf16",
        f"{A}.optim.exp_avg_dtype=bf16", f"{A}.optim.exp_avg_sq_dtype=bf16"]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("precision")
    verl_inputs(out / "verl")
    return fork_launch(2, out, ("precision_tp", "precision_verl"))


def test_all_float32_precision_aware_run_is_the_default_run(two):
    run = two["precision_tp"]
    assert run["fp32"]["optimizer"] == "PrecisionAwareAdamW" and run["default"]["optimizer"] == "AdamW"
    assert_same_run(run["fp32"]["steps"], run["default"]["steps"], steps=(1, 2), atol=0)


def test_bf16_gradients_and_moments_are_stored_in_bf16_and_train_close_to_float32(two):
    run = two["precision_tp"]
    bf16, default = run["bf16"], run["default"]
    assert bf16["optimizer"] == "PrecisionAwareAdamW" and bf16["dtypes"] == ["torch.bfloat16"]
    # this rank's moments (2 + 2 bytes a parameter); the bf16 gradients were freed by zero_grad
    assert bf16["state_bytes"] == 4 * bf16["parameters"]
    # measured: losses and gradient norms within 1e-3 relative; the weights ||bf16 - fp32|| = 0.029 after step 1 and
    # 0.031 after step 2, while one RL step moves them by 0.82 (a few weights whose micro-batch gradients cancel get
    # an Adam step of another sign: max 6e-3 = two lr steps); bounds ~3x the measurements
    ref1, ref2 = default["steps"][1]["weights"], default["steps"][2]["weights"]
    moved = _norm({n: ref2[n] - w for n, w in ref1.items()})
    for step in (1, 2):
        got, ref = bf16["steps"][step], default["steps"][step]
        assert got["engine_diff"] == 0.0  # the engine has the trained weights
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
            assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-2), (step, key)
        diff = _norm({n: got["weights"][n] - w for n, w in ref["weights"].items()})
        assert 0 < diff < 0.1 * moved, (step, diff, moved)


def _norm(tensors: dict) -> float:
    return float(sum(t.norm() ** 2 for t in tensors.values()) ** 0.5)


def test_verl_keys_train_and_resume_through_the_entry_point(two):
    result = two["precision_verl"]
    assert result["codes"] == (0, 0)
    assert result["steps"] == ["global_step_1", "global_step_2"]


def dry_run_argv(folder) -> list[str]:
    """A Megatron dry run at TP 2 on CPU of ``verl_inputs(folder)``'s tiny model."""
    verl_inputs(folder)
    return ["--dry-run", f"actor_rollout_ref.model.path={folder}/model", f"data.train_files={folder}/train.parquet",
            "trainer.device=cpu", "trainer.n_gpus_per_node=2", f"{A}.strategy=megatron",
            f"{A}.megatron.tensor_model_parallel_size=2", "algorithm.adv_estimator=grpo", "trainer.logger=[console]",
            "data.train_batch_size=4", f"{A}.ppo_mini_batch_size=2", "data.max_prompt_length=8",
            "data.max_response_length=4"]


def test_dry_run_counts_the_smaller_optimizer_state(tmp_path, capsys):
    argv = dry_run_argv(tmp_path)
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main(argv + KEYS) == 0
    out = capsys.readouterr().out
    assert "16 B/param (float32; the Trainer's AdamW per shard)" in plain
    assert "10 B/param (float32 weights, bf16 gradients, bf16 exp_avg, bf16 exp_avg_sq: precision-aware AdamW)" in out
    assert "PrecisionAwareAdamW" in out
