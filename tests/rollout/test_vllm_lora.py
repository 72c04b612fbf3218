"""A LoRA policy generating through the session's in-process vLLM engine: merged weights, then what updates change."""

import pytest
import torch
from peft import LoraConfig

from rlflow import FunctionReward, Policy, PPOLoss, PromptData, Trainer, Batching, Loop, Optim, RunDir
from rlflow.algorithms import GRPO
from rlflow.data import keys as K
from rlflow.models import lora as L
from rlflow.rollout import VLLMRollout
from rlflow.tasks.addition import AdditionTask
from tests.rollout.conftest import ENGINE_OPTIONS, requires_vllm
from tests.rollout.test_vllm import largest_difference, prompts

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_policy(model_dir):
    return Policy.from_pretrained(model_dir, lora=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))


@requires_vllm
def test_lora_updates_reach_vllm_as_merged_weights(vllm_engine, vllm_model_dir, tmp_path):
    """The Trainer with VLLMRollout and a LoRA policy: the engine (the session's, started from the base model)
    gets all merged weights when bound, then after every step the merged weights of the adapted layers only;
    its log-probs equal the adapted policy's, which differ from the base model's."""
    policy = lora_policy(vllm_model_dir)
    train, _, _ = AdditionTask().splits()

    def digits(solution_str, ground_truth):  # varies between samples of an untrained model: non-zero advantages
        return sum(c.isdigit() for c in solution_str) / 4

    trainer = Trainer(
        policy=policy, rollout=VLLMRollout(n=4, max_new_tokens=4, **ENGINE_OPTIONS), reward=FunctionReward(digits),
        estimator=GRPO(), loss=PPOLoss(kl_coef=0.1), optim=Optim(lr=3e-2), batching=Batching(batch_size=4),
        loop=Loop(max_steps=2, progress=False), run=RunDir(path=tmp_path, loggers=()),
    )
    assert trainer.rollout.engine.llm is vllm_engine[0].llm and trainer.rollout.model is policy.model
    history = trainer.fit(PromptData(train[:16], seed=0))
    base = Policy.from_pretrained(vllm_model_dir)
    adapted = sum(p.numel() * p.element_size() for n, p in base.model.named_parameters()
                  if n.endswith(".weight") and n.split(".")[-2] in LINEAR)
    for metrics in history:
        assert metrics["weight_sync/gb"] == pytest.approx(adapted / 1e9)  # not the embeddings, norms or adapter
    batch = prompts(policy.tokenizer)
    out = policy(trainer.rollout.with_options(n=3, max_new_tokens=6)(batch))
    assert largest_difference(out) < 1e-4
    with torch.no_grad():
        base_log_probs, _ = base.log_probs(out)
    gap = ((base_log_probs - out[K.OLD_LOG_PROBS]) * out[K.RESPONSE_MASK]).abs().max()
    assert gap > 1e-2  # the adapter trained, and the engine generates with it
    assert L.is_lora(policy.model)
