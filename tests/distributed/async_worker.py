"""Run by test_async_ranks.py (:func:`main` in 2 forked ranks, or by torchrun): fully asynchronous RL on 2
processes, rank 0's engine feeding both.

    python -m torch.distributed.run --nproc_per_node 2 async_worker.py OUT [VERL_OVERRIDE ...]

Job 1, the Python API on DDP: 4 steps of ``FullyAsyncRollout(HFRollout(n=2), max_off_policy_threshold=2,
"wait")`` over 8 prompts a step, saving every step; rank 0 writes OUT/result.pt with every rank's trained
prompts and policy versions per step, the prompts rank 0 still held at the end, and every rank's final weights;
then the same run resumed from its step 2 (OUT/resumed/result.pt), and the run one step off
(``AsyncRollout(max_staleness=1)``, OUT/one_step_off/result.pt); then both modes with DAPO's dynamic sampling
(``FilterGroups``: even sums score a constant 1 and are filtered; OUT/filtered_fully, OUT/filtered_one_step_off),
saving the groups rank 0 scored and each rank's ``dapo/*`` metrics per step. Job 2, in the same
processes (a launch starts every interpreter: the suite's cost): rlflow's verl entry point with the overrides given
(verl's V1 keys; FSDP2, as verl's config gives on several processes), writing its run under OUT/verl.
"""

import sys

import torch

from rlflow import Batching, Hardware, Loop, Optim, Policy, PPOLoss, PromptData, RunDir, Trainer
from rlflow.algorithms import GRPO, TruncatedIS
from rlflow.config.verl.run import main as main_ppo
from rlflow.data import keys as K
from rlflow.models.tiny import char_tokenizer, tiny_qwen2
from rlflow.module import Chain
from rlflow.rollout import AsyncRollout, FullyAsyncRollout, HFRollout
from rlflow.rollout.stream import FilterGroups
from rlflow.tasks.addition import AdditionTask

try:
    from ..rollout.test_fully_async import Scored  # the reward, keeping (prompt text, scores) of every group scored
except ImportError:  # run as a script by torchrun
    sys.path[:0] = [str(__import__("pathlib").Path(__file__).parents[2])]
    from tests.rollout.test_fully_async import Scored

STEPS, BATCH, THRESHOLD = 4, 8, 2


def varied(solution_str: str, ground_truth: str) -> float:
    """A score that differs between responses and between prompts."""
    return (len(set(solution_str)) + sum(c.isdigit() for c in solution_str) + int(ground_truth[-1]) / 3) / 8 - 0.3


def parity(solution_str: str, ground_truth: str) -> float:
    """Even sums (the task writes the units digit first) score a constant 1: their group is filtered."""
    return 1.0 if int(ground_truth[0]) % 2 == 0 else varied(solution_str, ground_truth)


class Trained:
    """This rank's groups per step: prompt texts, the trainer's version and each group's oldest token version; the
    scores and this rank's ``dapo/*`` metrics (before any reduction over the ranks)."""

    def __init__(self):
        self.steps = []

    def on_rollout_end(self, trainer, batch):
        self.steps.append({"version": trainer.global_step, "prompts": list(batch[K.PROMPT_TEXT][::2]),
                           "oldest": batch[K.POLICY_VERSION].tolist(), "groups": batch[K.GROUP].tolist(),
                           "scores": batch[K.SCORES].tolist(),
                           "dapo": {k: v for k, v in trainer.experience.metrics.items() if k.startswith("dapo/")}})


def python_api(out, resume=None, one_step_off=False, filtered=False):
    torch.manual_seed(0)
    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                       seed=0)
    rollout = AsyncRollout(HFRollout(n=2, max_new_tokens=4), max_staleness=1) if one_step_off else \
        FullyAsyncRollout(HFRollout(n=2, max_new_tokens=4), max_off_policy_threshold=THRESHOLD,
                          max_off_policy_strategy="wait", chunk_tokens=2)
    trained, reward = Trained(), Scored(parity if filtered else varied)
    trainer = Trainer(policy=Policy(model, tok), rollout=rollout, reward=reward,
                      stages=[FilterGroups("score", max_gen_batches=8)] if filtered else [],
                      estimator=Chain(TruncatedIS(), GRPO()), loss=PPOLoss(is_weights=True),
                      optim=Optim(lr=1e-3 if filtered else 5e-2),  # filtered: no collapse to one text
                      batching=Batching(batch_size=BATCH, micro_batch_size=2),
                      loop=Loop(max_steps=STEPS, progress=False), run=RunDir(path=out, loggers=(), save_every=1, resume=resume),
                      hardware=Hardware(accelerator="cpu", devices=2, strategy="ddp"), callbacks=[trained])
    engine = rollout.engine is not None  # bound by the Trainer: rank 0's alone
    try:
        history = trainer.fit(PromptData(AdditionTask().splits()[0][:64], seed=0))
        left = [p["values"][K.PROMPT_TEXT] for p in rollout.state_dict().get("prompts", [])]
    finally:
        rollout.close()
    mine = {"steps": trained.steps, "left": left, "history": history, "engine": engine, "scored": reward.groups,
            "weights": {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()}}
    every = [None, None]
    torch.distributed.all_gather_object(every, mine)
    if trainer.fabric.global_rank == 0:
        torch.save(every, f"{out}/result.pt")
    trainer.fabric.barrier()


def main(out: str, overrides: list[str]) -> None:
    """One rank's part of the launch (ranks forked by test_async_ranks.py call it too)."""
    python_api(out)
    python_api(f"{out}/resumed", resume=f"{out}/global_step_2")  # the same run, resumed from its step 2
    python_api(f"{out}/one_step_off", one_step_off=True)  # AsyncRollout(max_staleness=1), the same way
    python_api(f"{out}/filtered_fully", filtered=True)  # dynamic sampling: rank 0 filters, hands out kept groups
    python_api(f"{out}/filtered_one_step_off", one_step_off=True, filtered=True)
    assert main_ppo(overrides + [f"trainer.default_local_dir={out}/verl"]) == 0
    torch.distributed.barrier()  # gloo can abort at teardown unless every rank is done


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
