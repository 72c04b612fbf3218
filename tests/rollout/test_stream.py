"""The experience stream: stages over the stream of scored batches, each timed on its own; dynamic sampling
pulls from the stream's own iterator; the Trainer's new form equals the older wrapper form; the prompt stream's
checkpoint position leaves out the batches generated ahead; validation scores with the run's reward."""

import copy
import time
import warnings

import pytest
import torch

from rlflow import FunctionReward, Policy, PPOLoss, PromptData, Trainer
from rlflow.algorithms import GRPO, GreedyBaseline, ReMax
from rlflow.data import keys as K
from rlflow.module import Chain
from rlflow.rollout import AsyncRollout, DynamicSampling, HFRollout, WithReferenceResponses
from rlflow.rollout.stream import Experience, FilterGroups, Prefetch, PromptStream, ReferenceResponses
from rlflow.trainer.options import with_groups
from tests.algorithms.test_dapo import ScriptedRollout, by_kind, prompts
from tests.algorithms.test_self_play import SampleRollout, prompts as spin_prompts


class Slow(ScriptedRollout):
    """Takes a moment per call, so that a part timed twice would show in the sum of the timings."""

    def forward(self, batch):
        time.sleep(0.02)
        return super().forward(batch)


def test_filter_groups_draws_more_prompt_batches_from_the_streams_iterator_and_times_each_part():
    rollout = Slow(n=4)
    drawn = []

    def batches():
        for kinds in (["easy", "mixed", "hard", "mixed"], ["mixed", "hard", "mixed", "mixed"], ["mixed"] * 4):
            drawn.append(kinds)
            yield prompts(kinds)

    experience = Experience(rollout, FunctionReward(by_kind), stages=[FilterGroups(max_gen_batches=3)])
    stream = experience(batches())
    out = next(stream)
    # round 1 keeps q1, q3; round 2 (the stream's next batch) keeps q0, q2, q3: cut to 4 groups
    assert len(drawn) == 2 and rollout.calls == 2 and out.batch_size[0] == 16
    assert list(out[K.PROMPT_TEXT])[::4] == ["q1", "q3", "q0", "q2"] and out[K.GROUP].tolist()[::4] == [0, 1, 2, 3]
    m = experience.metrics
    assert m["dapo/num_gen_batches"] == 2 and m["dapo/kept_group_frac"] == pytest.approx(5 / 8)
    assert m["reward/errors"] == 0
    timings = {k: v for k, v in m.items() if k.startswith("timing_s/")}
    assert set(timings) == {"timing_s/gen", "timing_s/reward", "timing_s/dynamic_sampling"}
    # each part's own time: none counts the parts it pulled from, so together they are the batch's wall time
    assert timings["timing_s/gen"] >= 0.04 and sum(timings.values()) <= experience.elapsed + 1e-6
    nxt = next(stream)  # the stream goes on with the third batch (all mixed: one round)
    assert len(drawn) == 3 and experience.metrics["dapo/num_gen_batches"] == 1 and nxt.batch_size[0] == 16
    with pytest.raises(RuntimeError, match="needs more prompt batches than the stream has"):
        Experience(ScriptedRollout(n=2), FunctionReward(by_kind), [FilterGroups()]).collect(prompts(["easy"]))


def test_reference_responses_stage_equals_the_wrapper_and_is_scored_and_timed(tokenizer):
    score = FunctionReward(lambda response, ground_truth: float(response == ground_truth))
    batch = spin_prompts(tokenizer, ["12345", "7"])
    wrapped = score(WithReferenceResponses(SampleRollout(2, tokenizer))(batch.clone()))
    experience = Experience(SampleRollout(2, tokenizer), score, stages=[ReferenceResponses()])
    out = experience.collect(batch.clone())
    assert out[K.IS_REFERENCE].tolist() == [False, False, True, False, False, True]
    assert out[K.SCORES].tolist() == wrapped[K.SCORES].tolist() == [0, 0, 1, 0, 0, 1]  # the real rows are scored
    assert torch.equal(out[K.RESPONSE_IDS], wrapped[K.RESPONSE_IDS])
    assert "timing_s/reference_responses" in experience.metrics


