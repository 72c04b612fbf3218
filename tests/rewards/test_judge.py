"""JudgeReward: a real transformers model behind the engine interface grades responses; scores are parsed,
scaled, retried and counted.

The judge is a Qwen2 with no decoder layer whose embedding and LM head are set by hand so that greedy
decoding follows a fixed table (the next token depends on the current one only): after a digit ``d`` it
writes the letter ``'a' + d`` then ``d`` again, after ``x`` it ends at once. With the template
``"...{response}"`` the judge's answer to a response ending in ``d`` is ``"<letter>d..."``: its score is
``d``; a response ending in ``x`` gets an empty answer (a parse failure).
"""

import time

import pytest
import torch
from tensordict import NonTensorStack, TensorDict
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlflow.data import keys as K
from rlflow.models.tiny import char_tokenizer
from rlflow.rewards import RewardWarning
from rlflow.rewards.judge import JudgeReward
from rlflow.rollout.engines import HFEngine


def bigram_judge(tok):
    """Greedy next token = TABLE[current token]: digit d -> letter a+d -> digit d; 'x' -> EOS."""
    vocab = len(tok)
    config = Qwen2Config(vocab_size=vocab, hidden_size=vocab, num_hidden_layers=0, num_attention_heads=1,
                         num_key_value_heads=1, intermediate_size=8, tie_word_embeddings=False, pad_token_id=0,
                         eos_token_id=2, bos_token_id=1)
    model = Qwen2ForCausalLM(config)
    table = {}
    for d in range(10):
        digit, letter = tok.convert_tokens_to_ids(str(d)), tok.convert_tokens_to_ids(chr(ord("a") + d))
        table[digit], table[letter] = letter, digit
    table[tok.convert_tokens_to_ids("x")] = tok.eos_token_id
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab))
        model.lm_head.weight.zero_()
        for current, following in table.items():
            model.lm_head.weight[following, current] = 10.0
    return model.eval()


def batch_of(responses):
    b = len(responses)
    return TensorDict({
        K.RESPONSE_TEXT: NonTensorStack(*responses), K.RESPONSE_MASK: torch.ones(b, 2, dtype=torch.long),
        K.RAW_PROMPT: NonTensorStack(*[[{"role": "user", "content": "q"}]] * b),
        K.GROUND_TRUTH: NonTensorStack(*["g"] * b), K.DATA_SOURCE: NonTensorStack(*["src"] * b),
        K.EXTRA_INFO: NonTensorStack(*[None] * b),
    }, batch_size=[b])


@pytest.fixture(scope="module")
def judge_parts():
    tok = char_tokenizer()
    return HFEngine(bigram_judge(tok), tok), tok


def test_judge_scores_parsed_and_scaled(judge_parts):
    engine, tok = judge_parts
    judge = JudgeReward(engine, tok, "{prompt}:{response}", max_new_tokens=4, scale=(0, 9), batch_size=2)
    with pytest.warns(RewardWarning, match="held no score"):
        out = judge(batch_of(["12", "7", "x", "40"]))
    assert judge.extras["judge_answer"][:2] == ["c2c2", "h7h7"]  # what the table writes
    assert judge.extras["judge_raw"] == [2.0, 7.0, None, 0.0]
    assert out[K.SCORES].tolist() == pytest.approx([2 / 9, 7 / 9, 0.0, 0.0])
    assert judge.stats["reward/judge/parse_failures"] == 1
    assert "reward/judge/retries" not in judge.stats  # greedy: a parse failure is not asked again


class Flaky:
    """The real engine, failing or stalling on its first calls (an overloaded judge server)."""

    def __init__(self, engine, fail=0, stall=0):
        self.engine, self.fail, self.stall, self.calls = engine, fail, stall, 0

    def generate(self, prompts, params):
        self.calls += 1
        if self.calls <= self.stall:
            time.sleep(5)
        if self.calls <= self.fail:
            raise ConnectionError("judge server busy")
        return self.engine.generate(prompts, params)


def test_failed_and_stalled_calls_are_retried_then_counted(judge_parts):
    engine, tok = judge_parts
    flaky = Flaky(engine, fail=1)
    judge = JudgeReward(flaky, tok, "{response}", max_new_tokens=2, scale=None, retries=1)
    assert judge(batch_of(["3", "5"]))[K.SCORES].tolist() == [3.0, 5.0]
    assert judge.stats["reward/judge/retries"] == 2 and judge.stats["reward/errors"] == 0

    stalled = Flaky(engine, stall=5)
    judge = JudgeReward(stalled, tok, "{response}", max_new_tokens=2, scale=None, retries=1, timeout_s=0.3)
    start = time.monotonic()
    with pytest.warns(RewardWarning, match="timed out after 0.3 s after 2 attempt"):
        out = judge(batch_of(["3", "5"]))
    assert time.monotonic() - start < 3
    assert out[K.SCORES].tolist() == [0.0, 0.0] and judge.stats["reward/timeouts"] == 2


def test_callable_parser_and_chat_template(judge_parts):
    engine, tok = judge_parts
    tok = char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    judge = JudgeReward(engine, tok, "{response}", max_new_tokens=2, parse=lambda text: len(text), scale=None)
    assert judge(batch_of(["3", "x"]))[K.SCORES].tolist() == [2.0, 0.0]


def test_judge_arguments_are_checked(judge_parts):
    engine, tok = judge_parts
    with pytest.raises(ValueError, match="response"):
        JudgeReward(engine, tok, "no fields")
    with pytest.raises(TypeError, match="generate"):
        JudgeReward(object(), tok)
    with pytest.raises(ValueError, match="scale"):
        JudgeReward(engine, tok, scale=(5, 1))
