"""GRPO with the loop written out: *collect* from the experience stream, *learn* with Lightning Fabric.

    python recipes/grpo_loop.py
    python recipes/grpo_loop.py --steps 100 --micro-batch-size 32

This is what ``Trainer.fit`` does for GRPO with ``PPOLoss`` on one process (one optimizer step per RL
step, no KL term, so neither a reference model nor a separate old-log-prob pass), spelled out with
Fabric's primitives (``setup_module``, ``setup_optimizers``, ``autocast``, ``backward``,
``clip_gradients``, ``log_dict``) so that it can be changed line by line: a second loss, another order of
phases, an extra metric. ``tests/trainer/test_parity.py`` keeps it equal to ``Trainer.fit`` weight for
weight, so the Trainer hides no math. The roles are rlflow's; only the loop is yours.

Prints held-out greedy accuracy before and after, on the built-in addition task.
"""

from __future__ import annotations

import argparse
import time
from itertools import islice

import lightning_fabric as L
import torch

from rlflow import GRPO, FunctionReward, HFRollout, Policy, PPOLoss
from rlflow.algorithms import Aggregation
from rlflow.data import keys as K
from rlflow.rollout.stream import Experience, PromptStream
from rlflow.trainer.batching import micro_batches
from rlflow.trainer.metrics import batch_metrics


def collect(policy: Policy, reward, fabric: L.Fabric, n: int, max_new_tokens: int, stages=()) -> Experience:
    """The experience stream: sample with the trained module itself, under the training precision."""
    rollout = HFRollout(n=n, max_new_tokens=max_new_tokens, temperature=policy.temperature)
    rollout.bind(policy.model, policy.tokenizer)
    experience = Experience(rollout, reward, stages)
    experience.precision = fabric.autocast  # entered around each generation, as the Trainer does
    return experience


def learn(batch, policy: Policy, optimizer, fabric: L.Fabric, estimator, loss, micro_batch_size: int | None,
          max_grad_norm: float) -> dict[str, float]:
    """One RL step on a scored batch: advantages, then one optimizer step over micro-batches."""
    batch = estimator(batch)  # GRPO: advantages from the group's scores
    mask = batch[K.RESPONSE_MASK]
    # the loss of every micro-batch is normalised by the whole batch's counts: the accumulated gradient
    # does not depend on the micro-batch size
    aggregation = Aggregation(num_tokens=mask.sum(), num_seqs=(mask.sum(-1) > 0).sum(), dp_size=fabric.world_size)
    policy.module.train()
    stats = {}
    for micro in micro_batches(batch, micro_batch_size, None, fabric):
        log_probs, entropy = policy.log_probs(micro)  # under autograd
        micro[K.LOG_PROBS], micro[K.ENTROPY] = log_probs, entropy
        micro[K.OLD_LOG_PROBS] = log_probs.detach()  # one update per batch: the old policy is this one
        out = loss(micro, aggregation)
        fabric.backward(out.loss)
        stats = {k: stats.get(k, 0.0) + float(v) for k, v in out.stats.items()}  # loss terms: shares, summed
    norm = float(fabric.clip_gradients(policy.module, optimizer, max_norm=max_grad_norm, error_if_nonfinite=False))
    if torch.isfinite(torch.tensor(norm)):  # a non-finite gradient skips the step, as the Trainer does
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return batch_metrics(batch) | {"actor/pg_loss": stats.get("actor/pg_loss", 0.0), "actor/grad_norm": norm}


def grpo_loop(policy: Policy, data, reward, *, steps: int, batch_size: int, n: int = 4, max_new_tokens: int = 4,
              micro_batch_size: int | None = None, lr: float = 1e-6, weight_decay: float = 0.01,
              max_grad_norm: float = 1.0, seed: int = 0, fabric: L.Fabric | None = None,
              log=None) -> list[dict[str, float]]:
    """Train ``policy`` for ``steps`` RL steps on ``data`` (a ``PromptData``); returns every step's metrics."""
    fabric = fabric or L.Fabric(accelerator="cpu", devices=1, precision="32-true", loggers=[])
    policy.module = fabric.setup_module(policy.module)
    trainable = [p for p in policy.module.parameters() if p.requires_grad]
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay))
    experience = collect(policy, reward, fabric, n, max_new_tokens)
    estimator, loss = GRPO(), PPOLoss()
    fabric.seed_everything(seed, verbose=False)  # before the first prompt is drawn: the same samples as fit
    prompts = PromptStream(data.loader(batch_size, policy.tokenizer), device=fabric.device)
    history = []
    start = time.perf_counter()
    for step, batch in enumerate(islice(experience(prompts), steps), start=1):  # islice: no batch past the last
        metrics = learn(batch, policy, optimizer, fabric, estimator, loss, micro_batch_size, max_grad_norm)
        # the generation stream holds the live module: the next batch samples with the new weights
        metrics |= experience.metrics | {"training/global_step": step, "timing_s/step": time.perf_counter() - start}
        fabric.log_dict(metrics, step=step)
        history.append(metrics)
        if log:
            log(step, metrics)
        start = time.perf_counter()
    return history


def main() -> None:
    from rlflow.tasks.addition import AdditionTask, exact_match, greedy_accuracy, warm_started_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--micro-batch-size", type=int, default=None, help="samples per forward/backward")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    task = AdditionTask()
    model, tokenizer = warm_started_model(task, args.seed)
    policy = Policy(model, tokenizer)
    _, _, test = task.splits()
    before = greedy_accuracy(model, tokenizer, test, max_new_tokens=task.max_new_tokens)
    grpo_loop(policy, task.data(args.seed), FunctionReward(exact_match), steps=args.steps, batch_size=args.batch_size,
              n=args.n, max_new_tokens=task.max_new_tokens, micro_batch_size=args.micro_batch_size, lr=args.lr,
              weight_decay=0.0, seed=args.seed,
              log=lambda step, m: print(f"step {step}: score {m['critic/score/mean']:.3f}, "
                                        f"pg_loss {m['actor/pg_loss']:.4f}"))
    after = greedy_accuracy(policy.model, tokenizer, test, max_new_tokens=task.max_new_tokens)
    print(f"held-out greedy accuracy: {before:.3f} -> {after:.3f}")


if __name__ == "__main__":
    main()
