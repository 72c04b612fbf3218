"""Run by torchrun from test_vllm.py: GRPO with FSDP2 on 2 gloo processes, each generating with its own vLLM.

    python -m torch.distributed.run --nproc_per_node 2 vllm_fsdp2_worker.py OUT

After every step, each rank samples with its engine and scores the samples with the (sharded) policy: the
engine's log-probs must equal the policy's, so the weights gathered from the shards reached the engine.
Rank 0 writes OUT/result.pt: per step, every rank's largest difference and the weight-sync metrics.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlflow import FunctionReward, Policy, PPOLoss, PromptData, Trainer, Batching, Hardware, Loop, Optim, RunDir
from rlflow.algorithms import GRPO
from rlflow.data import keys as K
from rlflow.data.prompts import collate, load_rows
from rlflow.models.tiny import char_tokenizer, tiny_qwen2
from rlflow.rollout import VLLMRollout
from rlflow.tasks.addition import AdditionTask, exact_match


class CheckEngine:
    def __init__(self, probe):
        self.probe, self.steps = probe, {}

    def on_step_end(self, trainer, step, metrics):
        batch = trainer.policy(trainer.rollout(self.probe))  # the policy's forward is collective under FSDP2
        mask = batch[K.RESPONSE_MASK].bool()
        diff = (batch[K.ROLLOUT_LOG_PROBS] - batch[K.OLD_LOG_PROBS])[mask].abs().max()
        diffs = [torch.zeros(()) for _ in range(dist.get_world_size())]
        dist.all_gather(diffs, diff.reshape(()))
        self.steps[step] = {"diffs": [float(d) for d in diffs], "gb": metrics["weight_sync/gb"],
                            "buckets": metrics["weight_sync/buckets"],
                            "update_s": metrics["timing_s/update_weights"]}


if __name__ == "__main__":
    out = sys.argv[1]
    torch.manual_seed(0)
    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), seed=0)  # hidden 128, 4 heads: head_dim 32 (vLLM's CPU attention)
    train, _, test = AdditionTask().splits()
    check = CheckEngine(collate(load_rows(test[:4])[0], tok))
    rollout = VLLMRollout(n=4, max_new_tokens=4, dtype="float32", enforce_eager=True, max_model_len=64,
                          bucket_bytes=256 * 1024)
    trainer = Trainer(
        policy=Policy(model, tok), rollout=rollout, reward=FunctionReward(exact_match), estimator=GRPO(),
        loss=PPOLoss(), callbacks=[check], optim=Optim(lr=1e-2), batching=Batching(batch_size=8),
        loop=Loop(max_steps=2, progress=False), run=RunDir(path=out, loggers=()),
        hardware=Hardware(accelerator="cpu", devices=2, strategy="fsdp2"),
    )
    sharded = any(isinstance(p, DTensor) for p in trainer.policy.model.parameters())
    assert sharded and trainer.rollout.model is trainer.policy.model  # the engine holds its own weights: no copy
    trainer.fit(PromptData(train[:64], seed=0))
    if trainer.fabric.global_rank == 0:
        torch.save(check.steps, f"{out}/result.pt")
    trainer.fabric.barrier()  # gloo can abort at teardown unless every rank is done
