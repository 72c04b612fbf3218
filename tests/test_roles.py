"""The roles as Protocols (rlflow.roles): rlflow's own classes have every member their role asks for, and a Trainer
built with an object that lacks one fails at once, naming the object, the role and the member."""

import copy

import pytest

from rlflow import GAE, GRPO, Critic, FunctionReward, HFRollout, Policy, PPOLoss, Trainer, ValueLoss, roles
from rlflow.algorithms import TruncatedIS
from rlflow.module import BatchModule, Chain
from rlflow.rollout import AsyncRollout, WithReferenceResponses
from rlflow.rollout.agent import AgentLoop
from rlflow.rollout.engines.hf import HFEngine
from rlflow.rollout.stream import Experience
from rlflow.tasks.calculator import CalculatorTask
from tests.trainer.helpers import starts_with_digit


def test_rlflow_classes_have_every_member_of_their_role(model, tokenizer):
    rollout = HFRollout(n=2, max_new_tokens=2)
    cases = [(rollout, roles.Rollout), (AsyncRollout(HFRollout(n=2), max_staleness=1), roles.Rollout),
             (WithReferenceResponses(rollout), roles.Rollout), (AgentLoop(rollout, CalculatorTask().tools()), roles.Rollout),
             (FunctionReward(starts_with_digit), roles.Reward), (GRPO(), roles.AdvantageEstimator),
             (GAE(), roles.AdvantageEstimator), (Chain(TruncatedIS(), GRPO()), roles.AdvantageEstimator),
             (PPOLoss(), roles.Loss), (ValueLoss(), roles.Loss), (Policy(model, tokenizer), roles.Policy),
             (HFEngine(model, tokenizer), roles.Engine)]
    for obj, role in cases:
        assert roles.missing(obj, role) == [], (type(obj).__name__, role.__name__)
        assert isinstance(obj, role)  # runtime_checkable: the same members, as typing sees them


class NoBind(BatchModule):
    """A rollout as one might write it for the experience stream alone: no bind, no sync_weights."""

    in_keys, out_keys, n, temperature, max_new_tokens, holds_own_weights, tokenizer = (), (), 1, 1.0, 4, False, None

    def with_options(self, **overrides):
        return self


def trainer(model, tokenizer, **roles_):
    parts = dict(rollout=HFRollout(n=2, max_new_tokens=2), reward=FunctionReward(starts_with_digit), estimator=GRPO(),
                 loss=PPOLoss()) | roles_
    return Trainer(Policy(copy.deepcopy(model), tokenizer), **parts)


def test_a_role_without_a_member_is_refused_naming_object_role_and_member(model, tokenizer):
    with pytest.raises(TypeError, match=r"rollout \(NoBind\) is not a Rollout: it has no 'bind', 'sync_weights' "
                                        r"\(rlflow.roles.Rollout asks for in_keys, out_keys, __call__, n, "):
        trainer(model, tokenizer, rollout=NoBind())
    with pytest.raises(TypeError, match=r"estimator \(BatchModule\) is not an AdvantageEstimator: it has no "
                                        r"'needs_critic'"):
        trainer(model, tokenizer, estimator=BatchModule())
    with pytest.raises(TypeError, match=r"loss is None: the Trainer needs a Loss \(rlflow.roles.Loss asks for in_keys, "):
        trainer(model, tokenizer, loss=None)
    with pytest.raises(TypeError, match=r"value_loss \(str\) is not a Loss: it has no 'in_keys', '__call__'"):
        trainer(model, tokenizer, estimator=GAE(), critic=Critic(copy.deepcopy(model)), value_loss="mse")


def test_optional_members_have_their_written_defaults(tokenizer):
    class Bare(BatchModule):  # a reward with no stats or extras: the stream and validation read the defaults
        in_keys, out_keys = (), ()

    assert dict(roles.optional(Bare(), roles.Reward, "stats")) == {} == dict(roles.optional(Bare(), roles.Reward,
                                                                                             "extras"))
    assert roles.optional(Bare(), roles.Rollout, "close") is None
    assert callable(roles.optional(AsyncRollout(HFRollout(n=1), max_staleness=1), roles.Rollout, "close"))
    with pytest.raises(KeyError):  # only what OPTIONAL writes may be read so
        roles.optional(Bare(), roles.Reward, "in_flight")
    Experience(HFRollout(n=1), FunctionReward(starts_with_digit)).close()  # the rollout started nothing: nothing to do
