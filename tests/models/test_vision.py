"""Vision-language policies: the policy recomputes exactly the sampler's log-probs (same images, same 3-D
rotary positions), padded, packed and in token-budget micro-batches; Qwen2-VL and Qwen2.5-VL load
through the Auto classes."""

import pytest
import torch

from rlflow.data import keys as K
from rlflow.models import vision
from rlflow.models.logprobs import TokenLogProbs
from rlflow.models.policy import Policy
from rlflow.models.tiny_vlm import save_model_folder
from rlflow.rollout.hf import HFRollout
from rlflow.trainer.batching import micro_batches
from tests.vlm import batch, masked_max_diff, rows, tiny_vlm


@pytest.fixture(scope="module")
def sampled():
    """A tiny Qwen2.5-VL, its processor, and 3 samples for each of 4 prompts (1, 2, 0 and 1 images)."""
    model, processor = tiny_vlm("qwen2_5_vl")
    rollout = HFRollout(n=3, temperature=0.7, max_new_tokens=6, seed=1)
    rollout.bind(model, processor.tokenizer)
    return model, processor, rollout(batch(processor))


@pytest.mark.parametrize("remove_padding", [False, True])
def test_recomputed_log_probs_equal_the_samplers(sampled, remove_padding):
    model, processor, out = sampled
    assert [len(r) for r in out[K.MULTI_MODAL_INPUTS]][::3] == [2, 2, 0, 2]  # pixel_values + grid, or nothing
    policy = Policy(model, processor=processor, temperature=0.7, remove_padding=remove_padding)
    log_probs, _ = policy.log_probs(out)
    assert masked_max_diff(log_probs, out[K.ROLLOUT_LOG_PROBS], out[K.RESPONSE_MASK]) < 1e-5


def test_the_positions_are_the_models_3d_rotary_positions(sampled):
    """Scoring with plain 1-D positions gives other log-probs: the test above would catch wrong positions."""
    model, processor, out = sampled
    ids = torch.cat([out[K.PROMPT_IDS], out[K.RESPONSE_IDS]], 1)
    mask = torch.cat([out[K.PROMPT_MASK], torch.ones_like(out[K.RESPONSE_IDS])], 1)
    inputs = vision.concat_inputs(list(out[K.MULTI_MODAL_INPUTS]))
    images = vision.image_token_mask(model, out[K.PROMPT_IDS], out[K.RESPONSE_IDS].shape[1])
    rope = vision.rope_position_ids(model, ids, mask, inputs, images)
    assert rope.shape == (3, *ids.shape)
    flat = (mask.cumsum(-1) - 1).clamp_min(0)
    assert not torch.equal(rope[1], flat)  # image tokens sit at their grid's rows and columns
    hidden = vision.multimodal_hidden_states(model, ids, mask, flat[None].expand(3, -1, -1), inputs, images)
    P = out[K.PROMPT_IDS].shape[1]
    logits = model.lm_head(hidden[:, P - 1 : -1]).float() / 0.7
    wrong = torch.log_softmax(logits, -1).gather(-1, out[K.RESPONSE_IDS][..., None]).squeeze(-1)
    assert masked_max_diff(wrong, out[K.ROLLOUT_LOG_PROBS], out[K.RESPONSE_MASK]) > 1e-3


def test_token_budget_micro_batches_keep_each_rows_images(sampled):
    model, processor, out = sampled
    policy = Policy(model, processor=processor, temperature=0.7, remove_padding=True)
    parts = micro_batches(out, None, max_tokens=150)
    assert len(parts) > 2
    for part in parts:
        log_probs, _ = policy.log_probs(part)
        assert masked_max_diff(log_probs, part[K.ROLLOUT_LOG_PROBS], part[K.RESPONSE_MASK]) < 1e-5


def test_a_sampled_image_pad_token_is_text(tmp_path):
    """A response may contain the image-pad id (the sampler may draw it): generation embedded it as a token,
    so scoring must too, not look for an image for it."""
    model, processor = tiny_vlm("qwen2_5_vl", seed=3)
    pad = model.config.image_token_id
    with torch.no_grad():  # tied embeddings: a large row makes the model emit it (the prompt's pads get images)
        model.get_input_embeddings().weight[pad] *= 40
    rollout = HFRollout(n=2, temperature=1.0, max_new_tokens=5, seed=0)
    rollout.bind(model, processor.tokenizer)
    out = rollout(batch(processor))
    assert (out[K.RESPONSE_IDS] == pad).any()
    for remove_padding in (False, True):
        log_probs, _ = Policy(model, processor=processor, remove_padding=remove_padding).log_probs(out)
        assert masked_max_diff(log_probs, out[K.ROLLOUT_LOG_PROBS], out[K.RESPONSE_MASK]) < 1e-5


