"""The Trainer: *collect* (the experience stream: rollout -> stages -> reward), then *learn* (log-probs/values ->
advantages -> updates -> weight sync); ``fit`` owns the iteration: ``for batch in experience(prompts): learn(batch)``.

Built on Lightning Fabric (devices, precision, strategy, loggers, checkpoint IO); every role is a module passed in.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from itertools import islice
from pathlib import Path
from typing import Callable

import torch
from tensordict import TensorDict
from tqdm.auto import tqdm

from rlflow.data import keys as K
from rlflow.algorithms.aggregate import Aggregation, call_loss, share_batch_sum
from rlflow.data.prompts import PromptData
from rlflow.module import check_chain
from rlflow.roles import AdvantageEstimator, Loss, Policy, Reward, Rollout, check_roles, optional
from rlflow.rewards.base import setup_rewards
from rlflow.rollout.stream import Experience, PromptStream
from rlflow.strategies import shards_parameters
from rlflow.threads import choose_threads
from rlflow.trainer import numerics, training_state as ckpt, validation
from rlflow.trainer.batching import micro_batches, shuffled_mini_batches, split_rows
from rlflow.trainer.distributed import balance_tokens, gather_in_group, global_sum, reduce_metrics
from rlflow.trainer.fabric import launch_fabric, rank_groups
from rlflow.trainer.metrics import MeanAccumulator, MismatchMetrics, Timer, batch_metrics, sum_micro_batches
from rlflow.trainer import options
from rlflow.trainer.options import Batching, Hardware, Loop, Optim, RunDir
from rlflow.trainer.schedule import make_scheduler, step_schedulers

DATA_KEYS = (K.PROMPT_IDS, K.PROMPT_MASK, K.PROMPT_TEXT, K.RAW_PROMPT, K.GROUND_TRUTH, K.DATA_SOURCE, K.EXTRA_INFO)


class Trainer:
    """Runs RL steps over prompt batches.

    Args:
        policy, rollout, reward, estimator, loss: the roles (concepts page), checked against ``rlflow.roles``' Protocols
            when the Trainer is built; trainer.rollout/reward: the stream's.
        stages, experience: the experience stream's stages (``rlflow.rollout.stream``: ``FilterGroups``, ``Prefetch``,
            ``GreedyBaseline``, ``ReferenceResponses``), or ``experience=Experience(rollout, reward, stages)``.
        reference: a frozen policy for the KL term; ``"auto"`` makes one when the loss reads ``ref_log_probs``, and
            so does a ``functools.partial`` of the policy (``partial(rlflow.models.reference.frozen_reference,
            path=..., micro_batch_size=...)``: weights or a scoring split of its own).
        critic, value_loss: the value model and its loss (needed when ``estimator.needs_critic``).
        callbacks: objects with ``on_*`` hooks (a :class:`~rlflow.trainer.callbacks.NoLearningSignal` is added
            unless one is given).
        optim, batching, loop, run, hardware: the run's settings in five groups (``rlflow.trainer.options``):
            :class:`~rlflow.trainer.options.Optim` (``lr``, ``critic_lr``, ``weight_decay``, ``warmup_steps``,
            ``lr_schedule``, ``optimizer``, ``max_grad_norm``), ``Batching`` (``batch_size``, ``mini_batch_size``,
            ``micro_batch_size``, ``max_tokens_per_micro_batch``, ``ppo_epochs``, ``shuffle_seed``, ``balance_batch``),
            ``Loop`` (``max_steps``, ``epochs``, ``val_every``, ``val_n``, ``val_sampling``, ``critic_warmup_steps``,
            ``seed``, ``progress``), ``RunDir`` (``path``, ``save_every``, ``resume``, ``keep_checkpoints``,
            ``loggers``, ``async_save``) and ``Hardware`` (``accelerator``, ``devices``, ``num_nodes``, ``strategy``, ``precision``,
            ``sequence_parallel_size``). Their fields as flat keywords (``run_dir`` for ``path``) are deprecated.
    """

    def __init__(
        self, policy, rollout=None, reward=None, estimator=None, loss=None, *, stages=(), experience=None,
        reference="auto", critic=None, value_loss=None, callbacks=(), optim: Optim | None = None,
        batching: Batching | None = None, loop: Loop | None = None, run: RunDir | None = None,
        hardware: Hardware | None = None, **legacy,
    ):
        optim, batching, loop, run, hardware = options.resolve(
            {"optim": optim, "batching": batching, "loop": loop, "run": run, "hardware": hardware}, legacy)
        self.optim, self.batching, self.loop, self.run, self.hardware = optim, batching, loop, run, hardware
        (batch_size, mini_batch_size, micro_batch_size, max_tokens_per_micro_batch, ppo_epochs, shuffle_seed,
         balance_batch) = options.values(batching)
        lr, critic_lr, weight_decay, warmup_steps, lr_schedule, optimizer, max_grad_norm = options.values(optim)
        max_steps, epochs, val_every, val_n, val_sampling, critic_warmup_steps, seed, progress = options.values(loop)
        run_dir, save_every, resume, keep_checkpoints, loggers, self.async_save = options.values(run)
        accelerator, sequence_parallel_size = hardware.accelerator, hardware.sequence_parallel_size
        self.experience = Experience.of(rollout, reward, stages, experience)
        rollout, reward = self.experience.rollout, self.experience.reward  # with Prefetch: the AsyncRollout
        check_roles([("policy", policy, Policy), ("rollout", rollout, Rollout), ("reward", reward, Reward),
                     ("estimator", estimator, AdvantageEstimator), ("loss", loss, Loss)]
                    + ([("value_loss", value_loss, Loss)] if value_loss is not None else []))
        self.policy, self.estimator, self.loss = policy, estimator, loss
        self.val_sampling = val_sampling
        self.critic, self.value_loss = critic, value_loss
        if reference == "auto" or isinstance(reference, functools.partial):  # made when something reads it
            wants_ref = K.REF_LOG_PROBS in set(loss.in_keys) | set(estimator.in_keys)
            reference = (policy.reference() if reference == "auto" else reference(policy)) if wants_ref else None
        self.reference = reference
        options.check_settings(policy, rollout, estimator, critic, value_loss, batching, loop)
        self.batch_size, self.mini_batch_size = batch_size, mini_batch_size or batch_size
        self.micro_batch_size, self.ppo_epochs, self.shuffle_seed = micro_batch_size, ppo_epochs, shuffle_seed
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.max_grad_norm, self.max_steps, self.epochs = max_grad_norm, max_steps, epochs
        self.val_every, self.val_n, self.save_every = val_every, val_n, save_every
        self.run_dir, self.resume, self.seed, self.progress = Path(run_dir), resume, seed, progress
        self.keep_checkpoints, self.critic_warmup_steps = keep_checkpoints, critic_warmup_steps
        self.lr_schedule, self.warmup_steps = lr_schedule, warmup_steps
        # One update per batch: the "old" policy is the current one, no pass, unless read before it (KL in the reward);
        # never when the estimator writes it (bypass mode: the sampler's log-probs are the old ones).
        self.needs_old_log_probs = (ppo_epochs > 1 or self.mini_batch_size < batch_size or K.OLD_LOG_PROBS in
                                    estimator.in_keys) and K.OLD_LOG_PROBS not in estimator.out_keys
        self.check_chain()
        if accelerator == "cpu":  # one thread per core is wrong on a busy machine or for a tiny model
            choose_threads(sum(p.numel() for p in policy.model.parameters()))
        self.fabric, self.balance_batch = launch_fabric(hardware, loggers, self.run_dir, callbacks), balance_batch
        self.sp_size, self.sp_group, self.dp_rank, self.dp_size = rank_groups(self.fabric, sequence_parallel_size,
                                                                              (policy, self.reference, critic))
        sharded = shards_parameters(self.fabric.strategy)
        # A sharded policy cannot generate rank by rank (its forward is collective), so the engine gets a full copy
        # (with LoRA, merged), unless it holds weights of its own (vLLM, a server): those are gathered and sent to
        # it bucket by bucket.
        copy_for_engine = sharded and not rollout.holds_own_weights
        engine_model = policy.engine_copy() if copy_for_engine else policy.model
        make_opt = optimizer or (lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay))
        # Optimizers are built after setup_module: FSDP2 replaces parameters with sharded ones.
        self.policy.module = self.fabric.setup_module(policy.module)
        trainable = [p for p in self.policy.module.parameters() if p.requires_grad]  # with LoRA: the adapter only
        self.optimizer = self.fabric.setup_optimizers(make_opt(trainable))
        self.rollout.bind(self.fabric.to_device(engine_model), policy.tokenizer)
        if getattr(self.fabric.strategy, "loaded_policy_weights", False):  # a Megatron dist checkpoint, not engine_model's
            self.rollout.sync_weights(policy.model)
        self.experience.precision = self.generation_precision
        # A LoRA reference is the policy's own module with the adapter off: set up once, with the policy.
        if self.reference is not None and self.reference.model is not policy.model:
            if sharded:
                self.reference.module = self.fabric.setup_module(self.reference.module)
            else:
                self.fabric.to_device(self.reference.model)
        setup_rewards(self.fabric, *self.experience.modules(), estimator)  # reward models: placed like the policy
        share_batch_sum(self._batch_sum, estimator)  # whole-batch statistics (whitening, ...) span the processes
        if critic is not None:
            critic.module = self.fabric.setup_module(critic.module)
            self.critic_optimizer = self.fabric.setup_optimizers(
                torch.optim.AdamW(critic.module.parameters(), lr=critic_lr, weight_decay=weight_decay))
        self.global_step, self.loader, self.schedulers, self.mismatch = 0, None, [], MismatchMetrics()

    rollout = property(lambda self: self.experience.rollout, lambda self, r: setattr(self.experience, "rollout", r))
    reward = property(lambda self: self.experience.reward, lambda self, r: setattr(self.experience, "reward", r))

    # ------------------------------------------------------------------ checks
    def check_chain(self) -> None:
        """Fail now, naming key and module, if some role reads a key nothing writes."""
        provided_by_update = {K.LOG_PROBS, K.ENTROPY} | ({K.OLD_LOG_PROBS} if not self.needs_old_log_probs else set())
        provided_by_update |= {K.TOPK_LOG_PROBS} if K.TEACHER_TOPK_IDS in self.loss.in_keys else set()
        old = ("policy", self.policy if self.needs_old_log_probs else None)
        chain = self.experience.keyed() + [("reference", self.reference), old, ("critic", self.critic),
                                           ("estimator", self.estimator)]
        available = check_chain(DATA_KEYS, chain)
        check_chain(available | provided_by_update, [("loss", self.loss)])
        if self.value_loss is not None:
            check_chain(available | {K.OLD_VALUES}, [("value_loss", self.value_loss)])

    # ------------------------------------------------------------------ one step
    def step(self, batch: TensorDict) -> dict[str, float]:
        """One RL step on a batch of prompts (scored by the experience stream); returns its metrics."""
        return self.learn(self.experience.collect(batch))

    def learn(self, batch: TensorDict) -> dict[str, float]:
        """One RL step on a scored batch of the experience stream; returns its metrics (the stream's too)."""
        timer, start = Timer(), time.perf_counter()
        self.fabric.call("on_rollout_end", trainer=self, batch=batch)
        health = numerics.guard_rewards(batch)  # a NaN reward must not reach whole-batch statistics
        if self.sp_group is not None:  # a sequence-parallel group trains on the union of its ranks' samples
            batch = gather_in_group(batch, self.sp_group)
        if self.reference is not None:
            with timer("ref"):
                batch = self.reference(batch)
        if self.needs_old_log_probs:
            with timer("old_log_prob"):
                batch = self.mismatch.observe(self.policy(batch))
        if self.critic is not None:
            with timer("values"):
                batch = self.critic(batch)
        with timer("adv"):
            batch = self.estimator(batch)
        stats, update_batch = {}, batch
        if self.balance_batch and self.dp_size > 1:
            with timer("balance"):
                update_batch, stats = balance_tokens(batch, self.fabric, self.dp_rank, self.dp_size, self.sp_size,
                                                     self.batch_size // self.mini_batch_size)
        if self.critic is not None:
            with timer("update_critic"):
                stats |= self.update_critic(update_batch)
        warmup = self.global_step < self.critic_warmup_steps  # verl's critic_warmup: the policy waits
        if not warmup:
            with timer("update_actor"):
                stats |= self.update_actor(update_batch) | self.mismatch.pop()
        with timer("update_weights"):  # also in warm-up, as verl's (an asynchronous rollout counts versions)
            stats |= self.rollout.sync_weights(self.policy.model) or {}
        step_schedulers(self.schedulers[1:] if warmup else self.schedulers)  # [policy, critic]
        self.global_step += 1
        self.fabric.call("on_batch_end", trainer=self, batch=batch)

        step_time = time.perf_counter() - start + self.experience.elapsed  # collecting the batch is part of it
        tokens = batch[K.PROMPT_MASK].sum() + batch[K.RESPONSE_MASK].sum()
        total_tokens = int(global_sum(self.fabric, tokens)) // self.sp_size
        metrics = batch_metrics(batch, self.rollout.max_new_tokens) | stats
        metrics |= health | numerics.batch_health(batch)
        metrics |= {"actor/critic_warmup": float(warmup)} if self.critic_warmup_steps else {}
        # the stream's (timing_s/gen, ...) and the estimator's (actor/reward_kl, ...)
        metrics |= self.experience.metrics | optional(self.estimator, AdvantageEstimator, "stats")
        metrics |= timer.metrics() | {
            "timing_s/step": step_time,
            "perf/total_num_tokens": total_tokens,
            "perf/time_per_step": step_time,
            "perf/throughput": int(tokens) / self.sp_size / step_time,  # per device (a group shares its tokens)
            "training/global_step": self.global_step,
            "training/epoch": self.loader.epoch if self.loader else 0,
        }
        return reduce_metrics(self.fabric, metrics)

    def generation_precision(self):
        """The training precision (Fabric's autocast) around sampling with the trained module itself (HF): bf16-mixed
        generates in bf16 like the update computes; engines with weights of their own (vLLM, servers) keep theirs."""
        return contextlib.nullcontext() if self.rollout.holds_own_weights else self.fabric.autocast()

    def _batch_sum(self, value: torch.Tensor) -> torch.Tensor:
        """A sum over the processes' shares of the batch (a sequence-parallel group's ranks share one)."""
        return global_sum(self.fabric, value) / self.sp_size

    def _minibatches(self, batch: TensorDict):
        """(mini-batch, its :class:`Aggregation`) for every optimizer step of this RL step.

        The counts are global (all ranks) divided by the number of ranks: gradients are
        averaged over ranks, so this makes the update equal to one process on the whole batch
        (``token-sum``, which no count divides, multiplies by ``dp_size`` for the same reason).
        With sequence parallelism each sample is counted on all ``sp`` ranks of its group, and each
        of them holds a share of its gradient (summed, not averaged, is right): dividing once more by
        ``sp`` does both.
        """
        mini = batch.batch_size[0] * self.mini_batch_size // self.batch_size  # prompts -> this rank's samples
        world, device = self.fabric.world_size * self.sp_size, batch[K.PROMPT_MASK].device
        orders = ([None] * self.ppo_epochs if self.shuffle_seed is None else shuffled_mini_batches(
            batch.batch_size[0], mini, self.ppo_epochs, self.shuffle_seed + self.dp_rank))
        for order in orders:
            for mb in split_rows(batch, mini) if order is None else (batch[i.to(device)] for i in order):
                mask = mb[K.RESPONSE_MASK]
                n_tok = global_sum(self.fabric, mask.sum()) / world
                n_seq = global_sum(self.fabric, (mask.sum(-1) > 0).sum()) / world
                yield mb, Aggregation(num_tokens=n_tok, num_seqs=n_seq, dp_size=self.fabric.world_size)

    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        """Mini-batch updates with gradient accumulation over micro-batches.

        The loss of each micro-batch is normalised by its mini-batch's token and
        sequence counts, so the accumulated gradient does not depend on the micro-batch size.
        """
        wants_topk = K.TOPK_LOG_PROBS in self.loss.in_keys  # top-k distillation: the teacher's tokens

        def micro_loss(micro: TensorDict, agg: Aggregation):
            if wants_topk:
                log_probs, entropy, micro[K.TOPK_LOG_PROBS] = self.policy.log_probs(micro, micro[K.TEACHER_TOPK_IDS])
            else:
                log_probs, entropy = self.policy.log_probs(micro)
            micro[K.LOG_PROBS], micro[K.ENTROPY] = log_probs, entropy
            if K.OLD_LOG_PROBS not in micro.keys():  # one update per batch: the policy before it is the old one
                self.mismatch.add(micro.set(K.OLD_LOG_PROBS, log_probs.detach()))
            return self.policy.with_auxiliary_loss(call_loss(self.loss, micro, agg), agg.num_tokens)

        return self._update(batch, self.policy.module, self.optimizer, "actor", micro_loss)

    def update_critic(self, batch: TensorDict) -> dict[str, float]:
        def micro_loss(micro: TensorDict, agg: Aggregation):
            micro[K.OLD_VALUES] = micro[K.VALUES]
            micro[K.VALUES] = self.critic.values(micro)
            return call_loss(self.value_loss, micro, agg)

        return self._update(batch, self.critic.module, self.critic_optimizer, "critic", micro_loss)

    def _update(self, batch: TensorDict, module, opt, role: str, micro_loss: Callable) -> dict[str, float]:
        """The mini-batch / micro-batch loop both updates share; ``micro_loss(micro, aggregation)`` -> LossOutput."""
        acc = MeanAccumulator()
        module.train()
        for mb, agg in self._minibatches(batch):
            if not agg.num_tokens:  # no valid token on any process: nothing to learn (AdamW would still decay weights)
                acc.add({f"{role}/skipped_frac": 1.0})
                continue
            micro_stats, summed = [], frozenset()
            for micro in micro_batches(mb, self.micro_batch_size, self.max_tokens_per_micro_batch, self.fabric):
                out = micro_loss(micro, agg)
                self.fabric.backward(out.loss)
                micro_stats.append(out.stats)
                summed |= out.summed  # the loss says which stats are shares (summed) and which are means
            stats = sum_micro_batches(micro_stats, summed)
            # with sequence parallelism each rank's loss is sp x its share (see _minibatches): log one copy
            acc.add({k: v / self.sp_size if k in summed else v for k, v in stats.items()})
            acc.add(self._optimizer_step(module, opt, role))
        return acc.means() | {f"{role}/lr": opt.param_groups[0]["lr"]}

    def _optimizer_step(self, module, opt, role: str) -> dict[str, float]:
        """Clip, then step, unless the gradient norm is not finite (then the step is skipped and counted)."""
        max_norm = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        norm = float(self.fabric.clip_gradients(module, opt, max_norm=max_norm, error_if_nonfinite=False))
        finite = math.isfinite(norm)
        if finite:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return {f"{role}/grad_norm": norm if finite else float("nan"), f"{role}/skipped_frac": float(not finite)}

    # ------------------------------------------------------------------ validation
    def validate(self, data: PromptData) -> dict[str, float]:
        """Validation metrics per data source, under verl's names (see :func:`rlflow.trainer.validation.validate`)."""
        return validation.validate(self, data)

    # ------------------------------------------------------------------ the loop
    def fit(self, data: PromptData) -> list[dict[str, float]]:
        """Train on ``data``; returns every step's metrics (validation metrics merged into their step)."""
        self.fabric.seed_everything(self.seed, verbose=False)  # no 'Seed set to N' after validation's step:0
        # an unwritable or full disk fails now (on every rank), not at the first save
        ckpt.check_run_dir(self.run_dir, self.save_every and ckpt.checkpoint_bytes(
            self.policy.model, self.critic.module if self.critic is not None else None))
        self.loader = PromptStream(data.loader(self.batch_size, self.policy.tokenizer), self.fabric.global_rank,
                                   self.fabric.world_size, self.fabric.device)  # tensors only: columns stay as they are
        total = self.max_steps or self.epochs * self.loader.steps_per_epoch
        self.schedulers = [make_scheduler(o, self.lr_schedule, self.warmup_steps, total) for o in self._optimizers()]
        ckpt.resume(self)
        history = []
        self.fabric.call("on_fit_start", trainer=self)
        bar = tqdm(total=total, initial=self.global_step, desc="rl", disable=not self.progress or self.fabric.global_rank)
        with contextlib.closing(self.experience(self.loader)) as experience:  # closing: cancels batches in flight
            for batch in islice(experience, max(total - self.global_step, 0)):  # islice: no batch past the last
                metrics = self.learn(batch)
                data.batch_trained(batch)  # a curriculum sampler learns from the step (PromptData(sampler=...))
                if self.val_every and data.val and (self.global_step % self.val_every == 0 or self.global_step == total):
                    t0 = time.perf_counter()
                    metrics |= self.validate(data)
                    metrics["timing_s/testing"] = time.perf_counter() - t0
                self.fabric.log_dict(metrics, step=self.global_step)  # before the checkpoint: a resume drops extra rows
                if self.save_every and (self.global_step % self.save_every == 0 or self.global_step == total):
                    self.save()
                self.fabric.call("on_step_end", trainer=self, step=self.global_step, metrics=metrics)
                history.append(metrics)
                bar.update(1)
                bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}", len=f"{metrics['response_length/mean']:.1f}",
                                pg=f"{metrics.get('actor/pg_loss', 0.0):.3f}")
        bar.close()
        ckpt.wait(self)  # an asynchronous save finishes before fit returns
        self.fabric.call("on_fit_end", trainer=self)
        for logger in self.fabric.loggers:
            logger.finalize("success")
        return history

    def _optimizers(self):
        return [self.optimizer] + ([self.critic_optimizer] if self.critic is not None else [])

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_dir(self) -> Path:
        """Where ``global_step_N`` folders and ``latest_checkpointed_iteration.txt`` go: ``run_dir`` (verl's layout)."""
        return self.run_dir

    def save(self) -> Path:
        """Write a checkpoint of this step (see :func:`rlflow.trainer.training_state.save`), then call the callbacks'
        ``on_save(trainer=, global_step=, checkpoint_dir=)``."""
        path = ckpt.save(self)
        self.fabric.call("on_save", trainer=self, global_step=self.global_step, checkpoint_dir=str(path))
        return path

    def load(self, path: str | Path) -> None:
        """Restore model, optimizer, schedule, RNG, data position and step from a checkpoint folder."""
        ckpt.load(self, path)
