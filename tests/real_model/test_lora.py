"""LoRA on the real model: one Trainer step (GRPO, PPO loss with a KL term against the adapter-disabled reference)
changes the adapter and nothing else, and the reference is the base model."""

from __future__ import annotations

import torch
from peft import LoraConfig

from rlflow import GRPO, FunctionReward, HFRollout, Policy, PPOLoss, PromptData, Trainer, Batching, Loop, Optim, RunDir
from rlflow.data import keys as K
from rlflow.models.lora import hf_name
from rlflow.models.policy import AdapterDisabledReference
from tests.real_model.helpers import chat_batch, chat_rows

QUESTIONS = ("Name a color.", "Write a haiku about the sea.")


def test_one_lora_step_changes_only_the_adapter(smollm2_dir, policy, tok, tmp_path):
    lora = Policy.from_pretrained(smollm2_dir, lora=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    trainer = Trainer(
        policy=lora, rollout=HFRollout(n=2, max_new_tokens=8, seed=0),
        reward=FunctionReward(lambda solution_str, ground_truth: len(solution_str) / 10),  # differs within a group
        estimator=GRPO(), loss=PPOLoss(kl_coef=0.1),
        optim=Optim(lr=1e-3),
        batching=Batching(batch_size=2),
        loop=Loop(max_steps=1, progress=False),
        run=RunDir(path=tmp_path, loggers=()),
    )
    assert isinstance(trainer.reference, AdapterDisabledReference)  # no second copy of the model
    (metrics,) = trainer.fit(PromptData(chat_rows(QUESTIONS), shuffle=False))
    assert metrics["actor/grad_norm"] > 0 and "actor/kl_loss" in metrics

    base = dict(policy.model.named_parameters())  # the session's untouched copy of the same folder
    adapter = {}
    for name, param in lora.model.named_parameters():
        if "lora_" in name:
            adapter[name] = param.detach()
        else:
            assert torch.equal(param, base[hf_name(name)]), name  # frozen: bit for bit the base weights
    assert len(adapter) == 30 * 2 * 2  # A and B on q_proj and v_proj of every layer
    lora_b = [p for n, p in adapter.items() if "lora_B" in n]
    assert all(p.abs().max() > 0 for p in lora_b)  # B starts at 0: each moved

    prompts = chat_batch(tok, QUESTIONS)
    greedy = HFRollout(n=1, do_sample=False, max_new_tokens=8)
    greedy.bind(policy.model, tok)
    batch = policy(greedy(prompts))  # the base model's own log-probs
    reference = trainer.reference(batch.clone())[K.REF_LOG_PROBS]
    trained = lora(batch.clone())[K.OLD_LOG_PROBS]
    mask = batch[K.RESPONSE_MASK].bool()
    assert (reference - batch[K.OLD_LOG_PROBS])[mask].abs().max() < 1e-5  # adapter off = the base model
    assert (trained - batch[K.OLD_LOG_PROBS])[mask].abs().max() > 1e-3  # adapter on: the step changed the policy