def test_qwen2_vl_loads_through_the_auto_classes_and_scores_like_it_samples(tmp_path):
    model, processor = tiny_vlm("qwen2_vl")
    folder = save_model_folder(model, processor, tmp_path / "tiny-qwen2-vl")
    policy = Policy.from_pretrained(folder, min_pixels=56 * 56, max_pixels=84 * 84, temperature=0.8)
    assert type(policy.model).__name__ == "Qwen2VLForConditionalGeneration"
    assert type(policy.processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"  # no torchvision
    assert policy.processor.image_processor.size["longest_edge"] == 84 * 84
    assert policy.tokenizer.padding_side == "left"
    rollout = HFRollout(n=2, temperature=0.8, max_new_tokens=4, seed=2)
    rollout.bind(policy.model, policy.tokenizer)
    out = rollout(batch(policy.processor))
    assert max(g[:, 1:].prod(-1).max() for g in (r["image_grid_thw"] for r in out[K.MULTI_MODAL_INPUTS] if r)) <= 36
    log_probs, _ = policy.log_probs(out)
    assert masked_max_diff(log_probs, out[K.ROLLOUT_LOG_PROBS], out[K.RESPONSE_MASK]) < 1e-5
    ref_log_probs, _ = policy.reference().log_probs(out)
    torch.testing.assert_close(ref_log_probs, log_probs)


def test_image_tokens_without_their_images_fail_clearly(sampled):
    model, _, out = sampled
    scorer = TokenLogProbs(model)
    one_lost = [{}] + list(out[K.MULTI_MODAL_INPUTS])[1:]
    with pytest.raises(ValueError, match="image features for .* image tokens"):
        scorer(out[K.PROMPT_IDS], out[K.PROMPT_MASK], out[K.RESPONSE_IDS], multi_modal=one_lost)
    with pytest.raises(ValueError, match="0 image features for"):
        scorer(out[K.PROMPT_IDS], out[K.PROMPT_MASK], out[K.RESPONSE_IDS])


def test_sequence_parallelism_is_refused_for_vision_language_models(sampled):
    from rlflow.models.logprobs import enable_sequence_parallel

    with pytest.raises(ValueError, match="not supported for vision-language models"):
        enable_sequence_parallel(sampled[0], group=object(), remove_padding=True)  # refused before the group is used


def test_batches_joined_across_rounds_keep_each_rows_images(sampled):
    """DAPO's dynamic sampling joins rollouts of several rounds (cat_batches re-pads prompts of other widths)."""
    from rlflow.rollout.wrapper import cat_batches

    model, processor, _ = sampled
    rollout = HFRollout(n=2, temperature=1.0, max_new_tokens=4, seed=0)
    rollout.bind(model, processor.tokenizer)
    rounds = [rollout(batch(processor, rows()[:1])), rollout(batch(processor, rows()[1:]))]  # prompt widths differ
    assert rounds[0][K.PROMPT_IDS].shape[1] != rounds[1][K.PROMPT_IDS].shape[1]
    joined = cat_batches(rounds, processor.tokenizer.pad_token_id)
    assert [bool(r) for r in joined[K.MULTI_MODAL_INPUTS]] == [True] * 4 + [False] * 2 + [True] * 2
    log_probs, _ = Policy(model, processor=processor, remove_padding=True).log_probs(joined)
    assert masked_max_diff(log_probs, joined[K.ROLLOUT_LOG_PROBS], joined[K.RESPONSE_MASK]) < 1e-5


def test_a_lora_policy_scores_like_it_samples_and_its_reference_is_the_adapter_off():
    """Under PEFT's wrapper the model's own forward decides the 3-D positions' inputs (mm_token_type_ids)."""
    from peft import LoraConfig

    model, processor = tiny_vlm("qwen2_5_vl", seed=4)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    policy = Policy(model, processor=processor, lora=lora, remove_padding=True)
    rollout = HFRollout(n=2, temperature=1.0, max_new_tokens=4, seed=0)
    rollout.bind(policy.model, processor.tokenizer)
    out = rollout(batch(processor))
    log_probs, _ = policy.log_probs(out)
    assert masked_max_diff(log_probs, out[K.ROLLOUT_LOG_PROBS], out[K.RESPONSE_MASK]) < 1e-5
    plain, _ = tiny_vlm("qwen2_5_vl", seed=4)
    plain.load_state_dict(base)
    expected, _ = Policy(plain, processor=processor, remove_padding=True).log_probs(out)
    reference, _ = policy.reference().log_probs(out)
    assert masked_max_diff(reference, expected, out[K.RESPONSE_MASK]) < 1e-5
    assert masked_max_diff(log_probs, expected, out[K.RESPONSE_MASK]) > 1e-3  # the adapter does change them
