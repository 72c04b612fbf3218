"""ModelReward: a sequence-classification reward model scores prompt + response at the last token,
micro-batched without gradients, re-encoding with its own tokenizer and chat template when asked."""

import string

import pytest
import torch

from rlflow.data import keys as K
from rlflow.data.prompts import collate, load_rows
from rlflow.models.tiny import DEFAULT_ALPHABET, char_tokenizer, tiny_qwen2_reward_model
from rlflow.rewards import CombinedReward, FunctionReward, ModelReward
from rlflow.rollout.hf import HFRollout

TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}#{% endfor %}"


@pytest.fixture(scope="module")
def samples():
    """A real rollout of a tiny policy over chat prompts (sampled, so lengths differ)."""
    from rlflow.models.tiny import tiny_qwen2

    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    policy = tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                        seed=0)
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "ground_truth": str(a + b)}
            for a, b in [(1, 2), (13, 4), (7, 75)]]
    rollout = HFRollout(n=2, max_new_tokens=5)
    rollout.bind(policy, tok)
    torch.manual_seed(0)
    return rollout(collate(load_rows(rows)[0], tok)), tok


def rm(vocab, seed=0):
    return tiny_qwen2_reward_model(vocab, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                   intermediate_size=64, seed=seed)


def test_policy_ids_scored_at_the_last_token_as_hugging_face_does(samples):
    batch, tok = samples
    model = rm(len(tok))
    reward = ModelReward(model, micro_batch_size=2)
    out = reward(batch.clone())
    assert not any(p.requires_grad for p in model.parameters())
    expected = []
    for row in range(batch.batch_size[0]):  # independently: HF's own pooling on each unpadded sequence
        prompt = batch[K.PROMPT_IDS][row][batch[K.PROMPT_MASK][row].bool()]
        response = batch[K.RESPONSE_IDS][row][batch[K.RESPONSE_MASK][row].bool()]
        ids = torch.cat([prompt, response])[None]
        expected.append(model(input_ids=ids).logits[0, 0].item())
    assert out[K.SCORES].tolist() == pytest.approx(expected, abs=1e-5)
    last = batch[K.RESPONSE_MASK].sum(-1) - 1
    rows = torch.arange(batch.batch_size[0])
    assert out[K.TOKEN_REWARDS][rows, last].tolist() == pytest.approx(expected, abs=1e-5)
    assert out[K.TOKEN_REWARDS].sum(-1).tolist() == pytest.approx(expected, abs=1e-5)
    # micro-batching changes nothing
    whole = ModelReward(model)(batch.clone())[K.SCORES]
    torch.testing.assert_close(whole, out[K.SCORES], atol=1e-5, rtol=1e-5)


def test_reencodes_with_its_own_tokenizer_and_chat_template(samples):
    batch, policy_tok = samples
    rm_tok = char_tokenizer(DEFAULT_ALPHABET[::-1])  # same characters, other ids
    rm_tok.chat_template = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}#{% endfor %}"
    model = rm(len(rm_tok), seed=1)
    out = ModelReward(model, rm_tok, micro_batch_size=4)(batch.clone())
    expected = []
    for row in range(batch.batch_size[0]):
        chat = [*batch[K.RAW_PROMPT][row], {"role": "assistant", "content": batch[K.RESPONSE_TEXT][row]}]
        text = "".join(f"{m['role']}:{m['content']}#" for m in chat)
        ids = torch.tensor([rm_tok.convert_tokens_to_ids(list(text))])
        expected.append(model(input_ids=ids).logits[0, 0].item())
    assert out[K.SCORES].tolist() == pytest.approx(expected, abs=1e-5)


def test_other_vocabulary_without_its_tokenizer_is_a_clear_error(samples):
    batch, tok = samples
    with pytest.raises(ValueError, match="does not share the policy's tokenizer.*ModelReward\\(model, tokenizer\\)"):
        ModelReward(rm(5))(batch.clone())


