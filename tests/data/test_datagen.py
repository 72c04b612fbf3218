"""PromptData(datagen=...) (verl's data.datagen): rows generated after each step join the training rows at the
next epoch's start, pass the checks loaded rows pass (drops counted), and come back from a checkpoint."""

import json

import pytest
import torch

from rlflow.data import keys as K
from rlflow.data.datagen import DataGenerator
from rlflow.data.prompts import DataError, PromptData
from rlflow.models.tiny import char_tokenizer
from tests.trainer.helpers import comparable, make_trainer

ROWS = [{"prompt": f"{a}+{b}=", "ground_truth": str(a + b), "data_source": "rlflow/addition"}
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (2, 3), (4, 5), (6, 7)]]


class Doubles(DataGenerator):
    """One new row per call: the sum of the first row's operands doubled, numbered in extra_info."""

    def __init__(self, config=None, bad=None):
        super().__init__(config)
        self.calls, self.bad = [], bad

    def generate(self, rows):
        self.calls.append(len(rows))
        k = len(self.calls)
        return [{"prompt": f"{k}+{k}=", "reward_model": {"ground_truth": str(2 * k)}, "data_source": "rlflow/addition",
                 "extra_info": {"generated": k}}] + (self.bad or [])

    def state_dict(self):
        return {"calls": list(self.calls)}

    def load_state_dict(self, state):
        self.calls = list(state["calls"])


def texts(batch):
    return list(batch[K.PROMPT_TEXT])


def test_generated_rows_join_at_the_next_epoch_and_the_current_order_is_unchanged():
    tok, gen = char_tokenizer(), Doubles()
    plain, data = PromptData(ROWS, seed=3).loader(4, tok), PromptData(ROWS, seed=3, datagen=gen)
    loader = data.loader(4, tok)
    for _ in range(2):  # epoch 0: two batches, each followed by a generation
        batch = next(loader)
        assert texts(batch) == texts(next(plain))  # the epoch's order is the one without generation
        data.batch_trained(batch)
    assert gen.calls == [8, 8] and len(data.train) == 8 and [r["prompt"] for r in data.generated] == ["1+1=", "2+2="]
    epoch1 = [texts(next(loader)) for _ in range(2)]  # epoch 1 over 10 rows: 2 batches of 4 (the rest skipped)
    assert len(data.train) == 10 and loader.steps_per_epoch == 2 and data.train[8]["index"] == 8
    assert epoch1 == [[data.train[i]["prompt"] for i in order]
                      for order in (torch.randperm(10, generator=torch.Generator().manual_seed(4)).tolist()[:4],
                                    torch.randperm(10, generator=torch.Generator().manual_seed(4)).tolist()[4:8])]


def test_generated_rows_pass_the_checks_of_loaded_rows_and_drops_are_counted():
    tok = char_tokenizer()
    no_truth = {"prompt": "3+3=", "data_source": "rlflow/addition"}
    too_long = {"prompt": "1234567+1234567=", "ground_truth": "2469134", "data_source": "rlflow/addition"}
    data = PromptData(ROWS, missing_ground_truth="skip", max_prompt_length=8, filter_overlong_prompts=True,
                      datagen=Doubles(bad=[no_truth, too_long]))
    data.batch_trained(next(data.loader(4, tok)))
    assert [r["prompt"] for r in data.generated] == ["1+1="]
    assert data.generated_dropped == {"missing_ground_truth": 1, "bad_images": 0, "overlong": 1}
    strict = PromptData(ROWS, datagen=Doubles(bad=[no_truth]))
    with pytest.raises(DataError, match=r"Doubles.generate, row 9: no ground truth"):
        strict.batch_trained(next(strict.loader(4, tok)))
    broken = PromptData(ROWS, datagen=Doubles(bad=[{"question": "1+1"}]))
    with pytest.raises(DataError, match=r"Doubles.generate, row 9: no 'prompt' column"):
        broken.batch_trained(next(broken.loader(4, tok)))
    with pytest.raises(ValueError, match="with a sampler"):
        PromptData(ROWS, datagen=Doubles(), sampler=lambda rows: range(len(rows)))


def test_a_resumed_run_trains_on_the_generated_rows_of_the_uninterrupted_one(model, tokenizer, addition_rows, tmp_path):
    """8 prompts, 4 per step: an epoch is 2 steps; each step adds a row. A run stopped after step 3's checkpoint
    and resumed logs what the uninterrupted run logs, and ends with the same training rows."""
    rows = (addition_rows[0][:8], addition_rows[1][:4])

    def run(folder, stop=None):
        trainer, _ = make_trainer(model, tokenizer, rows, tmp_path / folder, max_steps=6, save_every=1,
                                  resume="auto", loggers=("jsonl",), batch_size=4)
        data = PromptData(rows[0], val=rows[1], seed=0, datagen=Doubles())
        if stop:
            trainer.fabric.call = stopping(trainer.fabric.call, stop)
        try:
            trainer.fit(data)
        except StopRun:
            pass
        return data, [comparable(json.loads(x)) for x in (tmp_path / folder / "metrics.jsonl").read_text().splitlines()]

    whole, expected = run("whole")
    run("resumed", stop=3)
    resumed, logged = run("resumed")
    assert [r["step"] for r in logged] == list(range(1, 7)) and logged == expected
    assert len(whole.train) == 8 + 4 and resumed.train == whole.train and resumed.generated == whole.generated


class StopRun(Exception):
    pass


def stopping(call, step):
    def wrapped(hook, *args, **kwargs):
        out = call(hook, *args, **kwargs)
        if hook == "on_step_end" and kwargs.get("step") == step:
            raise StopRun
        return out
    return wrapped
