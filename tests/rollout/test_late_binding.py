"""Engines built without a model and bound to it later (``Engine.bind``); one SingleTurnRollout over any engine,
a user's engine class included, with no rollout class of its own."""

import copy

import pytest
import torch

from rlflow import FunctionReward, Policy, PPOLoss, PromptData, Trainer
from rlflow.algorithms import GRPO
from rlflow.data import keys as K
from rlflow.data.prompts import collate, load_rows
from rlflow.rollout import AsyncRollout, HFRollout, ServerRollout, SingleTurnRollout
from rlflow.rollout.engines import Completion, Engine, HFEngine, SamplingParams, ServerEngine
from rlflow.rollout.engines.base import counted
from rlflow.trainer.options import with_groups
from tests.rollout.test_async_rollout import longer_is_better


def prompts(tokenizer, texts=("12+34=", "5+6=", "99+99=")):
    rows, _ = load_rows([{"prompt": t, "ground_truth": str(i)} for i, t in enumerate(texts)])
    return collate(rows, tokenizer)


class ArgmaxCopy(Engine):
    """A user's engine: greedy decoding one token at a time on a copy of the model of its own, made at bind.
    Nothing else is written for it: no rollout class, no factory."""

    holds_own_weights = True

    def bind(self, model, tokenizer):
        self.copy, self.eos = copy.deepcopy(model).eval(), tokenizer.eos_token_id

    @torch.no_grad()
    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            ids, tokens, log_probs = list(prompt), [], []
            while len(tokens) < params.max_new_tokens and (not tokens or tokens[-1] != self.eos):
                step = torch.log_softmax(self.copy(torch.tensor([ids])).logits[0, -1].float(), -1)
                token = int(step.argmax())
                tokens.append(token), log_probs.append(float(step[token])), ids.append(token)
            finish = "stop" if tokens[-1] == self.eos else "length"
            out.append([Completion(tokens, log_probs, finish) for _ in range(params.n)])
        return out

    @torch.no_grad()
    def load_weights(self, buckets):
        params, totals = dict(self.copy.named_parameters(remove_duplicate=False)), {}
        for name, tensor in counted(buckets, totals):
            params[name].copy_(tensor)
        return totals


def test_an_engine_bound_later_samples_what_one_built_with_the_model_samples(model, tokenizer):
    ids = [tokenizer(t)["input_ids"] for t in ("12+34=", "5+6=")]
    params = SamplingParams(n=3, temperature=0.7, top_k=9, max_new_tokens=6, seed=5)
    late = HFEngine(cache_implementation=None)
    with pytest.raises(RuntimeError, match=r"HFEngine has no model: .*engine.bind\(model, tokenizer\)"):
        late.generate(ids, params)
    late.bind(model, tokenizer)
    a, b = late.generate(ids, params), HFEngine(model, tokenizer).generate(ids, params)
    assert [[c.token_ids for c in per] for per in a] == [[c.token_ids for c in per] for per in b]
    assert [[c.log_probs for c in per] for per in a] == [[c.log_probs for c in per] for per in b]
    # through a rollout, whose bind binds its engine: tests/rollout/test_engines.py (SingleTurnRollout(HFEngine()))


def test_sampling_options_as_one_sampling_params_or_as_keywords(model, tokenizer):
    rollout = SingleTurnRollout(HFEngine(), sampling=SamplingParams(n=2, greedy=True, max_new_tokens=3))
    assert (rollout.n, rollout.do_sample, rollout.max_new_tokens) == (2, False, 3)
    assert rollout.sampling == HFRollout(n=2, do_sample=False, max_new_tokens=3).sampling
    assert rollout.with_options(n=1).sampling == SamplingParams(n=1, greedy=True, max_new_tokens=3)
    with pytest.raises(TypeError, match="either as sampling=SamplingParams"):
        SingleTurnRollout(HFEngine(), n=4, sampling=SamplingParams(n=2))
    with pytest.raises(RuntimeError, match="has no engine: pass one"):
        SingleTurnRollout(None, n=2).bind(model, tokenizer)
    with pytest.raises(TypeError, match=r"engine \(HFRollout\) is not an rlflow.rollout.engines.Engine"):
        SingleTurnRollout(HFRollout(), n=2)  # a rollout where an engine goes


def test_a_user_engine_class_is_all_a_new_engine_costs(model, tokenizer, addition_rows, tmp_path):
    """ArgmaxCopy under the Trainer: bound to the policy's model (its copy made then), the policy's weights sent
    after every update, its log-probs the policy's; and under AsyncRollout in a child process, unchanged."""
    rollout = SingleTurnRollout(ArgmaxCopy(), n=2, do_sample=False, max_new_tokens=4)
    trainer = Trainer(policy=Policy(model, tokenizer), rollout=rollout, reward=FunctionReward(longer_is_better),
                      estimator=GRPO(), loss=PPOLoss(),
                      **with_groups(batch_size=4, lr=5e-2, max_steps=2, run_dir=tmp_path, loggers=(), progress=False))
    history = trainer.fit(PromptData(addition_rows[0], seed=0))
    assert all(m["weight_sync/buckets"] >= 1 for m in history)  # every update reached the engine's copy
    held = dict(rollout.engine.copy.named_parameters())
    assert all(torch.equal(p, held[name]) for name, p in model.named_parameters())
    batch = rollout(prompts(tokenizer))
    mask = batch[K.RESPONSE_MASK].bool()
    policy = Policy(model, tokenizer)(batch.clone())[K.OLD_LOG_PROBS]
    torch.testing.assert_close(batch[K.ROLLOUT_LOG_PROBS][mask], policy[mask], atol=1e-4, rtol=0)

    ahead = AsyncRollout(SingleTurnRollout(ArgmaxCopy(), n=2, do_sample=False, max_new_tokens=4), max_staleness=0)
    try:
        ahead.bind(model, tokenizer)
        again = ahead(prompts(tokenizer))
    finally:
        ahead.close()
    assert torch.equal(again[K.RESPONSE_IDS], batch[K.RESPONSE_IDS])


def test_a_server_engine_is_built_without_contacting_its_server():
    """ServerEngine(url) and ServerRollout(url) contact nothing until bind (a server started later, or by
    ``launch=`` at bind); bind then names an unreachable one."""
    url = "http://127.0.0.1:9"  # discard port: nothing answers there
    engine = ServerEngine(url, retries=0, eos_token_ids=None)
    rollout = ServerRollout(url, retries=0)
    assert rollout.engine.url == url and rollout.holds_own_weights and rollout.engine.remote
    with pytest.raises(Exception, match=f"cannot reach the server at {url}"):
        engine.bind(None, type("T", (), {"eos_token_id": 0})())
    assert engine.eos_token_ids == (0,)  # the tokenizer's EOS, since none was given
    rollout.close()
    engine.close()
