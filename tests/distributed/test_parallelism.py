"""Sequence parallelism, token balancing, token-budget micro-batches and sharded validation on 2 CPU processes.

Each run is compared with one process on the same global batch: the same weights after a
step and the same validation metrics.
"""

from pathlib import Path

import pytest
import torch

from rlflow.trainer.distributed import partition_equal_counts

from . import worker
from .launch import assert_same_weights, assert_updates, can_fork_ranks, fork_ranks, run_ok, torchrun
from .worker import build


# The module's 2-process jobs: one launch runs them one after another (worker.py's "+"; each launch starts every
# process and imports torch), each writing OUT/result.pt (collectives_worker: OUT/rank{r}.pt). The two workers that
# test pieces build their own groups, so they come first.
JOBS = {"ulysses": ("ulysses_worker",), "collectives": ("collectives_worker",), "sp": ("fsdp2", 1, "sp=2", "remove_padding=1"), "balanced": ("ddp", 1, "max_tokens=12", "val=1"),
        "batch_stats": ("fsdp2", 2, "batch_stats=1"), "critic_ddp": ("ddp", 2, "critic=1", "resumed=1"),
        "critic_fsdp2": ("fsdp2", 2, "critic=1", "resumed=1", "sp=2", "remove_padding=1")}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """{job: (its result.pt, its run folder)} of JOBS."""
    root = tmp_path_factory.mktemp("launched")
    for name in JOBS:
        (root / name).mkdir()
    args = [str(a) for name, job in JOBS.items() for a in ("+", *worker_job(root / name, job))][1:]
    if can_fork_ranks():  # 2 ranks forked from this warm process: no fresh interpreters importing rlflow
        fork_ranks(2, root, worker.main, args)
    else:
        run_ok(2, *args)
    return {name: (torch.load(root / name / "result.pt", weights_only=False) if (root / name / "result.pt").exists()
                   else None, root / name) for name in JOBS}


def worker_job(out, job):
    """worker.py's arguments for a job: OUT STRATEGY STEPS ..., or a worker module's name then OUT."""
    return (job[0], out, *job[1:]) if job[0].endswith("_worker") else (out, *job)


def reference(out, **options):
    trainer, data, record = build(str(out), "auto", steps=1, devices=1, **options)
    trainer.fit(data)
    assert_updates(record.steps)
    return record.steps[1]


def test_ulysses_attention_matches_one_process(launched):
    """Log-probs, entropy, values and their summed gradients, split over 2 ranks, equal one process's."""
    result = launched["ulysses"][0]
    assert result["mask_choices"] == [False, True]  # both the block-diagonal mask and plain causal ran
    cases = [k for k in result if k not in ("padded_error", "mask_choices")]
    assert len(cases) == 8
    for name in cases:
        assert result[name]["grad_norm"] > 1.0, name  # the gradients compared are not trivially zero
        assert result[name]["out"] < 1e-5, (name, result[name])
        assert result[name]["grad"] < 1e-4 * result[name]["grad_norm"], (name, result[name])
    assert "remove_padding=True" in result["padded_error"]


def test_sequence_parallel_trainer_step_equals_one_process(launched, tmp_path):
    one = reference(tmp_path / "one", remove_padding=1)
    two = launched["sp"][0][1]
    assert two["metrics"]["actor/pg_loss"] == pytest.approx(one["metrics"]["actor/pg_loss"], abs=1e-5)
    assert two["metrics"]["perf/total_num_tokens"] == one["metrics"]["perf/total_num_tokens"]
    assert_same_weights(two["weights"], one["weights"])


def test_balanced_token_budget_and_sharded_validation_equal_one_process(launched, tmp_path):
    """DDP on 2 ranks with rows re-dealt by tokens, a token budget per micro-batch (the ranks' counts made
    equal) and validation split over the ranks: the same update and validation metrics as one process."""
    one = reference(tmp_path / "one", val=1)
    two = launched["balanced"][0][1]
    assert_same_weights(two["weights"], one["weights"])
    val = {k: v for k, v in one["metrics"].items() if k.startswith("val-")}
    assert val and {k: two["metrics"][k] for k in val} == pytest.approx(val)
    m = two["metrics"]
    assert 1.0 <= m["perf/tokens_max_over_mean"] <= m["perf/tokens_max_over_mean_before_balance"]


