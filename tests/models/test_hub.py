"""Model paths: local folders always win, hub ids load as in transformers, offline fails at once and clearly."""

import pytest

from rlflow import Critic, Policy
from rlflow.models.hub import ModelNotFoundError, locate_model, looks_like_hub_id
from rlflow.models.tiny import char_tokenizer, tiny_qwen2


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved")
    tok = char_tokenizer()
    tiny_qwen2(len(tok), hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32,
               seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """An empty Hugging Face cache and a hub endpoint that refuses connections (no network needed)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: connection refused
    return tmp_path / "hf-cache"


def test_what_counts_as_a_hub_id():
    assert looks_like_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and looks_like_hub_id("gpt2")
    for local in ("./models/qwen", "../qwen", "/models/qwen", "~/models/qwen", "runs/task/model", "a/../b"):
        assert not looks_like_hub_id(local), local


def test_unreachable_hub_fails_at_once_naming_hf_download(no_hub):
    with pytest.raises(ModelNotFoundError) as e:
        Policy.from_pretrained("Qwen/Qwen2.5-0.5B-Instruct")
    text = str(e.value)
    assert "the hub model 'Qwen/Qwen2.5-0.5B-Instruct' is not in the Hugging Face cache" in text
    assert "http://127.0.0.1:9 did not answer" in text and "`hf download Qwen/Qwen2.5-0.5B-Instruct`" in text
    assert "huggingface-cli" not in text


def test_offline_mode_is_not_probed_and_names_the_variable(no_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE=1 is set"):
        Critic.from_pretrained("Qwen/Qwen2.5-0.5B-Instruct")


def test_a_local_path_is_never_taken_for_a_hub_id(no_hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as e:
        Policy.from_pretrained("./models/qwen")
    assert f"no such folder {tmp_path}/models/qwen" in str(e.value) and "hub" not in str(e.value)
    with pytest.raises(ModelNotFoundError, match="runs/task/model"):
        Policy.from_pretrained("runs/task/model")


def test_a_folder_named_like_a_hub_id_loads_locally(no_hub, saved_model, tmp_path, monkeypatch):
    import shutil

    shutil.copytree(saved_model, tmp_path / "Qwen" / "Qwen2.5-0.5B-Instruct")
    monkeypatch.chdir(tmp_path)
    policy = Policy.from_pretrained("Qwen/Qwen2.5-0.5B-Instruct", temperature=0.7)
    assert policy.temperature == 0.7 and policy.tokenizer.pad_token is not None


def test_offline_loads_a_cached_hub_model(no_hub, saved_model, monkeypatch):
    """The Hugging Face cache layout: models--org--name/{refs/main, snapshots/<revision>/...}."""
    import shutil

    repo = no_hub / "models--rlflow--tiny"
    shutil.copytree(saved_model, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    located = locate_model("rlflow/tiny")
    assert (located.source, located.folder) == ("cache", repo / "snapshots" / "abc123")
    assert Policy.from_pretrained("rlflow/tiny").model.config.hidden_size == 16
