"""FullyAsyncRollout's group sampler (verl's trainer.v1.sampler.custom_sampler): the sampler chooses which finished
groups form a batch; groups at the staleness bound are taken whatever it chooses; a bad choice is named."""

import time

import pytest
import torch
from tensordict import TensorDict

from rlflow import PromptData
from rlflow.data import keys as K
from rlflow.rollout import FullyAsyncRollout, HFRollout
from rlflow.rollout.agent.trajectory import Trajectory
from rlflow.rollout.chunks import Sample
from rlflow.rollout.fully_async import _Group
from rlflow.rollout.group_sampler import GroupSampler, choose_groups


class Newest(GroupSampler):
    """Takes the last admitted groups and records what it was offered and what it chose."""

    def __init__(self):
        self.calls = []

    def choose(self, groups, k, step):
        chosen = list(range(len(groups)))[-k:]
        self.calls.append(([g.seq for g in groups], [groups[i] for i in chosen], step))
        return chosen


def test_the_sampler_chooses_which_finished_groups_form_the_batch(model, tokenizer, addition_rows):
    """Eight groups finished while the trainer learned: the sampler is offered all of them, oldest first, and the
    batch is the four it chose (the newest), not the four first admitted."""
    sampler = Newest()
    rollout = FullyAsyncRollout(HFRollout(n=2, max_new_tokens=2), max_off_policy_threshold=None,
                                num_warmup_batches=2, chunk_tokens=1, sampler=sampler, timeout=60)
    rollout.bind(model, tokenizer)
    stream = rollout.stream(PromptData(addition_rows[0], seed=0).loader(4, tokenizer))
    try:
        next(stream)
        deadline = time.monotonic() + 60  # the 12 groups admitted at the start: 4 taken, the 8 others finish
        while len(rollout._ready) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        second = next(stream)
    finally:
        stream.close()
        rollout.close()
    offered, chosen, step = sampler.calls[1]
    assert len(offered) >= 8 and offered == sorted(offered) and step == 0
    assert [g.seq for g in chosen] == offered[-4:] != offered[:4]
    assert all(len(g.responses) == 2 and g.age == 1 for g in chosen)
    assert list(second[K.PROMPT_TEXT][::2]) == [g.prompt[K.PROMPT_TEXT][0] for g in chosen]
    assert "sampler=Newest()" in repr(rollout)


def ready_groups(admitted):
    """Finished groups (one sample each) admitted at the given versions, in admission order."""
    groups = []
    for seq, version in enumerate(admitted):
        row = TensorDict({K.PROMPT_IDS: torch.tensor([[seq]])}, batch_size=[1])
        groups.append(_Group(seq, row, [Sample(prompt=[seq], tokens=[1] * (seq + 1), finish="stop")], version))
    return groups


def test_groups_at_the_staleness_bound_are_taken_before_the_sampler_chooses_the_rest():
    """Threshold 2 at version 5: the group admitted at 4 (age 2) would be over the bound at the next version, so
    it is in the batch although the sampler prefers the newest; the sampler chooses among the others only."""
    sampler = Newest()
    ready = ready_groups([4, 5, 5, 5])
    assert choose_groups(sampler, ready, 2, 5, threshold=2) == [0, 3]
    (offered, chosen, step), = sampler.calls
    assert offered == [1, 2, 3] and [g.age for g in chosen] == [1] and step == 5
    assert choose_groups(GroupSampler(), ready, 2, 5, threshold=None) == [0, 1]  # the default: first admitted
    assert choose_groups(sampler, ready, 2, 5, threshold=None) == [2, 3]


def test_an_agent_loops_group_shows_the_sampler_each_conversations_response_tokens():
    ready = ready_groups([5, 5])
    ready[1].samples = [Trajectory(prompt_ids=[1], budget=8, response_ids=[7, 8, 9], finish="stop")]
    sampler = Newest()
    assert choose_groups(sampler, ready, 1, 5, threshold=None) == [1]
    assert sampler.calls[0][1][0].responses == [[7, 8, 9]]


class Repeats(GroupSampler):
    def choose(self, groups, k, step):
        return [0] * k


@pytest.mark.parametrize("sampler, match", [
    (Repeats(), r"Repeats.choose\(groups, k=2, step=5\) returned \[0, 0\]: it must return 2 distinct indices"),
])
def test_a_sampler_returning_a_bad_choice_is_named(sampler, match):
    with pytest.raises(ValueError, match=match):
        choose_groups(sampler, ready_groups([5, 5, 5]), 2, 5, threshold=2)


def test_a_sampler_that_is_not_a_group_sampler_is_refused():
    with pytest.raises(ValueError, match="sampler must be a GroupSampler"):
        FullyAsyncRollout(HFRollout(n=2), sampler=object())