def test_balancing_and_budget_counts_on_skewed_ranks(launched):
    """Rank 0 holds 8 rows of 14 tokens, rank 1 8 rows of 7 (shorter responses too)."""
    out = launched["collectives"][1]
    r0, r1 = (torch.load(out / f"rank{r}.pt") for r in range(2))
    # each mini-batch (rows 0-3 of both ranks, then 4-7) keeps its rows, now half long, half short on each rank
    assert r0["row_ids"][:4] + r1["row_ids"][:4] == [0, 2, 100, 102, 1, 3, 101, 103]
    assert sorted(r0["row_ids"] + r1["row_ids"]) == [*range(8), *range(100, 108)]
    assert r0["tokens"] == r1["tokens"] == (8 * 14 + 8 * 7) // 2
    assert r0["stats"]["perf/tokens_max_over_mean_before_balance"] == pytest.approx(112 / 84)
    assert r0["stats"]["perf/tokens_max_over_mean"] == 1.0
    assert r0["response_len"] == r1["response_len"] == 8  # padded to the longest response
    assert r0["cov_dtype"] == "torch.bool" and "data_source" not in r0["keys"]
    # a 28-token budget gives rank 0 four micro-batches and rank 1 two; rank 1 splits to match
    assert len(r0["micro_rows"]) == len(r1["micro_rows"]) == 4
    assert max(r0["micro_tokens"] + r1["micro_tokens"]) <= 28


def test_partition_equal_counts_balances_sums():
    lengths = [9, 1, 8, 2, 7, 3, 6, 4]
    parts = partition_equal_counts(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert [len(p) for p in parts] == [4, 4]
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert sums == [20, 20]  # by hand: 9, 8 -> p0, p1; 7 -> p1; 6, 4 -> p0; 3, 2 -> p1; 1 -> p0: {9,6,4,1} {8,7,3,2}
    skewed = [10, 10, 10, 10, 1, 1, 1, 1]  # rank 0 would hold 40 tokens, rank 1 4
    assert [sum(skewed[i] for i in p) for p in partition_equal_counts(skewed, 2)] == [22, 22]
    assert partition_equal_counts([5, 5, 5], 3) == [[0], [1], [2]]


def test_distributed_recipe_runs_with_sequence_parallelism(tmp_path):
    recipe = Path(__file__).parents[2] / "recipes" / "distributed.py"
    proc = torchrun(2, "--steps", "2", "--sp", "2", "--run-dir", tmp_path, worker=recipe)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "sequence parallelism: 1 group(s) of 2 processes" in out and "held-out accuracy after 2 steps" in out


def test_whole_batch_statistics_span_the_processes(launched, tmp_path):
    """REINFORCE++ whitens over the whole batch and the adaptive KL controller reads its mean KL and size:
    on 2 processes (each holding half the batch) the statistics, hence the updates, are one process's."""
    trainer, data, record = build(str(tmp_path / "one"), "auto", steps=2, devices=1, batch_stats=1)
    trainer.fit(data)
    assert_updates(record.steps)
    one = record.steps
    two = launched["batch_stats"][0]
    for step in (1, 2):
        for key in ("actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "critic/advantages/max",
                    "critic/advantages/min", "actor/pg_loss"):
            assert two[step]["metrics"][key] == pytest.approx(one[step]["metrics"][key], rel=1e-4, abs=1e-6), key
        assert_same_weights(two[step]["weights"], one[step]["weights"])
    assert one[2]["metrics"]["actor/reward_kl_penalty_coeff"] != 0.1  # the controller moved


@pytest.mark.parametrize("strategy, options", [("ddp", ()), ("fsdp2", ("sp=2", "remove_padding=1"))])
def test_ppo_with_a_critic_equals_one_process(launched, tmp_path, strategy, options):
    """GAE + critic (advantages whitened over the whole batch, value loss, two optimizers): data parallel with
    balancing, and one FSDP2 sequence-parallel group splitting policy and critic; resumed from a checkpoint."""
    padding = {"remove_padding": 1} if options else {}
    trainer, data, record = build(str(tmp_path / "one"), "auto", steps=2, devices=1, critic=1, **padding)
    trainer.fit(data)
    assert_updates(record.steps)
    one = record.steps
    assert JOBS[f"critic_{strategy}"] == (strategy, 2, "critic=1", "resumed=1", *options)
    # the critic is checkpointed on its own (critic.ckpt): resuming from step 1 (in the same launch) gives step 2 again
    two, run_dir = launched[f"critic_{strategy}"]
    two = dict(two)
    resumed = {2: two.pop("resumed")}
    assert (run_dir / "global_step_1" / "critic.ckpt").exists() and two.pop("resumed_steps") == [2]
    for run, steps in ((two, (1, 2)), (resumed, (2,))):
        for step in steps:
            for key in ("critic/vf_loss", "critic/grad_norm", "actor/pg_loss", "critic/advantages/max"):
                assert run[step]["metrics"][key] == pytest.approx(one[step]["metrics"][key], rel=1e-4, abs=1e-6), key
            assert_same_weights(run[step]["weights"], one[step]["weights"])
