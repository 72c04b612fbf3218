"""verl's multimodal prompt layout: an images column (bytes or paths), <image> placeholders, per-row vision
tensors in the batch, and bad images named by file, row and image (or skipped and counted)."""

import pandas as pd
import pytest
import torch

from rlflow.data import keys as K
from rlflow.data.multimodal import messages_with_images
from rlflow.data.prompts import DataError, PromptData
from rlflow.models.tiny_vlm import tiny_processor
from tests.vlm import png
from tests.vlm import rows as mixed_rows


@pytest.fixture(scope="module")
def processor():
    return tiny_processor(min_pixels=56 * 56, max_pixels=112 * 112)


def verl_row(i, images, content="<image>how many red squares?"):
    return {"data_source": "geo3k", "prompt": [{"role": "user", "content": content}], "pictures": images,
            "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}}


def test_placeholders_become_content_parts():
    assert messages_with_images("<image>a<image> b") == [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": " b"}]}]


def test_parquet_with_bytes_and_paths_gives_per_row_vision_inputs(processor, tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "wide.png").write_bytes(png(112, 56))
    rows = [verl_row(0, [{"bytes": png(56, 56), "path": None}]),
            verl_row(1, [{"bytes": None, "path": "imgs/wide.png"}, {"bytes": png(84, 84)}], "<image> vs <image>?"),
            verl_row(3, None, "no picture")]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame([verl_row(2, ["imgs/wide.png"])]).to_json(tmp_path / "more.jsonl", orient="records", lines=True)
    files = [tmp_path / "train.parquet", tmp_path / "more.jsonl"]  # paths relative to the data file's folder
    data = PromptData(files, processor=processor, image_key="pictures", shuffle=False)
    data.train = [data.train[i] for i in (0, 1, 3, 2)]
    batch = data.collate(data.train, processor.tokenizer)
    inputs = list(batch[K.MULTI_MODAL_INPUTS])
    grids = [r["image_grid_thw"].tolist() if r else [] for r in inputs]
    assert grids == [[[1, 4, 4]], [[1, 4, 8], [1, 6, 6]], [[1, 4, 8]], []]  # 14-pixel patches per image
    assert [r["pixel_values"].shape[0] for r in inputs[:3]] == [16, 32 + 36, 32]
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    image_tokens = (batch[K.PROMPT_IDS] == pad).sum(-1).tolist()
    assert image_tokens == [4, 8 + 9, 8, 0]  # one token per 2 x 2 patches, expanded in the prompt ids
    assert [len(d.get("image", [])) for d in batch[K.MULTI_MODAL_DATA]] == [1, 2, 1, 0]
    assert "<|vision_start|><|image_pad|><|vision_end|> vs" in batch[K.PROMPT_TEXT][1]
    assert batch[K.PROMPT_MASK].sum(-1).tolist() == (batch[K.PROMPT_IDS] != 0).sum(-1).tolist()  # left-padded
    # rows travel with their tensors through the ops the Trainer uses
    picked = batch.repeat_interleave(2, dim=0)[torch.tensor([7, 2])]
    assert [r["image_grid_thw"].tolist() if r else [] for r in picked[K.MULTI_MODAL_INPUTS]] == [[], grids[1]]


def test_bad_images_name_the_file_row_and_image_or_are_skipped_and_counted(processor, tmp_path):
    good = {"bytes": png(56, 56)}
    cases = {"cannot decode image": [good, {"bytes": png(56, 56)[:40]}],  # truncated PNG
             "image file not found: nowhere.png": [good, {"path": "nowhere.png"}]}
    for message, images in cases.items():
        rows = [verl_row(0, [good]), verl_row(1, images, "<image><image>?"), verl_row(2, [good])]
        pd.DataFrame(rows).to_parquet(tmp_path / "bad.parquet")
        with pytest.raises(DataError, match=rf"bad.parquet, row 1, image 1: {message}"):
            PromptData(tmp_path / "bad.parquet", processor=processor, image_key="pictures")
        data = PromptData(tmp_path / "bad.parquet", processor=processor, image_key="pictures", skip_bad_images=True)
        assert [r["index"] for r in data.train] == [0, 2] and data.skipped_images == {"train": 1, "val": 0}


def test_placeholders_must_match_the_images(processor):
    rows = [{"prompt": "<image><image>two?", "images": [{"bytes": png(56, 56)}], "ground_truth": "1"}]
    with pytest.raises(DataError, match=r"row 0: 1 image\(s\) but 2 '<image>' placeholder"):
        PromptData(rows, processor=processor)


def test_images_need_a_processor_and_long_prompts_are_not_cut(processor):
    rows = [{"prompt": "<image>?", "images": [{"bytes": png(112, 112)}], "ground_truth": "1"}]
    with pytest.raises(DataError, match="no processor was given"):
        PromptData(rows)
    data = PromptData(rows, processor=processor, max_prompt_length=10, truncation="left")
    with pytest.raises(DataError, match=r"row 0: prompt has \d+ tokens \(image tokens included\) > max_prompt_length"):
        data.collate(data.train, processor.tokenizer)
    filtered = PromptData(rows * 2, val=rows, processor=processor, max_prompt_length=10, filter_overlong_prompts=True)
    with pytest.raises(DataError, match="every prompt is longer"):
        filtered.filter_overlong(processor.tokenizer)


def test_a_vision_language_prompt_is_rendered_with_the_processors_chat_template():
    """The template may live only on the processor (a folder's chat_template.jinja): that is enough; with none
    at all, chat prompts are refused naming the row."""
    processor = tiny_processor()
    processor.tokenizer.chat_template = None
    data = PromptData(mixed_rows(), processor=processor, shuffle=False)
    assert data.filter_overlong(processor.tokenizer) == {"train": 0, "val": 0}
    raw = list(data.collate(data.train, processor.tokenizer)[K.RAW_PROMPT])  # as given: for reward models
    assert raw[0] == "<image>how many red squares?" and raw[1] == [{"role": "user", "content": "a <image> b <image> c?"}]
    processor.chat_template = None
    with pytest.raises(DataError, match="row 1: the prompt is chat messages but .* has no chat template"):
        PromptData(mixed_rows(), processor=processor, shuffle=False).filter_overlong(processor.tokenizer)


def test_patch_size_dims_follow_qwen_vl_utils_smart_resize():
    """verl's data.image_patch_size: images go to multiples of 2 x patch pixels within [4, 16384] merged tokens
    (expected values worked out by hand)."""
    from rlflow.data.multimodal import patch_size_dims

    assert patch_size_dims(100, 100, 14) == (112, 112)  # round(100 / 28) = 4
    assert patch_size_dims(100, 100, 16) == (96, 96)  # round(100 / 32) = 3
    assert patch_size_dims(10, 10, 14) == (56, 56)  # below 4 x 28 x 28 pixels: scaled up to it
    assert patch_size_dims(10000, 5000, 14) == (5068, 2520)  # above 16384 x 28 x 28: scaled down, floored
    with pytest.raises(ValueError, match="aspect ratio"):
        patch_size_dims(10, 2010, 14)


def test_image_patch_size_resizes_before_the_processor(processor):
    """PromptData(image_patch_size=16) pre-resizes a 100 x 100 image to 96 x 96 (multiples of 32), which the
    14-pixel processor then sizes to 84 x 84 (6 x 6 patches); with 14, or without, the processor's 112 x 112."""
    rows = [verl_row(0, [{"bytes": png(100, 100)}])]

    def grid(**kw):
        data = PromptData(rows, processor=processor, image_key="pictures", **kw)
        return data.collate(data.train, processor.tokenizer)[K.MULTI_MODAL_INPUTS][0]["image_grid_thw"].tolist()

    assert grid() == grid(image_patch_size=14) == [[1, 8, 8]]
    assert grid(image_patch_size=16) == [[1, 6, 6]]


def test_chat_template_kwargs_reach_the_processors_template():
    processor = tiny_processor()
    processor.chat_template = processor.chat_template.replace(
        "<|im_start|>assistant\n", "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
        "<think></think>{% endif %}")
    rows = [verl_row(0, [{"bytes": png(56, 56)}])]
    plain = PromptData(rows, processor=processor, image_key="pictures")
    off = PromptData(rows, processor=processor, image_key="pictures", chat_template_kwargs={"enable_thinking": False})
    assert not plain.collate(plain.train, processor.tokenizer)[K.PROMPT_TEXT][0].endswith("<think></think>")
    assert off.collate(off.train, processor.tokenizer)[K.PROMPT_TEXT][0].endswith("<think></think>")
    assert off.prompt_length(off.train[0], processor.tokenizer) > plain.prompt_length(plain.train[0], processor.tokenizer)