def test_prefetch_stage_and_bad_stages():
    experience = Experience(HFRollout(n=2), FunctionReward(by_kind), stages=[Prefetch(1, placement="process")])
    assert isinstance(experience.rollout, AsyncRollout) and experience.rollout.max_staleness == 1
    with pytest.raises(ValueError, match="one engine stage at most"):
        Experience(HFRollout(n=2), FunctionReward(by_kind), stages=[Prefetch(1), Prefetch(0)])
    with pytest.raises(ValueError, match="needs a reward"):
        Experience(HFRollout(n=2), None)


def test_prompt_stream_position_leaves_out_the_batches_ahead(tokenizer, addition_rows):
    loader = PromptData(addition_rows[0], seed=0).loader(4, tokenizer)
    stream = PromptStream(loader)
    first = next(stream)
    after_first = loader.state_dict()
    next(stream), next(stream)
    stream.ahead = 2  # two batches generated ahead, not trained on
    assert stream.state_dict() == after_first
    resumed = PromptStream(PromptData(addition_rows[0], seed=0).loader(4, tokenizer))
    resumed.load_state_dict(stream.state_dict())
    second = next(resumed)
    assert not torch.equal(second[K.PROMPT_IDS], first[K.PROMPT_IDS])
    stream.ahead = 0
    assert stream.state_dict() == loader.state_dict()


def longer_is_better(solution_str, ground_truth):
    return len(solution_str.strip()) / 4


def run(model, tokenizer, rows, tmp_path, **kwargs):
    kwargs = dict(rollout=HFRollout(n=4, max_new_tokens=4), reward=FunctionReward(longer_is_better),
                  estimator=GRPO(), loss=PPOLoss(), max_steps=2) | kwargs
    trainer = Trainer(
        policy=Policy(copy.deepcopy(model), tokenizer),
        **with_groups(batch_size=4, lr=5e-2, run_dir=tmp_path, loggers=(), progress=False, **kwargs),
    )
    data = PromptData(rows[0], val=rows[1][:4], seed=0)
    return trainer, trainer.fit(data), trainer.validate(data)


def shared(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/"))}


def test_trainer_stages_equal_the_older_wrapper_forms(model, tokenizer, addition_rows, tmp_path):
    """DAPO as a stage equals ``rollout=DynamicSampling(...), reward=None`` (deprecated, taken apart), and
    validation scores with the run's reward in both; ReMax's greedy baseline as a stage equals it in the
    estimator slot. The stages are timed under their own names."""
    stage = run(model, tokenizer, addition_rows, tmp_path / "stage", stages=[FilterGroups(max_gen_batches=5)])[1:]
    with pytest.warns(DeprecationWarning, match="stages=\\[FilterGroups"):
        old = run(model, tokenizer, addition_rows, tmp_path / "old", reward=None, rollout=DynamicSampling(
            HFRollout(n=4, max_new_tokens=4), FunctionReward(longer_is_better), max_gen_batches=5))[1:]
    assert [shared(m) for m in stage[0]] == [shared(m) for m in old[0]] and stage[1] == old[1]
    assert all("timing_s/dynamic_sampling" in m and "dapo/num_gen_batches" in m for m in stage[0])

    remax = dict(estimator=ReMax())
    trainer, as_stage, _ = run(model, tokenizer, addition_rows, tmp_path / "remax",
                               stages=[GreedyBaseline(reward=FunctionReward(longer_is_better))], **remax)
    rollout = HFRollout(n=4, max_new_tokens=4)
    _, in_slot, _ = run(model, tokenizer, addition_rows, tmp_path / "slot", rollout=rollout,
                        estimator=Chain(GreedyBaseline(rollout, FunctionReward(longer_is_better)), ReMax()))
    assert [shared(m) for m in as_stage] == [shared(m) for m in in_slot]
    assert all("timing_s/greedy_baseline" in m and "remax/greedy_score/mean" in m for m in as_stage)
    assert trainer.experience.stages[0].module.rollout is trainer.rollout  # the run's rollout, filled in


def test_val_sampling_is_a_constructor_argument(model, tokenizer, addition_rows, tmp_path):
    opts = {"n": 2, "do_sample": True, "temperature": 1.0}
    trainer, _, val = run(model, tokenizer, addition_rows, tmp_path, val_sampling=opts, max_steps=1)
    assert trainer.val_sampling == opts and any(k.endswith("/mean@2") for k in val)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new form warns about nothing
        Experience.of(HFRollout(n=2), FunctionReward(by_kind), [FilterGroups()])
    with pytest.raises(ValueError, match="not both"):
        Experience.of(HFRollout(n=2), None, experience=Experience(HFRollout(n=2), FunctionReward(by_kind)))
