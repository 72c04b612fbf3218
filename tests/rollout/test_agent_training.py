"""Multi-turn trajectories from a real transformers model through the policy, the estimators, the losses
and a Trainer step: the policy's log-probs on the concatenated trajectory equal the sampler's on model
tokens, and tool/observation tokens inside a response carry no advantage and receive no gradient."""

import copy

import pytest
import torch

from rlflow.algorithms import GAE, GRPO, Aggregation, PPOLoss, TruncatedIS, ValueLoss
from rlflow.data import keys as K
from rlflow.models.critic import Critic
from rlflow.models.policy import Policy
from rlflow.models.tiny import tiny_qwen2
from rlflow.module import Chain
from rlflow.rewards import FunctionReward
from rlflow.rollout import HFRollout
from rlflow.rollout.agent import AgentLoop
from rlflow.tasks.calculator import CalculatorTask, chat_tokenizer, compute_score
from rlflow.trainer.trainer import Trainer
from rlflow import Batching, Loop, Optim, RunDir
from tests.rollout.agent_helpers import prompts, tool_caller


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


def task_tools():
    return CalculatorTask().tools()


def model_for(tok, seed=0):
    return tiny_qwen2(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                      max_positions=256, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=seed)


def interior_spans(mask: torch.Tensor) -> torch.Tensor:
    """Per row: positions with mask 0 that have a model token (mask 1) after them."""
    after = mask.flip(-1).cumsum(-1).flip(-1) - mask > 0
    return (mask == 0) & after


@pytest.fixture(scope="module")
def caller(tok):
    return tool_caller(tok)


@pytest.fixture(scope="module")
def agent_batch(tok, caller):
    """16 trajectories of a barely trained tool caller: most rows have interior spans of tool tokens."""
    model = caller
    loop = AgentLoop(HFRollout(n=8, temperature=0.8, max_new_tokens=64), task_tools(), max_assistant_turns=4)
    loop.bind(model, tok)
    torch.manual_seed(3)
    batch = prompts(tok, ["12*34", "56+78"], ground_truths=["408", "134"])
    out = loop(batch)
    assert interior_spans(out[K.RESPONSE_MASK]).any(-1).sum() >= 2, "the sample has no multi-turn rows"
    return model, loop, out


@pytest.mark.parametrize("remove_padding", [False, True])
def test_policy_log_probs_on_the_trajectory_equal_the_samplers_on_model_tokens(tok, agent_batch, remove_padding):
    model, _, out = agent_batch
    policy = Policy(model, tok, temperature=0.8, remove_padding=remove_padding)
    with torch.no_grad():
        log_probs, _ = policy.log_probs(out)
    mask = out[K.RESPONSE_MASK].bool()
    assert torch.allclose(log_probs[mask], out[K.ROLLOUT_LOG_PROBS][mask], atol=1e-5)
    # the model tokens after a tool span are scored in the context of that span
    after_span = mask & (interior_spans(out[K.RESPONSE_MASK]).long().cumsum(-1) > 0)
    assert after_span.sum() > 0


def test_estimators_and_losses_ignore_tool_tokens_inside_responses(tok, agent_batch):
    model, _, out = agent_batch
    batch = FunctionReward(compute_score)(out.clone())
    batch[K.SCORES] = torch.arange(16, dtype=torch.float32) % 3  # spread, so GRPO's advantages are not all 0
    from rlflow.rewards.base import place_on_last_token

    batch[K.TOKEN_REWARDS] = place_on_last_token(batch[K.SCORES], batch[K.RESPONSE_MASK])
    mask, holes = batch[K.RESPONSE_MASK].bool(), interior_spans(batch[K.RESPONSE_MASK])
    batch = GRPO()(batch)
    assert (batch[K.ADVANTAGES][~mask] == 0).all() and (batch[K.ADVANTAGES][mask] != 0).any()
    # GAE: values at tool positions change no advantage at a model token
    values = torch.randn(mask.shape)
    gae = GAE(gamma=0.9, lam=0.8)
    first = gae(batch.clone().set(K.VALUES, values))[K.ADVANTAGES]
    second = gae(batch.clone().set(K.VALUES, torch.where(holes, values + 100.0, values)))[K.ADVANTAGES]
    assert torch.allclose(first[mask], second[mask], atol=1e-5) and (first[holes] == 0).all()
    # the policy loss's gradient reaches model tokens only, including those after a tool span
    policy = Policy(model, tok, temperature=0.8)
    log_probs, entropy = policy.log_probs(batch)
    log_probs.retain_grad()
    batch[K.LOG_PROBS], batch[K.ENTROPY], batch[K.OLD_LOG_PROBS] = log_probs, entropy, log_probs.detach()
    out = PPOLoss(clip_ratio=0.2)(batch, Aggregation(num_tokens=mask.sum(), num_seqs=torch.tensor(16)))
    out.loss.backward()
    grad = log_probs.grad
    assert (grad[~mask] == 0).all()
    after_span = mask & (holes.long().cumsum(-1) > 0)
    assert (grad[after_span] != 0).any()
    # token-mean: -sum(A * m) / sum(m) at ratio 1
    expected = -(batch[K.ADVANTAGES] * mask).sum() / mask.sum()
    assert torch.allclose(out.loss, expected, atol=1e-6)


def test_trainer_step_on_multi_turn_rollouts(tok, caller, tmp_path):
    """One GRPO step and one PPO (GAE + critic) step with the agent loop: the trainer's old log-probs equal the
    sampler's on model tokens (truncated-IS weights exactly 1), the tool metrics are logged, the weights move."""
    model = copy.deepcopy(caller)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loop = AgentLoop(HFRollout(n=4, temperature=1.0, max_new_tokens=64), task_tools(), max_assistant_turns=3)
    trainer = Trainer(
        policy=Policy(model, tok), rollout=loop, reward=FunctionReward(compute_score),
        estimator=Chain(TruncatedIS(level="token"), GRPO()), loss=PPOLoss(is_weights=True), optim=Optim(lr=1e-3),
        batching=Batching(batch_size=4, mini_batch_size=2), loop=Loop(max_steps=1, progress=False),
        run=RunDir(path=tmp_path / "grpo", loggers=()),
    )
    torch.manual_seed(0)
    metrics = trainer.step(prompts(tok, ["12*34", "56+78", "9*9", "1-2"], ground_truths=["408", "134", "81", "-1"]))
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["rollout_corr/rollout_is_min"] == pytest.approx(1.0, abs=1e-4)
    for key in ("num_turns/mean", "tool_call_counts/mean", "agent/tool_error_rate", "agent/masked_tokens/mean"):
        assert key in metrics
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())

    critic = Critic(model_for(tok, seed=2))
    ppo = Trainer(
        policy=Policy(model, tok), rollout=loop, reward=FunctionReward(compute_score),
        estimator=GAE(gamma=1.0, lam=0.95), loss=PPOLoss(), critic=critic, value_loss=ValueLoss(), optim=Optim(lr=1e-3),
        batching=Batching(batch_size=4), loop=Loop(max_steps=1, progress=False),
        run=RunDir(path=tmp_path / "ppo", loggers=()),
    )
    metrics = ppo.step(prompts(tok, ["12*34", "56+78", "9*9", "1-2"], ground_truths=["408", "134", "81", "-1"]))
    assert all(torch.isfinite(torch.tensor(metrics[k])) for k in ("actor/pg_loss", "critic/vf_loss"))
