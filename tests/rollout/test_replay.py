"""Replaying dumped rollouts (verl's skip.* / skip_rollout): a run dumps each round's samples, a later run with the
same settings trains on exactly those samples without generating; other prompts or settings, and verl's dumps, are
refused naming what differs."""

import copy
import pickle

import pytest
import torch

from rlflow import FunctionReward, GRPO, HFRollout, Policy, PPOLoss, PromptData, Trainer
from rlflow.data import keys as K
from rlflow.rollout.replay import ReplayRollout
from rlflow.trainer.options import groups
from tests.trainer.helpers import starts_with_digit


class Counted(HFRollout):
    """HFRollout that counts its generation calls."""

    calls = 0

    def forward(self, batch):
        type(self).calls += 1
        return super().forward(batch)


def run(model, tokenizer, rows, run_dir, dump_dir, seed=0, **replay):
    train, val = rows
    rollout = ReplayRollout(Counted(n=4, max_new_tokens=4), dump_dir, {"model": "tiny"}, **replay)
    trainer = Trainer(policy=Policy(copy.deepcopy(model), tokenizer), rollout=rollout,
                      reward=FunctionReward(starts_with_digit), estimator=GRPO(), loss=PPOLoss(),
                      **groups(batch_size=4, lr=1e-3, max_steps=2, run_dir=run_dir, progress=False, seed=seed))
    return trainer.fit(PromptData(train, val=val, seed=0)), rollout


def test_a_second_run_replays_the_dumped_samples_without_generating(model, tokenizer, addition_rows, tmp_path):
    Counted.calls = 0
    first, _ = run(model, tokenizer, addition_rows, tmp_path / "a", tmp_path / "dump")
    assert Counted.calls == 2 and [h["replay/replayed"] for h in first] == [0.0, 0.0]
    # another seed: generating would draw other samples; replaying gives the dumped ones
    second, rollout = run(model, tokenizer, addition_rows, tmp_path / "b", tmp_path / "dump", seed=1)
    assert Counted.calls == 2 and [h["replay/replayed"] for h in second] == [1.0, 1.0]
    for key in ("critic/score/mean", "actor/pg_loss", "response_length/mean"):
        assert second[0][key] == first[0][key], key
    assert second[1]["critic/score/mean"] == first[1]["critic/score/mean"]
    Counted.calls = 0
    third, _ = run(model, tokenizer, addition_rows, tmp_path / "c", tmp_path / "other", seed=1)  # generates
    assert Counted.calls == 2 and third[0]["actor/pg_loss"] != first[0]["actor/pg_loss"]


def prompts_of(tokenizer, texts):
    ids = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    from tensordict import NonTensorStack, TensorDict
    return TensorDict({K.PROMPT_IDS: torch.tensor([[pad] * (width - len(i)) + i for i in ids]),
                       K.PROMPT_MASK: torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids]),
                       K.PROMPT_TEXT: NonTensorStack(*texts)}, batch_size=[len(texts)])


def replay(model, tokenizer, dump, **kwargs):
    rollout = ReplayRollout(HFRollout(n=2, max_new_tokens=3, **kwargs), dump, {"model": "tiny"})
    rollout.bind(model, tokenizer)
    return rollout


def test_replayed_samples_equal_the_dumped_ones_key_by_key(model, tokenizer, tmp_path):
    batch = prompts_of(tokenizer, ["1+2=", "3+4="])
    dumped = replay(model, tokenizer, tmp_path)(batch)
    torch.manual_seed(123)
    fresh = HFRollout(n=2, max_new_tokens=3)
    fresh.bind(model, tokenizer)
    assert not torch.equal(fresh(batch)[K.RESPONSE_IDS], dumped[K.RESPONSE_IDS])  # generating draws others
    torch.manual_seed(123)
    again = replay(model, tokenizer, tmp_path)(batch)
    assert set(again.keys()) == set(dumped.keys())
    for key in dumped.keys():
        a, b = dumped.get(key), again.get(key)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), key
        else:
            assert list(a) == list(b), key
    assert list(again[K.RESPONSE_TEXT]) == list(dumped[K.RESPONSE_TEXT])


def test_other_prompts_or_settings_are_refused_naming_what_differs(model, tokenizer, tmp_path):
    replay(model, tokenizer, tmp_path)(prompts_of(tokenizer, ["1+2=", "3+4="]))
    with pytest.raises(ValueError, match=r"round 1 \(step 1 without dynamic sampling\) has other prompts"):
        replay(model, tokenizer, tmp_path)(prompts_of(tokenizer, ["5+6=", "3+4="]))
    with pytest.raises(ValueError, match=r"other settings \(temperature: dumped 1.0, now 0.5\)"):
        replay(model, tokenizer, tmp_path, temperature=0.5)
    with pytest.raises(ValueError, match=r"model: dumped 'tiny', now 'other'"):
        ReplayRollout(HFRollout(n=2, max_new_tokens=3), tmp_path, {"model": "other"})
    meta = tmp_path / "1" / "rank0" / "meta.json"
    meta.write_text(meta.read_text().replace('"processes": 1', '"processes": 2'))
    with pytest.raises(ValueError, match=r"round 1 .* was dumped by 2 training process\(es\), this run has 1"):
        replay(model, tokenizer, tmp_path)(prompts_of(tokenizer, ["1+2=", "3+4="]))
    meta.write_text(meta.read_text().replace('"processes": 2', '"processes": 1'))
    # repeat: the nearest dumped round, whatever its prompts
    rollout = ReplayRollout(HFRollout(n=2, max_new_tokens=3), tmp_path, {"model": "tiny"}, action="repeat")
    rollout.bind(model, tokenizer)
    rollout(prompts_of(tokenizer, ["1+2=", "3+4="]))
    out = rollout(prompts_of(tokenizer, ["5+6=", "7+8="]))
    assert rollout.stats == {"replay/replayed": 1.0, "replay/round": 1.0} and list(out[K.PROMPT_TEXT])[0] == "1+2="


def test_a_dump_verl_wrote_is_refused_saying_so(tmp_path):
    step = tmp_path / "exp_proj" / "GBS4_N2_in8_out4" / "1"
    step.mkdir(parents=True)
    (step / "gen_batch.dp").write_bytes(pickle.dumps({"batch": None}))
    (step / "meta.json").write_text('{"global_steps": 1}')
    with pytest.raises(ValueError, match=r"holds rollouts verl dumped .*gen_batch.dp: a pickled verl DataProto"):
        ReplayRollout(HFRollout(n=2, max_new_tokens=3), tmp_path)
