import pandas as pd
import pytest

from rlflow.data import keys as K
from rlflow.data.prompts import DataError, PromptData, collate, load_rows
from rlflow.data.rows import read_parquet


def verl_rows():
    return [
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is 15 + 27?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {"index": 0}},
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 1}},
    ]


def test_reads_verl_parquet(tmp_path, tokenizer):
    path = tmp_path / "train.parquet"
    pd.DataFrame(verl_rows()).to_parquet(path)
    data = PromptData(path, val=path)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert [r["ground_truth"] for r in data.train] == ["42", "2"]
    assert data.train[0]["prompt"] == [{"role": "user", "content": "What is 15 + 27?"}]
    batch = data.collate(data.train, tokenizer)
    assert list(batch[K.DATA_SOURCE]) == ["openai/gsm8k"] * 2
    assert batch[K.EXTRA_INFO][1]["index"] == 1
    assert len(data.val) == 2


def test_a_parquet_file_datasets_wrote_reads_as_datasets_reads_it(tmp_path):
    """rlflow reads parquet with pyarrow (rows.read_parquet); a file that ``datasets`` wrote, its features in the
    file's metadata (images, a class label, nested dicts, a pandas index column), gives the rows
    ``datasets.load_dataset`` gives."""
    datasets = pytest.importorskip("datasets")
    rows = [dict(r, images=[{"bytes": b"\x89PNG" + bytes([i]), "path": None}], label=i) for i, r in enumerate(verl_rows())]
    features = datasets.Dataset.from_list(rows).features.copy()
    features.update(images=datasets.Sequence(datasets.Image()), label=datasets.ClassLabel(names=["a", "b"]))
    datasets.Dataset.from_list(rows, features=features).to_parquet(tmp_path / "hf.parquet")
    pd.DataFrame(verl_rows(), index=[5, 7]).to_parquet(tmp_path / "pandas.parquet")
    for path in (tmp_path / "hf.parquet", tmp_path / "pandas.parquet"):
        expected = datasets.load_dataset("parquet", data_files=str(path), split="train").to_list()
        assert read_parquet(path) == expected
        assert [{k: r[k] for k in ("extra_info", "data_source")} for r in load_rows(path)[0]] == \
            [{k: r[k] for k in ("extra_info", "data_source")} for r in expected]
    assert read_parquet(tmp_path / "hf.parquet")[1]["images"][0]["bytes"] == b"\x89PNG\x01"


def test_seed_example_layout_without_data_source(tmp_path):
    """The seed's minimal example: only prompt and reward_model.ground_truth."""
    path = tmp_path / "train.parquet"
    pd.DataFrame([{"prompt": [{"role": "user", "content": "What is 15 + 27?"}],
                   "reward_model": {"ground_truth": "42"}}]).to_parquet(path)
    (row,) = PromptData(path).train
    assert row["ground_truth"] == "42" and row["data_source"] == "unknown"


def test_left_padding_and_masks(tokenizer):
    rows, _ = load_rows([{"prompt": "1+2="}, {"prompt": "11+22="}])
    batch = collate(rows, tokenizer)
    assert batch[K.PROMPT_MASK].tolist() == [[0, 0, 1, 1, 1, 1], [1] * 6]
    assert batch[K.PROMPT_IDS][0, :2].tolist() == [tokenizer.pad_token_id] * 2
    assert tokenizer.decode(batch[K.PROMPT_IDS][0, 2:]) == "1+2="


def test_errors_name_file_and_row(tmp_path, tokenizer):
    path = tmp_path / "bad.parquet"
    pd.DataFrame([{"prompt": "1+1="}, {"prompt": None}]).to_parquet(path)
    with pytest.raises(DataError, match=r"bad.parquet, row 1: no 'prompt'"):
        PromptData(path)
    with pytest.raises(DataError, match="not found"):
        PromptData(tmp_path / "missing.parquet")
    with pytest.raises(DataError, match=r"row 3: .*question"):
        PromptData([{"question": "x"}] * 3 + [{"q": 1}], prompt_key="question")


