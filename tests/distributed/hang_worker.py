"""Run by torchrun from tests/trainer/test_watchdog.py: a 2-process DDP job on gloo whose rank 1 hangs in its
reward function from step 2 on, while rank 0 goes on into the next collective and times out there.

    python -m torch.distributed.run --nproc_per_node 2 hang_worker.py OUT

After step 1 both ranks set the process group's time-out to TIMEOUT_S (what DDPStrategy(timeout=...) sets from
the start; set late here so that a slow start on a loaded machine cannot time out instead), far shorter than
the hang.
"""

import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from rlflow import Batching, FunctionReward, Hardware, HFRollout, Loop, Optim, Policy, PPOLoss, PromptData, RunDir, Trainer
from rlflow.algorithms import GRPO
from rlflow.models.tiny import char_tokenizer, tiny_qwen2
from rlflow.tasks.addition import AdditionTask

TIMEOUT_S = 3
HANG = threading.Event()


def reward(solution_str: str, ground_truth: str) -> float:
    if HANG.is_set() and os.environ["RANK"] == "1":
        time.sleep(300)  # a reward that hangs (an unresponsive sandbox, a judge that never answers)
    return len(solution_str) / 4


class ShortTimeoutAfterStep1:
    def on_step_end(self, trainer, step, metrics):
        if step == 1:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=TIMEOUT_S))
            HANG.set()


if __name__ == "__main__":
    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0)
    train, _, _ = AdditionTask().splits()
    trainer = Trainer(policy=Policy(model, tok), rollout=HFRollout(n=2, max_new_tokens=4),
                      reward=FunctionReward(reward, timeout_s=None), estimator=GRPO(), loss=PPOLoss(), optim=Optim(lr=1e-2),
                      batching=Batching(batch_size=4), loop=Loop(max_steps=3, progress=False),
                      run=RunDir(path=sys.argv[1], loggers=()), callbacks=[ShortTimeoutAfterStep1()],
                      hardware=Hardware(strategy="ddp", devices=2, accelerator="cpu"))
    trainer.fit(PromptData(train[:32], seed=0))
