"""Multi-token prediction (verl's model.mtp; strategies/megatron/mtp.py) on two CPU processes.

One launch of two forked ranks runs ``mtp`` (a tiny MiMo, built in code, as the policy at tensor parallel 2: MTP off,
carried, trained with and without detach_encoder) and ``mtp_verl`` (one GRPO step through the verl entry point with
the MiMo example's MTP keys). The MTP loss is checked against MiMo's MTP layer written out here with transformers'
Qwen2 modules, from the checkpoint's own tensors.
"""

import math

import pytest
import torch

from rlflow.models.mimo import mtp_weights, save_tiny_mimo
from rlflow.models.tiny import tiny_qwen2
from rlflow.strategies.megatron import megatron_available

from . import mtp_scenarios
from .forked import fork_launch
from .worker import char_tokenizer

pytestmark = pytest.mark.skipif(not megatron_available(),
                                reason="megatron-core is not installed (pip install -e '.[megatron]')")
METRIC = "actor/mtp_losses/mtp_1_loss"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny MiMo checkpoint (with the suite's tokenizer and chat template) and prompts in verl's layout."""
    import pandas as pd

    from ..config.conftest import CHAT_TEMPLATE, verl_rows

    out = tmp_path_factory.mktemp("megatron-mtp")
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    save_tiny_mimo(out / "mimo", tiny_qwen2(len(tok), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                            intermediate_size=128, seed=0))
    tok.save_pretrained(out / "mimo")
    (out / "verl").mkdir()
    pd.DataFrame(verl_rows(8, "train", 0)).to_parquet(out / "verl/train.parquet")
    return out


@pytest.fixture(scope="module")
def launch(folder):
    return fork_launch(2, folder, ["mtp", "mtp_verl"])


def mimo_mtp_cross_entropy(folder) -> float:
    """MiMo's MTP layer (vLLM's MiMoMultiTokenPredictorLayer: hidden_layernorm of the body's final states and
    token_layernorm of the next token's embedding, input_proj over [states, embeddings], a Qwen2 decoder layer,
    final_layernorm, lm_head), its mean cross-entropy of each response token from the position two before it."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    from rlflow.models.critic import load_causal_lm

    model = load_causal_lm(str(folder)).eval()
    config, mtp = model.config, {k.removeprefix(mtp_scenarios.PREFIX): v for k, v in mtp_weights(folder).items()}
    config._attn_implementation = "eager"
    layer = Qwen2DecoderLayer(config, layer_idx=0)
    layer.load_state_dict({k: v for k, v in mtp.items() if k in layer.state_dict()})

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * mtp[f"{name}.weight"]

    prompt_ids, prompt_mask, response_ids, response_mask = mtp_scenarios.batch()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in range(prompt_ids.shape[0]):
            ids = torch.cat([prompt_ids[row][prompt_mask[row].bool()], response_ids[row]])[None]
            P, S = int(prompt_mask[row].sum()), ids.shape[1]
            hidden = model.model(ids).last_hidden_state
            following = model.model.embed_tokens(torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1))
            x = torch.cat([rms(hidden, "hidden_layernorm"), rms(following, "token_layernorm")], -1) @ mtp[
                "input_proj.weight"].T
            rotary = model.model.rotary_emb(x, torch.arange(S)[None])
            causal = torch.full((S, S), float("-inf")).triu(1)[None, None]
            x = layer(x, attention_mask=causal, position_embeddings=rotary)
            x = x[0] if isinstance(x, tuple) else x
            log_probs = model.lm_head(rms(x, "final_layernorm")).log_softmax(-1)[0]
            for t in range(response_ids.shape[1]):
                if response_mask[row, t]:
                    total -= float(log_probs[P - 2 + t, response_ids[row, t]])
                    count += 1
    return total / count


def test_log_probs_do_not_change_and_the_mtp_loss_is_mimos_mtp_cross_entropy(launch, folder):
    """The policy's log-probs are the same with the MTP block off, carried or trained; the logged MTP loss (verl's
    metric) is MiMo's MTP cross-entropy over the response tokens, and the actor's loss gets scaling factor x it."""
    runs = launch["mtp"]
    for name in ("carried", "detached", "attached"):
        torch.testing.assert_close(runs[name]["log_probs"], runs["off"]["log_probs"], rtol=0, atol=0)
    expected = mimo_mtp_cross_entropy(folder / "mimo")
    for name, factor in (("detached", 0.1), ("attached", 0.2)):
        logged = runs[name]["stats"][METRIC]
        assert logged == pytest.approx(expected, rel=1e-4)
        assert runs[name]["loss"] == pytest.approx(factor * logged, rel=1e-5)  # all 10 response tokens predicted


def test_only_a_trained_mtp_block_gets_gradients_and_detach_encoder_stops_them_at_its_input(launch):
    """enable_train=False: frozen MTP layers, no gradient. Trained: the MTP loss reaches the MTP layers, and the
    decoder and embedding only without detach_encoder; one AdamW step on it changes every MTP weight."""
    runs = launch["mtp"]
    assert runs["carried"]["mtp_trainable"] is False and runs["carried"]["grads"]["mtp"] is None
    assert runs["detached"]["grads"] | {"mtp": None} == {"mtp": None, "decoder": None, "embedding": None}
    assert runs["detached"]["grads"]["mtp"] > 0 and runs["detached"]["mtp_changed"]
    assert min(runs["attached"]["grads"].values()) > 0 and runs["attached"]["mtp_changed"]


def test_verls_mtp_keys_train_the_mtp_layers_through_main_ppo(launch, folder, tmp_path):
    """The MiMo example's model.mtp keys under model_engine=megatron (rollout hf): one GRPO step logs verl's MTP
    metric, finite, and the checkpoint holds the MTP layers under MiMo's names, changed by the step; exported as a
    Hugging Face folder, they sit beside the body as in MiMo's checkpoints."""
    from rlflow.trainer.hf_export import export_hf

    run = launch["mtp_verl"]
    assert run["code"] == 0
    logged = [row[METRIC] for row in run["metrics"] if METRIC in row]
    assert logged and all(math.isfinite(v) for v in logged)
    start = {k.removeprefix(mtp_scenarios.PREFIX): v for k, v in mtp_weights(folder / "mimo").items()}
    saved = {k.removeprefix(mtp_scenarios.PREFIX): v for k, v in run["mtp_state"].items()}
    assert saved.keys() == start.keys()
    assert not torch.equal(saved["input_proj.weight"], start["input_proj.weight"])
    exported = mtp_weights(export_hf(folder / "verl/run/global_step_1", tmp_path / "hf"))
    assert all(torch.equal(exported[mtp_scenarios.PREFIX + k], v) for k, v in saved.items())