def test_truncation_modes(tokenizer):
    rows = [{"prompt": "12345+1=", "ground_truth": "12346"}]
    with pytest.raises(DataError, match=r"row 0: prompt has 8 tokens > max_prompt_length=4"):
        PromptData(rows, max_prompt_length=4).collate(PromptData(rows).train, tokenizer)
    left = PromptData(rows, max_prompt_length=4, truncation="left")
    right = PromptData(rows, max_prompt_length=4, truncation="right")
    assert tokenizer.decode(left.collate(left.train, tokenizer)[K.PROMPT_IDS][0]) == "5+1="
    assert tokenizer.decode(right.collate(right.train, tokenizer)[K.PROMPT_IDS][0]) == "1234"


def test_loader_is_seeded_resumable_and_covers_each_epoch(tokenizer):
    rows = [{"prompt": f"{i}+0=", "ground_truth": str(i)} for i in range(10)]
    data = PromptData(rows, seed=3)
    loader = data.loader(4, tokenizer)
    seen = [list(next(loader)[K.GROUND_TRUTH]) for _ in range(2)]
    assert len(set(seen[0] + seen[1])) == 8  # no repeats within an epoch (2 left over are skipped)
    state = loader.state_dict()
    expected = [list(next(loader)[K.GROUND_TRUTH]) for _ in range(3)]
    resumed = data.loader(4, tokenizer)
    resumed.load_state_dict(state)
    assert [list(next(resumed)[K.GROUND_TRUTH]) for _ in range(3)] == expected
    other_seed = PromptData(rows, seed=4).loader(4, tokenizer)
    assert list(next(other_seed)[K.GROUND_TRUTH]) != seen[0]
    with pytest.raises(DataError, match="batch size 11 > 10"):
        data.loader(11, tokenizer)


def test_chat_template_kwargs_render_batches_and_the_length_filter():
    """PromptData(chat_template_kwargs=...) goes into every apply_chat_template call: batches and the filter."""
    from rlflow.models.tiny import char_tokenizer

    tok = char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}="
                         "{% if enable_thinking is defined and not enable_thinking %}#:{% endif %}{% endif %}")
    rows = [{"prompt": [{"role": "user", "content": "49+49"}], "ground_truth": "98"},
            {"prompt": [{"role": "user", "content": "1+2"}], "ground_truth": "3"}]
    plain = PromptData(rows, max_prompt_length=6, filter_overlong_prompts=True, shuffle=False)
    off = PromptData(rows, max_prompt_length=6, filter_overlong_prompts=True, shuffle=False,
                     chat_template_kwargs={"enable_thinking": False})
    assert plain.filter_overlong(tok) == {"train": 0, "val": 0}  # "49+49=" is 6 tokens
    assert off.filter_overlong(tok) == {"train": 1, "val": 0}  # "49+49=#:" is 8
    assert list(off.collate(off.train, tok)[K.PROMPT_TEXT]) == ["1+2=#:"]
    one = load_rows(rows[1:])[0]
    assert list(collate(one, tok, template_kwargs={"enable_thinking": False})[K.PROMPT_TEXT]) == ["1+2=#:"]


class Reversed:
    """A sampler of the training rows (PromptData(sampler=...)): the last row first; counts its passes."""

    def __init__(self, rows):
        self.n, self.passes = len(rows), 0

    def __iter__(self):
        self.passes += 1
        return iter(range(self.n - 1, -1, -1))


def test_a_users_sampler_orders_the_batches_and_resumes_mid_epoch(tokenizer):
    rows = [{"prompt": f"{i}+{i}=", "ground_truth": str(2 * i)} for i in range(7)]
    data = PromptData(rows, sampler=Reversed, shuffle=True)  # the sampler, not shuffle, decides
    loader = data.loader(3, tokenizer)
    drawn = [next(loader)[K.ROW_INDEX].tolist() for _ in range(3)]
    assert drawn == [[6, 5, 4], [3, 2, 1], [6, 5, 4]]  # 7 rows: the last partial batch is dropped, as verl's loader
    assert loader.sampler.passes == 2 and loader.state_dict() == {"epoch": 1, "index": 3}
    state = data.loader(3, tokenizer)
    state.load_state_dict({"epoch": 1, "index": 3})  # a checkpoint: the rest of the epoch again
    assert next(state)[K.ROW_INDEX].tolist() == [3, 2, 1]
    bad = PromptData(rows, sampler=lambda rows: iter([0, 1, 9]))
    with pytest.raises(DataError, match=r"yielded 9, not a row index in \[0, 7\)"):
        next(bad.loader(3, tokenizer))
