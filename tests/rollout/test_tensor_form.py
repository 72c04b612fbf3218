"""The HF engine's tensor form gives exactly what the list form (``Engine.generate`` -> Completions) gives."""

import pytest
import torch

from rlflow.data import keys as K
from rlflow.data.prompts import collate, load_rows
from rlflow.rollout.engines.hf import HFEngine
from rlflow.rollout.hf import HFRollout
from rlflow.rollout.single_turn import SingleTurnRollout


class ListOnlyEngine(HFEngine):
    """The same engine reached through its list form only (a subclass overriding ``generate``)."""

    def generate(self, prompts, params):
        return super().generate(prompts, params)


def prompts(tokenizer, texts=("12+34=", "5+6=", "99+99=", "7+1=")):
    rows, _ = load_rows([{"prompt": t, "ground_truth": str(i)} for i, t in enumerate(texts)])
    return collate(rows, tokenizer)


@pytest.mark.parametrize("options", [
    dict(n=3, max_new_tokens=6),
    dict(n=2, max_new_tokens=5, temperature=0.7, top_k=5, stop_token_ids=(7,)),
    dict(n=1, max_new_tokens=4, do_sample=False),
])
def test_tensor_form_equals_list_form(model, tokenizer, options):
    batch = prompts(tokenizer)
    # an extra all-padding column on the left: the tensor form must drop it as the list form does
    batch.set(K.PROMPT_IDS, torch.cat([torch.full((4, 1), tokenizer.pad_token_id), batch[K.PROMPT_IDS]], 1))
    batch.set(K.PROMPT_MASK, torch.cat([torch.zeros(4, 1, dtype=torch.long), batch[K.PROMPT_MASK]], 1))
    fast = HFRollout(**options)
    fast.bind(model, tokenizer)
    slow = SingleTurnRollout(ListOnlyEngine(model, tokenizer), **options)
    slow.bind(model, tokenizer)
    assert slow.engine.generate_tensors(batch[K.PROMPT_IDS], batch[K.PROMPT_MASK], slow.params) is None
    torch.manual_seed(3)
    a = fast(batch)
    torch.manual_seed(3)
    b = slow(batch)
    for key in (K.RESPONSE_IDS, K.RESPONSE_MASK, K.ROLLOUT_LOG_PROBS, K.GROUP):
        assert torch.equal(a[key], b[key]), key
    assert list(a[K.RESPONSE_TEXT]) == list(b[K.RESPONSE_TEXT])
    assert list(a[K.GROUND_TRUTH]) == list(b[K.GROUND_TRUTH])


def test_not_left_padded_prompts_take_the_list_form(model, tokenizer):
    batch = prompts(tokenizer)
    ids, mask = batch[K.PROMPT_IDS].clone(), batch[K.PROMPT_MASK].clone()
    mask[1, -1] = 0  # a hole on the right: not plain left padding
    engine = HFEngine(model, tokenizer)
    assert engine.generate_tensors(ids, mask, HFRollout(n=2, max_new_tokens=3).params) is None
