"""One Trainer step on SmolLM2-135M-Instruct, run in the test's process (one device) or by torchrun (FSDP2):

    python -m torch.distributed.run --nproc_per_node 2 fsdp2_worker.py MODEL_DIR OUT fsdp2

(the test forks its ranks, tests/distributed/launch.py's ``fork_ranks``, and calls :func:`main` in each)

Greedy samples (the same on any number of processes), an advantage that depends on the sample alone (so the update
does not depend on how samples are split over processes), AdamW. Rank 0 writes OUT/result.pt: the step's metrics,
a fixed sample of every parameter after the step (:func:`sample`; the full model is 538 MB), and after the weight
sync the largest gap between the generation engine's log-probs and the policy's (the engine is a full copy under
FSDP2, with SmolLM2's tied embedding and LM head).
"""

from __future__ import annotations

import os
import sys
import zlib

import torch

from rlflow import FunctionReward, HFRollout, Policy, PPOLoss, PromptData, Trainer
from rlflow.algorithms.estimators import AdvantageEstimator
from rlflow.data import keys as K
from rlflow import Batching, Hardware, Loop, Optim, RunDir

QUESTIONS = ("Name a color.", "Is the sky blue? Answer yes or no.", "Say hello.", "What is 2+2?")
SAMPLE = 4096  # elements of each parameter compared
LR = 1e-4


def sample(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The same ``SAMPLE`` elements of a parameter wherever it is read (seeded by its name)."""
    flat = tensor.detach().reshape(-1)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return flat[torch.randint(flat.numel(), (min(SAMPLE, flat.numel()),), generator=g)].float().cpu().clone()


class ReturnAsAdvantage(AdvantageEstimator):
    """REINFORCE without a baseline: each token's advantage is its sample's score."""

    def compute(self, batch):
        returns = batch[K.TOKEN_REWARDS].flip(-1).cumsum(-1).flip(-1) * batch[K.RESPONSE_MASK]
        return returns, returns


def score(solution_str: str, ground_truth: str) -> float:
    return len(solution_str) / 20 - 0.5 + int(ground_truth) / 4  # differs between samples and prompts


class Record:
    def __init__(self, prompts):
        self.prompts, self.result = prompts, None

    def on_step_end(self, trainer, step, metrics):
        from rlflow.rollout.weight_sync import full_weight_buckets

        rank0 = trainer.fabric.global_rank == 0
        weights = {}
        for bucket in full_weight_buckets(trainer.policy.model):  # collective: every rank takes part
            weights |= {name: sample(name, t) for name, t in bucket} if rank0 else {}
        with torch.no_grad():  # the engine after the step's weight sync, on fixed prompts
            batch = trainer.rollout(trainer.fabric.to_device(self.prompts.clone()))
            policy, _ = trainer.policy.log_probs(batch)  # collective under FSDP2
        gap = ((policy - batch[K.ROLLOUT_LOG_PROBS]) * batch[K.RESPONSE_MASK]).abs().max()
        gap = float(trainer.fabric.all_reduce(gap, reduce_op="max"))
        if rank0:
            self.result = {"metrics": metrics, "weights": weights, "engine_gap": gap}


def build(model_dir: str, out: str, strategy: str, devices: int):
    from rlflow.data.prompts import collate, load_rows

    torch.manual_seed(0)
    policy = Policy.from_pretrained(model_dir)
    rows = [{"prompt": [{"role": "user", "content": q}], "ground_truth": str(i)} for i, q in enumerate(QUESTIONS)]
    record = Record(collate(load_rows(rows[:2])[0], policy.tokenizer))
    trainer = Trainer(
        policy=policy, rollout=HFRollout(n=1, do_sample=False, max_new_tokens=4), reward=FunctionReward(score),
        estimator=ReturnAsAdvantage(), loss=PPOLoss(),
        callbacks=[record],
        optim=Optim(lr=LR),
        batching=Batching(batch_size=len(QUESTIONS), micro_batch_size=1),
        loop=Loop(max_steps=1, progress=False),
        run=RunDir(path=out, loggers=()),
        hardware=Hardware(devices=devices, strategy=strategy),
    )
    return trainer, PromptData(rows, shuffle=False), record


def main(model_dir: str, out: str, strategy: str) -> None:
    """One rank's run (``WORLD_SIZE`` ranks); rank 0 writes OUT/result.pt."""
    trainer, data, record = build(model_dir, out, strategy, int(os.environ.get("WORLD_SIZE", 1)))
    trainer.fit(data)
    if trainer.fabric.global_rank == 0:
        torch.save(record.result, f"{out}/result.pt")
    trainer.fabric.barrier()  # gloo can abort at teardown unless every rank is done
    if torch.distributed.is_initialized():  # an orderly gloo teardown (tests/distributed/worker.py says why)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
