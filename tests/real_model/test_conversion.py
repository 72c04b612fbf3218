"""The real model's folder: ``rlflow get-model smollm2`` prints it, its weights are transformers' own GGUF load, and
a ``.gguf`` path anywhere a model path is taken resolves to it."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rlflow.cli import main as cli_main

# Each kind of tensor the GGUF layout stores differently: the tied embedding, q/k (which llama.cpp permutes for
# its rotary layout and transformers permutes back), v/o, the MLP, and the norms.
TENSORS = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
           "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
           "model.layers.17.self_attn.o_proj.weight", "model.layers.29.mlp.down_proj.weight",
           "model.layers.29.mlp.gate_proj.weight", "model.layers.5.input_layernorm.weight", "model.norm.weight")


def test_get_model_prints_the_folder_alone(model_cache, smollm2_dir, capsys):
    assert cli_main(["get-model", "smollm2"]) == 0
    out = capsys.readouterr()
    assert out.out == f"{smollm2_dir}\n"  # stdout is the folder alone, for $(rlflow get-model smollm2)
    assert "converting" not in out.err  # cached: made once per cache
    names = {p.name for p in smollm2_dir.iterdir()}
    assert names >= {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
                     "generation_config.json"}


def test_folder_holds_transformers_gguf_load(model_cache, smollm2_dir, monkeypatch):
    """Weights, config and tokenizer of the folder are exactly what transformers reads from the GGUF file."""
    import gguf as gguf_package
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlflow.models.gguf import smollm2_gguf

    # transformers' reads below, unchanged but memoized (both are pure reads): it asks for the same tensor-name map
    # 397 times and parses the file's metadata three times: measured 18.6 -> 7.8 CPU s for this test
    for name in ("get_tensor_name_map", "GGUFReader"):
        monkeypatch.setattr(gguf_package, name, functools.lru_cache(maxsize=None)(getattr(gguf_package, name)))
    gguf = smollm2_gguf()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    expected = dict(reference.named_parameters())
    with safe_open(smollm2_dir / "model.safetensors", "pt") as saved:
        assert len(set(saved.keys())) == len(expected) == 272  # 30 layers x 9 + embedding + final norm; head tied
        for name in TENSORS:
            tensor = saved.get_tensor(name)
            assert tensor.dtype == torch.float32
            assert torch.equal(tensor, expected[name].detach()), name
    cfg = reference.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size, cfg.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)
    del reference, expected

    text = "<|im_start|>user\nWhat is 15 + 27? Ünïcödé, emoji 🙂, code `x = f(y)`<|im_end|>\n"
    ours = AutoTokenizer.from_pretrained(smollm2_dir)
    theirs = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert ours(text, add_special_tokens=False)["input_ids"] == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.chat_template == theirs.chat_template and (ours.eos_token_id, ours.pad_token_id) == (2, 2)


def test_a_gguf_path_resolves_to_the_same_folder(model_cache, smollm2_dir, policy, capsys):
    from rlflow import Policy
    from rlflow.models.gguf import smollm2_gguf
    from rlflow.models.hub import locate_model

    gguf = smollm2_gguf()
    located = locate_model(gguf)
    assert (located.folder, located.source) == (smollm2_dir, "gguf")
    assert cli_main(["get-model", str(gguf)]) == 0
    assert capsys.readouterr().out == f"{smollm2_dir}\n"

    loaded = Policy.from_pretrained(str(gguf))  # a .gguf model path, as actor_rollout_ref.model.path may be
    assert Path(loaded.model.name_or_path) == smollm2_dir.resolve()
    name = "model.layers.3.mlp.up_proj.weight"
    assert torch.equal(dict(loaded.model.named_parameters())[name], dict(policy.model.named_parameters())[name])
    assert loaded.tokenizer.padding_side == "left" and loaded.tokenizer.eos_token == "<|im_end|>"


def test_a_gguf_path_that_does_not_exist_is_a_clear_error(tmp_path):
    from rlflow.models.hub import ModelNotFoundError, locate_model

    with pytest.raises(ModelNotFoundError, match="no such folder"):
        locate_model(tmp_path / "missing.gguf")


def test_an_out_folder_that_holds_something_else_is_refused(tmp_path):
    from rlflow.models.gguf import gguf_to_folder

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a converted model folder"):
        gguf_to_folder(gguf, out)
    assert (out / "notes.txt").read_text() == "mine"
