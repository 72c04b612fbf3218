"""Fully asynchronous RL on 2 gloo processes (one launch of async_worker.py, ranks forked from the test process):
rank 0's engine generates for both ranks, each step's groups are split whole among them, the weights reach the
engine from rank 0."""

import json

import pytest
import torch

from rlflow.data import keys as K
from rlflow.data.prompts import PromptData
from rlflow.models.tiny import char_tokenizer
from rlflow.tasks.addition import AdditionTask

from . import async_worker
from .async_worker import BATCH, STEPS, THRESHOLD
from .launch import WORKER, can_fork_ranks, fork_ranks, torchrun


@pytest.fixture(scope="module")
def launched(job, tmp_path_factory):
    out = tmp_path_factory.mktemp("async_ranks")
    verl = [a for a in job if not a.startswith("trainer.save_freq")] + [
        "trainer.n_gpus_per_node=2", "trainer.total_training_steps=2", "trainer.logger=[console,file]",
        "trainer.use_v1=true", "trainer.v1.trainer_mode=colocate_async", "trainer.v1.sampler.max_off_policy_threshold=1",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score"]  # DAPO's filter, on rank 0
    if can_fork_ranks():  # 2 ranks forked from this warm process: no fresh interpreters importing rlflow
        stdout = fork_ranks(2, out, async_worker.main, str(out), verl, timeout=600)
    else:
        proc = torchrun(2, out, *verl, worker=WORKER.with_name("async_worker.py"), timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        stdout = proc.stdout
    return torch.load(out / "result.pt", weights_only=False), out, stdout


def drawn_in_order(count):
    loader = PromptData(AdditionTask().splits()[0][:64], seed=0).loader(BATCH, char_tokenizer())
    return [p for _ in range(count // BATCH) for p in next(loader)[K.PROMPT_TEXT]]


def test_every_drawn_prompt_is_trained_once_across_the_ranks_within_the_bound_and_the_ranks_stay_equal(launched):
    (rank0, rank1), _, _ = launched
    assert rank0["engine"] and not rank1["engine"]  # one engine, on rank 0
    assert len(rank0["steps"]) == len(rank1["steps"]) == STEPS
    trained = []
    for mine, other in zip(rank0["steps"], rank1["steps"]):
        assert mine["version"] == other["version"]
        for share in (mine, other):  # whole groups, numbered per rank as a synchronous shard's
            assert len(share["prompts"]) == BATCH // 2 and share["groups"] == [g for g in range(BATCH // 2)
                                                                                for _ in range(2)]
            assert share["version"] - min(share["oldest"]) + 1 <= THRESHOLD  # verl's age: within the bound
        trained += mine["prompts"] + other["prompts"]
    assert len(trained) == len(set(trained)) == STEPS * BATCH  # none trained twice, on either rank
    left = rank0["left"]
    drawn = len(trained) + len(left)
    assert drawn % BATCH == 0 and not set(trained) & set(left)
    assert sorted(trained + left) == sorted(drawn_in_order(drawn))  # the loader's first prompts, none lost
    assert any(min(s["oldest"]) < s["version"] for s in rank0["steps"] + rank1["steps"])  # it did run ahead
    for name, weights in rank0["weights"].items():
        assert torch.equal(weights, rank1["weights"][name]), name
    assert rank0["history"][-1]["training/off_policy/trajectory_staleness_worst/max"] == \
        rank1["history"][-1]["training/off_policy/trajectory_staleness_worst/max"]  # rank 0's stats, on both


def test_verls_v1_keys_train_fully_async_on_two_fsdp2_processes_with_the_engine_in_step(launched):
    """verl's V1 keys with algorithm.filter_groups: rank 0 filters, both ranks log its dapo/* metrics."""
    _, out, stdout = launched
    assert "FullyAsyncRollout(" in stdout and "FilterGroups(" in stdout
    rows = [json.loads(line) for line in (out / "verl" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "training/off_policy/trajectory_spans/max" in r]
    assert len(steps) == 2 and all(r["training/off_policy/trajectory_staleness_worst/max"] == 0 for r in steps)
    assert all(r["dapo/num_gen_batches"] >= 1 and 0 < r["dapo/kept_group_frac"] <= 1 for r in steps)
    # threshold 1: every token is sampled with the weights it is trained on, gathered from FSDP2's shards into
    # rank 0's engine after step 1 (stale weights give ~1e-2 here)
    assert all(r["training/rollout_probs_diff_max"] < 1e-4 for r in steps)


def test_resumed_from_a_checkpoint_the_ranks_train_the_prompts_rank_0_held_and_none_twice(launched):
    """Resumed from step 2: rank 0's checkpoint holds its loader position and the prompts drawn but not trained;
    steps 3-4 train those first. Steps 1-2 of the run + 3-4 of the resumed one: no prompt twice, none lost."""
    run, out, _ = launched
    resumed = torch.load(out / "resumed" / "result.pt", weights_only=False)
    assert [s["version"] for s in resumed[0]["steps"]] == [s["version"] for s in resumed[1]["steps"]] == [2, 3]
    lineage = [p for rank in run for s in rank["steps"][:2] for p in s["prompts"]]
    lineage += [p for rank in resumed for s in rank["steps"] for p in s["prompts"]]
    assert len(lineage) == len(set(lineage)) == STEPS * BATCH
    left = resumed[0]["left"]
    assert sorted(lineage + left) == sorted(drawn_in_order(len(lineage) + len(left)))


def test_one_step_off_on_two_processes_trains_each_batch_once_split_whole_one_version_behind_at_most(launched):
    """AsyncRollout by the same mechanism: rank 0's engine generates the loader's whole batches one step ahead;
    each batch is trained once, half on each rank in whole groups, at most one version stale; equal weights."""
    _, out, _ = launched
    rank0, rank1 = torch.load(out / "one_step_off" / "result.pt", weights_only=False)
    assert rank0["engine"] and not rank1["engine"]
    trained = []
    for mine, other in zip(rank0["steps"], rank1["steps"], strict=True):
        for share in (mine, other):
            assert share["groups"] == [g for g in range(BATCH // 2) for _ in range(2)]
            assert share["version"] - min(share["oldest"]) <= 1
        trained += mine["prompts"] + other["prompts"]
    assert trained == drawn_in_order(STEPS * BATCH)  # the loader's batches in order, none twice
    assert any(min(s["oldest"]) < s["version"] for s in rank0["steps"])  # it did run one step ahead
    assert all(torch.equal(w, rank1["weights"][name]) for name, w in rank0["weights"].items())


@pytest.mark.parametrize("mode", ["fully", "one_step_off"])
def test_dynamic_sampling_on_two_processes_rank_0_filters_and_hands_out_only_kept_whole_groups(launched, mode):
    """DAPO's filter with rank 0's engine: rank 0 alone scores (the other rank's reward never runs), filters and
    tops up (fully async: the next groups to finish; one step off: the stream's next whole batches), and each step
    trains exactly the first BATCH kept groups, split whole between the ranks; both ranks see rank 0's dapo/*."""
    rank0, rank1 = torch.load(launched[1] / f"filtered_{mode}" / "result.pt", weights_only=False)
    assert rank0["engine"] and not rank1["engine"] and rank0["scored"] and not rank1["scored"]
    scored = iter(rank0["scored"])
    for mine, other in zip(rank0["steps"], rank1["steps"], strict=True):
        for share in (mine, other):
            assert share["groups"] == [g for g in range(BATCH // 2) for _ in range(2)]
            assert all(share["scores"][2 * i] != share["scores"][2 * i + 1] for i in range(BATCH // 2))
            assert share["version"] - min(share["oldest"]) + 1 <= (THRESHOLD if mode == "fully" else 2)
        kept, count = [], 0
        while len(kept) < BATCH:  # this step's scored groups: one at a time (fully async) or whole batches
            for _ in range(1 if mode == "fully" else BATCH):
                text, scores = next(scored)
                count += 1
                kept += [text] if len(set(scores)) > 1 else []
        assert mine["prompts"] + other["prompts"] == kept[:BATCH]
        assert mine["dapo"] == other["dapo"] and mine["dapo"]["dapo/num_gen_batches"] == count / BATCH
    assert any(s["dapo"]["dapo/num_gen_batches"] > 1 for s in rank0["steps"])  # it did filter
    assert all(torch.equal(w, rank1["weights"][name]) for name, w in rank0["weights"].items())
