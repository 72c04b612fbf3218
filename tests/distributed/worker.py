"""Run by torchrun from test_fsdp2.py (or :func:`main` in ranks forked by test_parallelism.py): a tiny GRPO job
under a given strategy.

    python -m torch.distributed.run --nproc_per_node N worker.py OUT STRATEGY STEPS [RESUME] [FAIL_RANK] [KEY=VALUE ...]
        [+ OUT STRATEGY STEPS ...]

Several jobs separated by ``+`` run one after another in the same processes (a launch starts every process and
imports torch: on 2 cores ~10 s, more than a tiny job's run). A job ``ulysses_worker OUT`` or
``collectives_worker OUT`` runs that worker's ``main(OUT)`` (first in a launch: they build their own groups).

KEY=VALUE options (integers): ``sp`` (sequence-parallel size), ``remove_padding``,
``max_tokens`` (token budget per micro-batch), ``val`` (validate every step), and with
STRATEGY fsdp2 ``bf16`` (bf16 parameters, fp32 reduction) and ``offload`` (CPU offload policy; needs an
accelerator), ``cuda`` (run on CUDA devices), and ``batch_stats`` (REINFORCE++ whitening and an adaptive KL
in the reward: statistics of the whole batch), ``critic`` (PPO: GAE with a critic, whitened over the batch),
``rm`` (a tiny reward model scores the samples: sharded by FSDP2 like the policy), ``resumed`` (then the same
run again from its first checkpoint, in this launch: result.pt's "resumed" is its last step, "resumed_steps" the
steps it ran).
``lora`` (LoRA adapters on the policy, a KL loss against the adapter-disabled reference, and after each
step the largest gap between the generation engine's log-probs and the policy's on fixed prompts).
Writes, on rank 0, OUT/result.pt with the metrics and the full (gathered) weights
after every step.
"""

import importlib
import sys

import torch
from torch.distributed.tensor import DTensor

from rlflow import FunctionReward, HFRollout, Policy, PPOLoss, PromptData, Trainer
from rlflow.algorithms import GAE, AdaptiveKLController, KLInReward, ReinforcePlusPlus, ValueLoss
from rlflow.models.critic import Critic
from rlflow.algorithms.estimators import AdvantageEstimator
from rlflow.module import Chain
from rlflow.data import keys as K
from rlflow.models.tiny import char_tokenizer, tiny_qwen2
from rlflow.tasks.addition import AdditionTask
from rlflow import Batching, Hardware, Loop, Optim, RunDir


def varied(solution_str: str, ground_truth: str) -> float:
    """A score that differs between responses and between prompts (and is rarely 0)."""
    return (len(set(solution_str)) + sum(c.isdigit() for c in solution_str) + int(ground_truth[-1]) / 3) / 8 - 0.3


class ReturnAsAdvantage(AdvantageEstimator):
    """REINFORCE without a baseline: a token's advantage is its sample's return (gamma 1).

    It depends on the sample alone, so a step's update does not depend on how the samples are
    split over processes, while greedy samples (one per prompt, identical on any number of
    processes) still get non-zero advantages (GRPO would give singleton groups 0: no update to compare).
    """

    def compute(self, batch):
        returns = batch[K.TOKEN_REWARDS].flip(-1).cumsum(-1).flip(-1) * batch[K.RESPONSE_MASK]
        return returns, returns


def full_weights(model):
    """Every rank's full weights, gathered as the engine's weight sync gathers them (CPU-offloaded shards too)."""
    from rlflow.rollout.weight_sync import full_weight_buckets

    return {n: t.detach().cpu().clone() for bucket in full_weight_buckets(model) for n, t in bucket}


class Record:
    def __init__(self):
        self.steps = {}

    def on_step_end(self, trainer, step, metrics):
        weights = full_weights(trainer.policy.model)  # collective: every rank takes part
        if trainer.fabric.global_rank == 0:
            rm = getattr(trainer.reward, "module", None)
            sharded = rm is not None and any(isinstance(p, DTensor) for p in rm.parameters())
            self.steps[step] = {"metrics": metrics, "weights": weights, "rm_sharded": sharded}


class EngineGap:
    """After each step (weights synced), generate on fixed prompts and compare the rollout's log-probs with the policy's."""

    def __init__(self, prompts):
        self.prompts = prompts

    def on_step_end(self, trainer, step, metrics):
        with torch.no_grad():
            batch = trainer.rollout(trainer.fabric.to_device(self.prompts.clone()))
            policy, _ = trainer.policy.log_probs(batch)  # collective under FSDP2: every rank takes part
        gap = ((policy - batch[K.ROLLOUT_LOG_PROBS]) * batch[K.RESPONSE_MASK]).abs().max()
        metrics["test/engine_gap"] = float(trainer.fabric.all_reduce(gap, reduce_op="max"))


