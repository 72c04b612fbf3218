"""Liger kernels (verl's model.use_liger): liger-kernel patches a loaded transformers model in place; its Triton
kernels run on CUDA GPUs only, so the patched forward is checked on a GPU. Each check runs in a child process,
because liger-kernel also replaces the model type's transformers classes for the rest of the process."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("liger_kernel", reason="liger-kernel is not installed (pip install -e \".[liger]\")")


def run(code: str, tmp_path) -> str:
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(code))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


SAVE = """
    from rlflow.models.tiny import char_tokenizer, tiny_qwen2
    tok = char_tokenizer(); tok.chat_template = "{{% for m in messages %}}{{{{ m['content'] }}}}{{% endfor %}}"
    tiny_qwen2(len(tok), seed=0).save_pretrained("{path}"); tok.save_pretrained("{path}")
"""


@pytest.mark.parametrize("cls", ["Policy", "Critic"])
def test_use_liger_patches_the_model_in_place(tmp_path, cls):
    """One child process per class: liger-kernel's class patch would reach a second model built after the first."""
    out = run(SAVE.format(path=tmp_path / "m") + f"""
    from rlflow.models.critic import Critic
    from rlflow.models.policy import Policy
    for use_liger in (False, True):
        built = {cls}.from_pretrained("{tmp_path / 'm'}", use_liger=use_liger)
        body = next(m for m in built.module.modules() if type(m).__name__ == "Qwen2Model")
        layer = body.layers[0]
        print(body.norm._get_name(), layer.input_layernorm._get_name(), layer.mlp.forward.__qualname__)
    """, tmp_path)
    assert out.strip().splitlines() == ["Qwen2RMSNorm Qwen2RMSNorm Qwen2MLP.forward",
                                        "LigerRMSNorm LigerRMSNorm LigerSwiGLUMLP.forward"]


def test_a_model_type_without_liger_kernels_is_refused_naming_the_ones_it_has():
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlflow.models.liger import apply_liger

    with pytest.raises(ValueError, match=r"use_liger=True: liger-kernel has no kernels for model type 'gpt2'; it has .*qwen2"):
        apply_liger(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)))


LOG_PROBS = """
    import torch
    from tensordict import TensorDict
    from rlflow.data import keys as K
    from rlflow.models.policy import Policy
    ids = torch.randint(3, 40, (2, 6), device="{device}")
    ones = torch.ones(2, 3, dtype=torch.long, device="{device}")
    batch = TensorDict({{K.PROMPT_IDS: ids[:, :3], K.PROMPT_MASK: ones, K.RESPONSE_IDS: ids[:, 3:], K.RESPONSE_MASK: ones}},
                       batch_size=[2])
    out = []
    for use_liger in (False, {liger}):
        policy = Policy.from_pretrained("{path}", use_liger=use_liger)
        policy.model.to("{device}")
        with torch.no_grad():
            out.append(policy.log_probs(batch)[0])
    print(policy.model.model.norm._get_name(), (out[1] - out[0]).abs().max().item())
"""


@pytest.mark.gpu
def test_liger_log_probs_equal_the_plain_models_on_cuda(tmp_path):
    out = run(SAVE.format(path=tmp_path / "m") + LOG_PROBS.format(device="cuda", liger=True, path=tmp_path / "m"),
              tmp_path)
    name, difference = out.strip().splitlines()[-1].split()
    assert name == "LigerRMSNorm" and float(difference) < 1e-4