def test_max_length_truncates_from_the_left_and_counts(samples):
    batch, tok = samples
    model = rm(len(tok))
    reward = ModelReward(model, max_length=4)
    out = reward(batch.clone())
    assert reward.stats["reward/truncated"] == batch.batch_size[0]
    row = 0
    prompt = batch[K.PROMPT_IDS][row][batch[K.PROMPT_MASK][row].bool()]
    response = batch[K.RESPONSE_IDS][row][batch[K.RESPONSE_MASK][row].bool()]
    ids = torch.cat([prompt, response])[-4:][None]
    assert out[K.SCORES][row].item() == pytest.approx(model(input_ids=ids).logits[0, 0].item(), abs=1e-5)
    with pytest.raises(ValueError, match="row 0 .* > max_length=4"):
        ModelReward(model, max_length=4, truncation="error")(batch.clone())


def test_scalar_head_required_and_arguments_checked():
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    two = Qwen2ForSequenceClassification(Qwen2Config(vocab_size=8, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=1, num_key_value_heads=1,
                                                     intermediate_size=8, num_labels=2))
    with pytest.raises(ValueError, match="scalar head"):
        ModelReward(two)
    with pytest.raises(ValueError, match="truncation"):
        ModelReward(rm(8), truncation="middle")


def test_from_pretrained_and_combined_with_a_rule(samples, tmp_path):
    batch, tok = samples
    model = rm(len(tok), seed=2)
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    loaded = ModelReward.from_pretrained(tmp_path / "rm", micro_batch_size=3)
    rm_scores = loaded(batch.clone())[K.SCORES]

    def has_digit(response, ground_truth):
        return float(any(c in string.digits for c in response))

    rule = torch.tensor([has_digit(r, None) for r in batch[K.RESPONSE_TEXT]])
    both = CombinedReward({"rm": loaded, "digit": has_digit}, weights={"rm": 0.5, "digit": 2.0})
    out = both(batch.clone())
    torch.testing.assert_close(out[K.SCORES], 0.5 * rm_scores + 2.0 * rule, atol=1e-5, rtol=1e-5)
    assert both.stats["reward/rm/mean"] == pytest.approx(rm_scores.mean().item(), abs=1e-5)
    assert both.stats["reward/digit/mean"] == pytest.approx(rule.mean().item())


def test_trainer_step_with_a_reward_model(tokenizer, model, addition_rows, tmp_path):
    from tests.trainer.helpers import make_trainer

    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=1, loggers=())
    trainer.reward = CombinedReward([ModelReward(rm(len(tokenizer)), micro_batch_size=8),
                                     FunctionReward(lambda response, ground_truth: float(response == ground_truth))])
    trainer.check_chain()
    metrics = trainer.fit(data)[-1]
    assert "timing_s/reward" in metrics and "reward/reward_model/mean" in metrics
    assert metrics["critic/score/mean"] == pytest.approx(metrics["reward/reward_model/mean"]
                                                         + metrics["reward/<lambda>/mean"], abs=1e-5)


def test_a_function_gets_the_reward_model_score(samples):
    """verl's default with a reward model and a custom function: the function alone scores, using the RM's."""
    from rlflow.rewards import WithRMScore

    batch, tok = samples
    model = ModelReward(rm(len(tok), seed=4))
    rm_scores = model(batch.clone())[K.SCORES]

    def per_sample(data_source, solution_str, ground_truth, extra_info=None, rm_score=None):
        return rm_score * 2 + len(solution_str)

    def per_batch(solution_strs, ground_truths, rm_scores):
        return [s - 1 for s in rm_scores]

    lengths = torch.tensor([len(t) for t in batch[K.RESPONSE_TEXT]], dtype=torch.float32)
    reward = WithRMScore(model, per_sample)
    torch.testing.assert_close(reward(batch.clone())[K.SCORES], rm_scores * 2 + lengths)
    assert reward.stats["reward/reward_model/mean"] == pytest.approx(rm_scores.mean().item(), abs=1e-6)
    assert reward.extras["rm_score"] == pytest.approx(rm_scores.tolist())
    torch.testing.assert_close(WithRMScore(model, per_batch)(batch.clone())[K.SCORES], rm_scores - 1)
    with pytest.raises(ValueError, match="does not take rm_score"):
        WithRMScore(model, lambda response, ground_truth: 1.0)
