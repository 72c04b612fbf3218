"""Broken model folders and tokenizers: each fails before training, with a message naming the folder or file."""

import json
import shutil

import pytest

from rlflow import Policy
from rlflow.models.checks import ModelFolderError, check_model_folder, check_tokenizer
from rlflow.models.tiny import char_tokenizer, tiny_qwen2


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("good-model")
    tok = char_tokenizer()
    tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
               seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def folder(good_folder, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(good_folder, copy)
    return copy


def test_a_good_folder_loads(folder):
    assert check_model_folder(folder) == folder
    assert Policy.from_pretrained(folder).tokenizer.pad_token == "<pad>"


def test_folder_that_does_not_exist(tmp_path):
    with pytest.raises(ModelFolderError, match=r"model folder .*nowhere does not exist"):
        check_model_folder(tmp_path / "nowhere")


def test_a_file_instead_of_a_folder(folder):
    with pytest.raises(ModelFolderError, match=r"config\.json is a file; a model is a folder"):
        check_model_folder(folder / "config.json")


def test_no_config(folder):
    (folder / "config.json").unlink()
    with pytest.raises(ModelFolderError, match=r"model: no config\.json, so not a Hugging Face model folder .*"
                                               r"model\.safetensors"):
        Policy.from_pretrained(folder)


def test_config_that_is_not_json(folder):
    (folder / "config.json").write_text("{'model_type': qwen2")
    with pytest.raises(ModelFolderError, match=r"config\.json: not valid JSON"):
        Policy.from_pretrained(folder)


def test_config_without_model_type(folder):
    config = json.loads((folder / "config.json").read_text())
    del config["model_type"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match=r"config\.json: no 'model_type'"):
        Policy.from_pretrained(folder)


def test_no_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelFolderError, match=r"model: no weights \(model\.safetensors, pytorch_model\.bin"):
        Policy.from_pretrained(folder)


def test_truncated_weights(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ModelFolderError, match=r"model\.safetensors: truncated"):
        Policy.from_pretrained(folder)


def test_weights_that_are_not_safetensors(folder):
    (folder / "model.safetensors").write_bytes(b"\x00\x01")
    with pytest.raises(ModelFolderError, match=r"model\.safetensors: 2 bytes, not a safetensors file"):
        Policy.from_pretrained(folder)


def test_index_naming_a_missing_shard(folder):
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors",
                                            "model.norm.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFolderError, match=r"index\.json names shard\(s\) not in the folder: "
                                               r"\['model-00002-of-00002\.safetensors'\]"):
        Policy.from_pretrained(folder)


def test_no_tokenizer_files(folder):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(ModelFolderError, match=r"model: no tokenizer files .*tokenizer\.save_pretrained"):
        Policy.from_pretrained(folder)


def test_tokenizer_without_pad_or_eos_token(model):
    tok = char_tokenizer()
    tok.pad_token, tok.eos_token = None, None
    with pytest.raises(ModelFolderError, match=r"no pad token and no eos token, so prompts cannot be padded"):
        Policy(model, tok)


def test_tokenizer_without_pad_token_pads_with_eos(model):
    tok = char_tokenizer()
    tok.pad_token = None
    assert Policy(model, tok).tokenizer.pad_token == "<eos>"


def test_pad_token_outside_the_embedding_table(folder):
    # without its pad token, Qwen2's tokenizer class pads with <|endoftext|>, an added id this model lacks
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match=r"model does not fit the model: pad_token id 47, but the embedding "
                                               r"table has 47 rows"):
        Policy.from_pretrained(folder)


def test_tokenizer_of_another_model(tokenizer):
    small = tiny_qwen2(20, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0)
    with pytest.raises(ModelFolderError, match=r"does not fit the model: vocabulary size 47.*embedding table has 20 rows"):
        Policy(small, tokenizer)
    with pytest.raises(ModelFolderError, match=r"tokenizer my-tok does not fit"):
        check_tokenizer(tokenizer, small, source="my-tok")
