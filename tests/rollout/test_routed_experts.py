"""The MoE experts a rollout routes each token to (verl's R3, the rollout's side; rollout/engines/routing.py).

HFRollout(return_routed_experts=True) records them while it generates; the Megatron strategy replays them
(tests/megatron/test_router_replay.py). vLLM's CPU build cannot return them: the last test pins why (vLLM on a GPU:
tests/rollout/test_vllm_routed_experts.py).
"""

import pytest
import torch
from tensordict import TensorDict
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from rlflow.data import keys as K
from rlflow.models.tiny import char_tokenizer, tiny_qwen2
from rlflow.rollout import HFRollout, SingleTurnRollout
from rlflow.rollout.engines.routing import moe_routers
from rlflow.rollout.engines.vllm import VLLMEngine
from rlflow.rollout.wrapper import cat_batches
from tests.rollout.conftest import requires_vllm


def tiny_moe(vocab: int, seed: int = 3) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, intermediate_size=128, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    with torch.no_grad():  # distinct router scores (transformers starts them at 0: ties)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def sampled():
    tok = char_tokenizer()
    model = tiny_moe(len(tok))
    rollout = HFRollout(n=2, max_new_tokens=6, seed=0, return_routed_experts=True)
    rollout.bind(model, tok)
    torch.manual_seed(0)
    ids = torch.randint(3, 40, (3, 6))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = tok.pad_token_id, 0
    return model, rollout, rollout(TensorDict({K.PROMPT_IDS: ids, K.PROMPT_MASK: mask}, batch_size=[3]))


def test_the_recorded_experts_are_the_routers_choices_on_the_whole_sequence(sampled):
    """Prefill and decoding steps together give, for every token fed to the model, the experts each MoE layer chose:
    the same as one forward pass over prompt and response picks (float32); -1 on padding and on the last token of
    the rows that ran to max_new_tokens (never fed back)."""
    model, _, batch = sampled
    ids = torch.cat([batch[K.PROMPT_IDS], batch[K.RESPONSE_IDS]], 1)
    mask = torch.cat([batch[K.PROMPT_MASK], batch[K.RESPONSE_MASK]], 1)
    routing = torch.cat([batch[K.PROMPT_ROUTED_EXPERTS], batch[K.ROUTED_EXPERTS]], 1).long()
    assert routing.shape == (*ids.shape, 2, 2) and batch[K.ROUTED_EXPERTS].dtype == torch.int16
    seen = []
    hooks = [router.register_forward_hook(lambda m, a, o: seen.append(o[-1])) for router in moe_routers(model)]
    with torch.no_grad():
        model(ids, attention_mask=mask)
    for hook in hooks:
        hook.remove()
    full_length = batch[K.RESPONSE_MASK].all(-1)
    unfed = torch.zeros_like(mask, dtype=torch.bool)
    unfed[full_length, -1] = True
    recorded = mask.bool() & ~unfed
    for layer, chosen in enumerate(seen):
        chosen = chosen.view(*ids.shape, -1)
        assert torch.equal(chosen.sort(-1).values[recorded], routing[:, :, layer].sort(-1).values[recorded])
        assert (routing[:, :, layer][~recorded] == -1).all()
    assert full_length.any() and not full_length.all()  # both kinds of row are there


def test_the_list_form_lays_out_the_same_routing(sampled):
    """The engine's list form (Completion.extras["routed_experts"]: real prompt tokens, then the completion's) laid
    out by the rollout equals the tensor form."""
    _, rollout, batch = sampled
    prompts = TensorDict({K.PROMPT_IDS: batch[K.PROMPT_IDS][::2], K.PROMPT_MASK: batch[K.PROMPT_MASK][::2]},
                         batch_size=[3])
    listed = rollout.samples(prompts, rollout.generate([[int(t) for t, m in zip(i, k) if m] for i, k in
                                                        zip(prompts[K.PROMPT_IDS], prompts[K.PROMPT_MASK])]))
    assert torch.equal(listed[K.RESPONSE_IDS], batch[K.RESPONSE_IDS])
    assert torch.equal(listed[K.PROMPT_ROUTED_EXPERTS], batch[K.PROMPT_ROUTED_EXPERTS])
    assert torch.equal(listed[K.ROUTED_EXPERTS], batch[K.ROUTED_EXPERTS])


def test_joined_batches_pad_the_routing_with_no_expert(sampled):
    """Batches joined (rollout wrappers) pad the response's routing with -1, as the rollout does, not 0 (expert 0)."""
    _, _, batch = sampled
    narrow = TensorDict({k: (v[:, :2] if k in (K.RESPONSE_IDS, K.RESPONSE_MASK, K.ROUTED_EXPERTS) else v)
                         for k, v in batch[:1].items() if k in (K.PROMPT_IDS, K.PROMPT_MASK, K.PROMPT_ROUTED_EXPERTS,
                                                                K.RESPONSE_IDS, K.RESPONSE_MASK, K.ROUTED_EXPERTS)},
                        batch_size=[1])
    wide = batch[1:2].select(*narrow.keys())
    joined = cat_batches([narrow, wide], pad_token_id=0)
    assert (joined[K.ROUTED_EXPERTS][0, 2:] == -1).all()
    assert torch.equal(joined[K.ROUTED_EXPERTS][1], wide[K.ROUTED_EXPERTS][0])


def test_a_dense_model_and_an_engine_without_routing_are_refused_by_name():
    """Recording needs MoE layers; vLLM's engine without a CUDA GPU refuses the option when the rollout is built,
    saying why (tests/rollout/test_vllm_routed_experts.py: the engine's side)."""
    tok = char_tokenizer()
    rollout = HFRollout(n=1, max_new_tokens=2, return_routed_experts=True)
    rollout.bind(tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=64), tok)
    prompts = TensorDict({K.PROMPT_IDS: torch.tensor([[5, 6]]), K.PROMPT_MASK: torch.ones(1, 2, dtype=torch.long)},
                         batch_size=[1])
    with pytest.raises(ValueError, match="has no MoE layers"):
        rollout(prompts)
    if not torch.cuda.is_available():
        with pytest.raises(NotImplementedError, match="VLLMEngine: vLLM returns routed experts only from its GPU"):
            SingleTurnRollout(VLLMEngine(), return_routed_experts=True)


@requires_vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU build's limit")
def test_vllms_cpu_build_cannot_return_routed_experts(tmp_path, monkeypatch):
    """Why VLLMEngine refuses: vLLM 0.32 returns routed experts only from its Model Runner V2, which needs Triton;
    the CPU build has no Triton backend, so its engine configuration refuses the option (VLLMEngine therefore refuses
    return_routed_experts without a CUDA GPU). When a vLLM release lifts this, this test fails: then let VLLMEngine
    return them on CPU too (routed_experts_unavailable)."""
    from vllm.engine.arg_utils import EngineArgs

    tiny_moe(64).save_pretrained(tmp_path)
    args = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=64,
                      kv_cache_memory_bytes=2**26, enable_return_routed_experts=True)
    with pytest.raises(Exception, match="AuxOutput Connector requires Model Runner V2"):
        args.create_engine_config()
    import vllm.envs

    # an engine started earlier in this process froze vLLM's environment (vllm.envs.enable_envs_cache): read it
    # afresh for this check, then put the frozen reader back as it was
    frozen = vllm.envs.__getattr__
    vllm.envs.disable_envs_cache()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    try:
        with pytest.raises(Exception, match="Model Runner V2 requires Triton"):
            args.create_engine_config()
    finally:
        vllm.envs.__getattr__ = frozen
