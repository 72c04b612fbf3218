"""The MoE experts vLLM routes each token to (verl's R3 with rollout.name=vllm; rollout/engines/routing.py from_vllm).

vLLM 0.32 returns them only from its Model Runner V2 (CUDA GPUs): the conversion of its output into rlflow's layout
is checked here on arrays shaped as vLLM returns them (its aux-output connector: every fed token, every decoder layer,
uint8), built from what the HF engine recorded; the CPU refusal is checked where there is no GPU; the whole path
(vLLM started with enable_return_routed_experts, its routing against a transformers forward) is the ``gpu`` test at
the end, not run yet: no GPU was available when it was written.
"""

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from rlflow.data import keys as K
from rlflow.models.tiny import char_tokenizer
from rlflow.rollout import SingleTurnRollout
from rlflow.rollout.engines.base import SamplingParams
from rlflow.rollout.engines.hf import HFEngine
from rlflow.rollout.engines.routing import config_moe_layers, from_vllm, moe_layer_indices, moe_routers
from rlflow.rollout.engines.vllm import VLLMEngine, routed_experts_unavailable
from tests.rollout.conftest import requires_vllm


def tiny_moe_with_a_dense_layer(vocab: int, seed: int = 3) -> Qwen3MoeForCausalLM:
    """Three decoder layers, the first dense (``mlp_only_layers``): vLLM's layer axis has 3 rows, rlflow's 2."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, intermediate_size=128, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_only_layers=[0]))
    with torch.no_grad():  # distinct router scores (transformers starts them at 0: ties)
        for router in moe_routers(model):
            router.weight.normal_(0, 0.5)
    return model


def as_vllm_returns(routing: torch.Tensor, moe_layers: list[int], decoder_layers: int) -> np.ndarray:
    """rlflow's ``[tokens, MoE layers, k]`` of a completion as vLLM 0.32 returns it: the last token's row absent (never
    fed), every decoder layer (a dense layer's rows left at 0, as vLLM's capture buffer leaves them), uint8."""
    fed = routing[:-1]
    out = np.zeros((fed.shape[0], decoder_layers, fed.shape[2]), dtype=np.uint8)
    out[:, moe_layers] = fed.numpy().astype(np.uint8)
    return out


def test_the_moe_layers_are_read_from_the_model_class_of_a_config():
    model = tiny_moe_with_a_dense_layer(16)
    assert moe_layer_indices(model) == config_moe_layers(model.config) == [1, 2]
    model.config.decoder_sparse_step = 2  # Qwen3-MoE's other rule: every second layer
    assert config_moe_layers(model.config) == [1]


def test_vllms_routed_experts_become_the_hf_engines_layout():
    """What the HF engine records for completions that ran to max_new_tokens (so the last token is -1 there too),
    written as vLLM returns it, comes back unchanged: the dense layer dropped, int16, -1 on the last token."""
    tok = char_tokenizer()
    model = tiny_moe_with_a_dense_layer(len(tok))
    engine = HFEngine(model, tok)
    prompts = [[5, 9, 7, 11], [8, 6]]
    completions = [c for per_prompt in engine.generate(prompts, SamplingParams(
        n=2, max_new_tokens=5, seed=0, ignore_eos=True, return_routed_experts=True)) for c in per_prompt]
    moe_layers = config_moe_layers(model.config)
    for prompt, c in zip([p for p in prompts for _ in range(2)], completions):
        hf = c.extras["routed_experts"]
        assert hf.shape == (len(prompt) + 5, 2, 2) and (hf[-1] == -1).all() and (hf[:-1] >= 0).all()
        vllm_rows = as_vllm_returns(hf, moe_layers, decoder_layers=3)
        assert vllm_rows.shape == (len(prompt) + 4, 3, 2)
        converted = from_vllm(vllm_rows, len(prompt) + len(c.token_ids), moe_layers)
        assert converted.dtype == torch.int16 and torch.equal(converted, hf)


def test_vllms_layout_is_checked_and_a_full_length_answer_kept():
    rows = np.arange(5 * 3 * 2, dtype=np.uint16).reshape(5, 3, 2) % 4
    assert torch.equal(from_vllm(rows, 5, [1, 2]), torch.from_numpy(rows[:, 1:].astype(np.int16)))  # no row missing
    with pytest.raises(RuntimeError, match="without routed_experts .* enable_return_routed_experts"):
        from_vllm(None, 5, [1, 2])
    with pytest.raises(ValueError, match="3 token rows for a prompt and completion of 5 tokens"):
        from_vllm(rows[:3], 5, [1, 2])
    with pytest.raises(ValueError, match="has 3 layers; the model's MoE layers are"):
        from_vllm(rows, 5, [1, 3])
    with pytest.raises(ValueError, match="integer"):
        from_vllm(rows.astype(np.float32), 5, [1, 2])
    with pytest.raises(ValueError, match="beyond rlflow's int16 layout"):
        from_vllm(rows + 40000, 5, [1, 2])


@requires_vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine vLLM can return them")
def test_without_a_cuda_gpu_the_engine_refuses_at_once_naming_the_hardware():
    """VLLMEngine(return_routed_experts=True) refuses when built, in one line naming what vLLM needs (its GPU Model
    Runner V2) and the engine that records them here; a rollout asking an engine started without the option says
    the same (tests/rollout/test_routed_experts.py pins vLLM's own refusal on CPU)."""
    why = routed_experts_unavailable()
    assert why is not None and "\n" not in why
    with pytest.raises(NotImplementedError, match="GPU Model Runner V2, which needs a CUDA GPU .*no CUDA GPU.*"
                                                  "HFRollout"):
        VLLMEngine(return_routed_experts=True)
    with pytest.raises(NotImplementedError, match="VLLMEngine: vLLM returns routed experts only from its GPU Model "
                                                  "Runner V2"):
        SingleTurnRollout(VLLMEngine(), return_routed_experts=True)


@pytest.mark.gpu
@requires_vllm
def test_vllm_on_a_gpu_returns_the_experts_a_transformers_forward_routes_to(tmp_path):
    """The whole path on a GPU: VLLMRollout(return_routed_experts=True) starts vLLM with enable_return_routed_experts
    and writes prompt_routed_experts / routed_experts as HFRollout does (int16, -1 on padding and on each completion's
    last token); every routed token's experts are the ones one transformers forward over prompt and response picks
    (float32), the dense layer dropped; a second call, whose prompts vLLM finds in its prefix cache, routes the same."""
    from rlflow.rollout import VLLMRollout

    tok = char_tokenizer()
    tiny_moe_with_a_dense_layer(len(tok)).save_pretrained(tmp_path)
    model = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda()
    rollout = VLLMRollout(n=2, max_new_tokens=6, seed=0, dtype="float32", enforce_eager=True, max_model_len=64,
                          gpu_memory_utilization=0.3, free_cache_engine=False, return_routed_experts=True)
    rollout.bind(model, tok)
    assert rollout.engine.returns_routed_experts and rollout.engine.moe_layers == [1, 2]
    # 36 prompt tokens: two full KV blocks of 16, which vLLM caches with their routing
    ids = torch.randint(3, 40, (3, 36), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = tok.pad_token_id, 0
    prompts = TensorDict({K.PROMPT_IDS: ids, K.PROMPT_MASK: mask}, batch_size=[3]).to("cuda")
    batch = rollout(prompts)
    assert batch[K.PROMPT_ROUTED_EXPERTS].dtype == batch[K.ROUTED_EXPERTS].dtype == torch.int16
    assert batch[K.PROMPT_ROUTED_EXPERTS].shape == (6, 36, 2, 2)
    assert batch[K.ROUTED_EXPERTS].shape == (*batch[K.RESPONSE_IDS].shape, 2, 2)

    full_ids = torch.cat([batch[K.PROMPT_IDS], batch[K.RESPONSE_IDS]], 1)
    full_mask = torch.cat([batch[K.PROMPT_MASK], batch[K.RESPONSE_MASK]], 1)
    routing = torch.cat([batch[K.PROMPT_ROUTED_EXPERTS], batch[K.ROUTED_EXPERTS]], 1).long()
    last = full_mask.cumsum(1).argmax(1)  # each row's last real token: never fed back, so never routed
    unfed = torch.zeros_like(full_mask, dtype=torch.bool)
    unfed[torch.arange(len(last)), last] = True
    routed = full_mask.bool() & ~unfed
    assert (routing[~routed] == -1).all() and (routing[routed] >= 0).all()

    outputs = []
    hooks = [router.register_forward_hook(lambda m, a, o: outputs.append(o)) for router in moe_routers(model)]
    with torch.no_grad():
        model(full_ids, attention_mask=full_mask)
    for hook in hooks:
        hook.remove()
    for layer, (logits, _, chosen) in enumerate(outputs):
        chosen = chosen.view(*full_ids.shape, -1).sort(-1).values[routed]
        given = routing[:, :, layer].sort(-1).values[routed]
        differ = (chosen != given).any(-1)
        # vLLM's kernels and transformers' round differently: a token may only differ where its k-th and (k+1)-th
        # router logits are as good as tied
        top = logits.view(*full_ids.shape, -1)[routed].float().topk(3, -1).values
        assert (top[differ, 1] - top[differ, 2] < 1e-4).all(), f"layer {layer}: {int(differ.sum())} tokens differ"
        assert differ.float().mean() < 0.05

    again = rollout(prompts)  # the prompts' blocks are in vLLM's prefix cache now: their routing comes from its store
    assert torch.equal(again[K.PROMPT_ROUTED_EXPERTS], batch[K.PROMPT_ROUTED_EXPERTS])