class FailAt:
    def __init__(self, rank):
        self.rank = rank

    def on_rollout_end(self, trainer, batch):
        if trainer.fabric.global_rank == self.rank:
            raise RuntimeError(f"injected failure on rank {self.rank}")


def reward_model(tok):
    from rlflow.models.tiny import tiny_qwen2_reward_model
    from rlflow.rewards import ModelReward

    model = tiny_qwen2_reward_model(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                    intermediate_size=64, seed=5)
    return ModelReward(model, micro_batch_size=3)


def build(out, strategy, steps, resume=None, fail_rank=None, devices=None, sp=1, remove_padding=0, max_tokens=None,
          val=0, bf16=0, offload=0, cuda=0, batch_stats=0, critic=0, rm=0, lora=0, samples=1):
    torch.manual_seed(0)
    devices = devices or int(__import__("os").environ.get("WORLD_SIZE", 1))
    if bf16 or offload:
        from rlflow.strategies import FSDP2

        strategy = FSDP2(devices, param_dtype=torch.bfloat16 if bf16 else None, offload=bool(offload))
    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0)
    train, val_rows, _ = AdditionTask().splits()
    record = Record()
    callbacks = [record] + ([FailAt(fail_rank)] if fail_rank is not None else [])
    if lora:
        from peft import LoraConfig

        from rlflow.data.prompts import collate, load_rows

        callbacks.insert(0, EngineGap(collate(load_rows(val_rows[:4])[0], tok)))
    trainer = Trainer(
        policy=Policy(model, tok, remove_padding=bool(remove_padding),
                      lora=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if lora else None),
        rollout=HFRollout(n=samples, do_sample=False, max_new_tokens=4),
        reward=reward_model(tok) if rm else FunctionReward(varied), loss=PPOLoss(kl_coef=0.5) if lora else PPOLoss(),
        estimator=GAE(gamma=1.0, lam=0.95) if critic else Chain(
            KLInReward(AdaptiveKLController(init_coef=0.1, target_kl=1e-3, horizon=10)), ReinforcePlusPlus(),
        ) if batch_stats else ReturnAsAdvantage(),
        critic=Critic(tiny_qwen2(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                 intermediate_size=64, seed=1), remove_padding=bool(remove_padding)) if critic else None,
        value_loss=ValueLoss() if critic else None,
        callbacks=callbacks,
        optim=Optim(lr=1e-2, critic_lr=1e-2),
        batching=Batching(batch_size=8, micro_batch_size=2, max_tokens_per_micro_batch=max_tokens),
        loop=Loop(max_steps=steps, val_every=val, progress=False),
        run=RunDir(path=out, save_every=1, resume=resume, loggers=()),
        hardware=Hardware(accelerator="cuda" if cuda else "cpu", devices=devices, strategy=strategy,
                          sequence_parallel_size=sp),
    )
    return trainer, PromptData(train[:64], val_rows[:10] if val else None, seed=0), record


def run(argv):
    if argv[0] in ("ulysses_worker", "collectives_worker"):  # another worker of this folder, in this launch
        # run by torchrun this script's folder is on sys.path; in ranks forked from the tests, its package is known
        return importlib.import_module(f"{__package__}.{argv[0]}" if __package__ else argv[0]).main(*argv[1:])
    positional = [a for a in argv if "=" not in a]
    options = {k: int(v) for k, v in (a.split("=", 1) for a in argv if "=" in a)}
    out, strategy, steps = positional[0], positional[1], int(positional[2])
    resume = positional[3] if len(positional) > 3 and positional[3] != "-" else None
    fail_rank = int(positional[4]) if len(positional) > 4 else None
    again_too = options.pop("resumed", 0)
    trainer, data, record = build(out, strategy, steps, resume, fail_rank, **options)
    trainer.fit(data)
    if (options.get("lora") or again_too) and steps > 1:  # the same run resumed from its first checkpoint, in
        again, data, resumed = build(f"{out}/resumed", strategy, steps, f"{out}/global_step_1", **options)  # this
        again.fit(data)  # launch: a second torchrun job would start every process and import torch again
        record.steps["resumed"] = resumed.steps.get(steps)
        record.steps["resumed_steps"] = sorted(resumed.steps)
    if trainer.fabric.global_rank == 0:
        torch.save(record.steps, f"{out}/result.pt")
    trainer.fabric.barrier()  # gloo can abort at teardown unless every rank is done


def main(argv: list[str]) -> None:
    """One rank's part of a launch: the jobs of ``argv`` (this script's arguments), one after another."""
    job = []
    for arg in [*argv, "+"]:  # jobs separated by "+" run one after another in this launch
        if arg == "+":
            run(job)
            job = []
        else:
            job.append(arg)
    if torch.distributed.is_initialized():  # an orderly gloo teardown: left to interpreter exit, a rank can abort
        torch.distributed.destroy_process_group()  # ("terminate called without an active exception", seen in CI)


if __name__ == "__main__":
    main(sys.argv[1:])
