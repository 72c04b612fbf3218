"""Malformed prompt data: each case fails with a message naming the file (or rows), the row and the column,
or, when asked, is dropped and counted."""

import json

import pandas as pd
import pytest

from rlflow.data.prompts import DataError, PromptData

CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def row(i, **extra):
    base = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i}+1"}],
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)}}
    return base | extra


def parquet(tmp_path, rows, name="train.parquet"):
    path = tmp_path / name
    pd.DataFrame(rows).to_parquet(path)
    return path


def test_rows_without_ground_truth_name_file_column_and_first_row(tmp_path):
    rows = [row(0), row(1), row(2, reward_model={"style": "rule"}), row(3, reward_model={"style": "rule"})]
    path = parquet(tmp_path, rows)
    with pytest.raises(DataError, match=r"train\.parquet, row 2: no ground truth \(column 'reward_model\.ground_truth'"
                                        r".*2 of 4 rows lack one"):
        PromptData(path)


def test_rows_without_ground_truth_skipped_and_counted_on_request(tmp_path):
    rows = [row(0), row(1, reward_model={"style": "rule"}), row(2)]
    train, val = parquet(tmp_path, rows), parquet(tmp_path, [row(5), row(6, reward_model=None)], "val.parquet")
    data = PromptData(train, val=val, missing_ground_truth="skip")
    assert [r["ground_truth"] for r in data.train] == ["1", "3"] and data.skipped == {"train": 1, "val": 1}
    allowed = PromptData(train, missing_ground_truth="allow")  # a reward that needs none
    assert [r["ground_truth"] for r in allowed.train] == ["1", None, "3"]


def test_every_row_without_ground_truth(tmp_path):
    path = parquet(tmp_path, [row(0, reward_model={"style": "rule"})])
    with pytest.raises(DataError, match=r"train\.parquet: every row lacks a ground truth"):
        PromptData(path, missing_ground_truth="skip")


def test_validation_file_is_named(tmp_path):
    val = parquet(tmp_path, [row(0), row(1, reward_model={"style": "rule"})], "test.parquet")
    with pytest.raises(DataError, match=r"test\.parquet, row 1: no ground truth"):
        PromptData(parquet(tmp_path, [row(0)]), val=val)


def test_jsonl_row_without_ground_truth(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "1+1", "ground_truth": "2"}) + "\n" + json.dumps({"prompt": "2+2"}) + "\n")
    with pytest.raises(DataError, match=r"t\.jsonl, row 1: no ground truth"):
        PromptData(path)


def test_reward_model_that_is_not_a_mapping(tmp_path):
    with pytest.raises(DataError, match=r"<in-memory rows>, row 1: 'reward_model' must be a mapping"):
        PromptData([row(0), row(1, reward_model="42")])


def test_corrupt_parquet_names_the_file(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match=r"broken\.parquet: cannot be read as parquet"):
        PromptData(path)


def test_malformed_json_names_the_file(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "1+1", "ground_truth": "2"}\n{"prompt": \n')
    with pytest.raises(DataError, match=r"broken\.jsonl: cannot be read as json"):
        PromptData(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl: the file is empty"):
        PromptData(path)


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("prompt\n1+1\n")
    with pytest.raises(DataError, match=r"train\.csv: unsupported file type '\.csv'"):
        PromptData(path)


def test_prompt_column_named_otherwise(tmp_path):
    path = parquet(tmp_path, [{"question": "1+1", "reward_model": {"ground_truth": "2"}}])
    with pytest.raises(DataError, match=r"train\.parquet, row 0: no 'prompt' column"):
        PromptData(path)


def test_chat_message_without_content(tmp_path):
    with pytest.raises(DataError, match=r"row 1: 'prompt' must be a string or chat messages .*'content'"):
        PromptData([row(0), row(1, prompt=[{"role": "user", "text": "1+1"}])])


def test_prompt_of_the_wrong_type():
    with pytest.raises(DataError, match=r"row 0: 'prompt' must be a string or chat messages"):
        PromptData([row(0, prompt=42)])


def test_empty_prompt():
    with pytest.raises(DataError, match=r"<in-memory rows>, row 2: 'prompt' is empty"):
        PromptData([row(0), row(1), row(2, prompt="  ")])


def test_chat_prompts_need_a_chat_template(tmp_path, tokenizer):
    data = PromptData(parquet(tmp_path, [row(0), row(1)]))
    assert not tokenizer.chat_template
    with pytest.raises(DataError, match=r"train\.parquet, row 0: the prompt is chat messages but the tokenizer .* no "
                                        r"chat template.*custom_chat_template"):
        data.loader(2, tokenizer)
    tokenizer.chat_template = CHAT
    assert data.loader(2, tokenizer).batch_size == 2


def test_batch_larger_than_the_data(tokenizer):
    with pytest.raises(DataError, match=r"batch size 5 > 2 training prompts in <in-memory rows>"):
        PromptData([{"prompt": "1+1", "ground_truth": "2"}] * 2).loader(5, tokenizer)
