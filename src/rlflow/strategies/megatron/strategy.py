"""``MegatronStrategy``: a Lightning Fabric strategy that trains Hugging Face decoders as megatron-core models.

The seam (docs/megatron.md): the Trainer already hands every model to ``fabric.setup_module``, sends
``backward``, ``clip_gradients``, the optimizer step, ``save`` and ``load`` through Fabric, and refreshes
its generation engine with ``rollout.sync_weights(policy.model)``. This strategy implements those
calls, so ``Trainer``, ``Policy``, ``Critic``, the estimators and the losses do not change:

- ``setup_module`` turns a ``TokenLogProbs`` (the policy, the reference) or a ``ValueHeadModel`` (the
  critic) into this rank's Megatron shard (:class:`~.heads.MegatronLogProbs` /
  :class:`~.heads.MegatronValueModel`, same ``forward``), copying the weights from the Hugging Face
  model. The Hugging Face model object stays as the policy's ``model`` with its tensors freed (on the
  ``meta`` device): it keeps the config and names, and its ``weight_buckets`` gather the trained
  weights for the engines (:mod:`.weight_buckets`);
- ``clip_gradients`` / the optimizer step reduce the gradients over the data-parallel replicas and
  measure and clip them over all shards (:mod:`.grads`); the optimizer is the Trainer's own (AdamW over
  this rank's shards);
- ``save`` / ``load`` write and read checkpoints in transformers' naming (:mod:`.sharded_checkpoint`).

It derives from Fabric's ``ModelParallelStrategy`` for process launching and collectives (and so the
Trainer gives the rollout a full copy of the policy, as for FSDP2).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
from lightning_fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.optim import Optimizer

from rlflow.models.checks import activation_checkpointing
from rlflow.strategies.megatron import dist_checkpoint
from rlflow.strategies.megatron.cpu import CPUWorkarounds
from rlflow.strategies.megatron.distopt import DistributedOptimizer, check_overrides
from rlflow.strategies.megatron.grads import clip_, global_grad_norm, reduce_gradients
from rlflow.strategies.megatron.heads import MegatronLogProbs, MegatronValueModel
from rlflow.strategies.megatron import lora as megatron_lora, mtp as megatron_mtp
from rlflow.strategies.megatron.layout import ParallelLayout
from rlflow.strategies.megatron.model import MegatronLM, architecture
from rlflow.strategies.megatron.mtp import MTPOptions
from rlflow.strategies.megatron.offload import KINDS as OFFLOAD_KINDS, Offloader
from rlflow.strategies.megatron.precision_aware import (PrecisionAwareAdamW, check_own, main_grad,
                                                          precision_dtypes)
from rlflow.strategies.megatron.router_replay import RoutingReplay
from rlflow.strategies.megatron.sharded_checkpoint import ShardedCheckpoint
from rlflow.strategies.megatron.slots import check_coverage, lm_slots, load_from_hf, mark_split_parameters, module_slots
from rlflow.strategies.megatron.vision import is_vision_language
from rlflow.strategies.megatron.weight_buckets import WeightExporter

LAYER_SPECS = ("local", "transformer_engine")
DIST_ROLES = dist_checkpoint.ROLES


def _identity(module, _mesh):
    return module


class MegatronStrategy(ModelParallelStrategy):
    """Tensor, pipeline, expert and data parallel training with megatron-core.

    Args:
        tensor_parallel, pipeline_parallel, context_parallel, expert_parallel, sequence_parallel: the layout
            (:class:`~rlflow.strategies.megatron.layout.ParallelLayout`); the data-parallel size is what is
            left of the processes.
        layer_spec: ``"local"`` (megatron-core's own layers: CPU and GPU) or ``"transformer_engine"`` (GPU).
        distributed_optimizer: replace the Trainer's Adam/AdamW by Megatron's DDP + distributed optimizer
            (GPU only; :mod:`~rlflow.strategies.megatron.distopt`).
        transformer_overrides: extra ``TransformerConfig`` fields (verl's ``override_transformer_config``).
        optimizer_overrides: extra megatron-core ``OptimizerConfig`` fields for the distributed optimizer (verl's
            ``optim.override_optimizer_config``: ``optimizer_cpu_offload``, ``optimizer_offload_fraction``, ...);
            an unknown field is a ``ValueError`` naming it. ``use_precision_aware_optimizer=True`` with
            ``main_grads_dtype`` / ``main_params_dtype`` / ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` also applies
            without the distributed optimizer: the Trainer's Adam/AdamW becomes a
            :class:`~.precision_aware.PrecisionAwareAdamW` storing those dtypes (any device).
        dist_checkpoints: ``{role: folder}`` of Megatron dist checkpoints (:mod:`.dist_checkpoint`; verl's
            ``use_dist_checkpointing`` / ``dist_checkpointing_path``) that roles start from instead of their Hugging
            Face weights: ``"policy"`` (the trained ``TokenLogProbs``), ``"reference"`` (a frozen one), ``"critic"``.
            The Hugging Face model still gives the architecture and names; the Trainer then sends the loaded
            policy weights to its generation engine before the first rollout.
        dist_checkpoint_prefix: the key prefix inside those folders (verl's ``dist_checkpointing_prefix``).
        router_replay: MoE routing replay of the trained policy (:mod:`.router_replay`; no effect on dense models):
            ``True`` or ``"R2"`` (verl's ``router_replay.mode=R2``): its update routes each token to the experts its
            old-log-prob pass chose; ``"R3"``: every pass routes each token to the experts the rollout routed it
            to (the batch's ``routed_experts``: ``HFRollout(return_routed_experts=True)``).
        mtp: multi-token prediction of the trained policy (verl's ``model.mtp``, :mod:`.mtp`): its checkpoint's MTP
            layers in megatron-core's MTP block, trained with ``MTPOptions(train=True)``; ``None``: not built.
        offload: what each role keeps in host memory while other roles run (verl's ``megatron.param_offload`` /
            ``grad_offload`` / ``optimizer_offload``; :mod:`.offload`): ``{"policy": ["params", "grads",
            "optimizer"], "reference": ["params"], "critic": [...]}``. A no-op on CPU devices.
        timeout: how long a rank waits in a collective before giving up.
    """

    def __init__(self, tensor_parallel: int = 1, pipeline_parallel: int = 1, *, context_parallel: int = 1,
                 expert_parallel: int = 1, sequence_parallel: bool = False, layer_spec: str = "local",
                 distributed_optimizer: bool = False, transformer_overrides: dict | None = None,
                 optimizer_overrides: dict | None = None, dist_checkpoints: dict[str, str] | None = None,
                 dist_checkpoint_prefix: str = "", router_replay: bool | str = False,
                 mtp: MTPOptions | dict | None = None, offload: dict[str, list[str]] | None = None,
                 timeout: timedelta = timedelta(minutes=10)):
        unknown = sorted(set(dist_checkpoints or {}) - set(DIST_ROLES))
        if unknown:
            raise ValueError(f"dist_checkpoints: unknown role {unknown[0]!r}; roles: {list(DIST_ROLES)}")
        if layer_spec not in LAYER_SPECS:
            raise ValueError(f"layer_spec={layer_spec!r}: choose from {LAYER_SPECS}")
        if sequence_parallel and tensor_parallel > 1 and layer_spec == "local":
            raise ValueError("sequence_parallel needs layer_spec='transformer_engine' (a GPU): megatron-core's local "
                             "layer spec has no sequence-parallel norm")
        if context_parallel > 1 and layer_spec == "local":
            raise ValueError("context_parallel > 1 needs layer_spec='transformer_engine' (a GPU): megatron-core's "
                             "local attention cannot split a sequence")
        super().__init__(parallelize_fn=_identity, timeout=timeout)
        self.layout = ParallelLayout(tensor=tensor_parallel, pipeline=pipeline_parallel, context=context_parallel,
                                     expert=expert_parallel, sequence_parallel=sequence_parallel)
        self.layer_spec, self.transformer_overrides = layer_spec, dict(transformer_overrides or {})
        self.distributed_optimizer = distributed_optimizer
        self.optimizer_overrides = {}
        if optimizer_overrides:
            self.optimizer_overrides = check_overrides(optimizer_overrides)
            if not distributed_optimizer:  # the Trainer's AdamW becomes rlflow's PrecisionAwareAdamW
                check_own(precision_dtypes(self.optimizer_overrides))
        self.dist_checkpoints = {role: str(path) for role, path in (dist_checkpoints or {}).items()}
        self.dist_checkpoint_prefix = dist_checkpoint_prefix
        if router_replay not in (False, True, "R2", "R3"):
            raise ValueError(f"router_replay={router_replay!r}: choose False, True (R2), 'R2' or 'R3'")
        self.router_replay = "R2" if router_replay is True else router_replay
        self.mtp = MTPOptions(**mtp) if isinstance(mtp, dict) else mtp  # a dict: from a config tree
        self.offload = {role: list(kinds) for role, kinds in (offload or {}).items() if kinds}
        for role, kinds in self.offload.items():
            if role not in DIST_ROLES or not set(kinds) <= set(OFFLOAD_KINDS):
                raise ValueError(f"offload={{{role!r}: {kinds}}}: roles {list(DIST_ROLES)}, kinds {list(OFFLOAD_KINDS)}")
        if self.offload and distributed_optimizer:
            raise ValueError("offload with distributed_optimizer=True: Megatron's distributed optimizer offloads with "
                             "optimizer_overrides={'optimizer_cpu_offload': True}; rlflow's offload moves the default "
                             "optimizer's tensors")
        self._offloader: Offloader | None = None
        self._optimizer_roles: dict[int, str | None] = {}
        self.loaded_policy_weights = False  # the policy started from a dist checkpoint: its engine needs them
        self._converted: list[nn.Module] = []  # the Megatron modules set up, for the distributed optimizer
        self._cpu_workarounds = None
        self._reduced: set[int] = set()  # optimizers whose gradients were reduced since the last backward
        self._checkpoint = None

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in (
            ("tensor_parallel", self.layout.tensor), ("pipeline_parallel", self.layout.pipeline),
            ("context_parallel", self.layout.context), ("expert_parallel", self.layout.expert)) if v > 1)
        extra = (", sequence_parallel=True" if self.layout.sequence_parallel else "") + (
            f", layer_spec={self.layer_spec!r}" if self.layer_spec != "local" else "") + (
            ", distributed_optimizer=True" if self.distributed_optimizer else "") + (
            f", dist_checkpoints={self.dist_checkpoints!r}" if self.dist_checkpoints else "") + (
            f", router_replay={self.router_replay!r}" if self.router_replay else "") + (
            f", mtp={self.mtp!r}" if self.mtp else "") + (f", offload={self.offload!r}" if self.offload else "")
        return f"MegatronStrategy({sizes or 'tensor_parallel=1'}{extra})"

    @property
    def model_parallel_size(self) -> int:
        """Consecutive ranks that hold one model replica and train on one batch (tensor x context x pipeline)."""
        return self.layout.model_parallel

    # ------------------------------------------------------------------ processes
    def setup_environment(self) -> None:
        super().setup_environment()  # starts the process group (gloo on CPU, NCCL on GPU)
        from megatron.core import parallel_state as ps

        if self.root_device.type == "cpu" and (self.distributed_optimizer or self.layer_spec != "local"):
            raise ValueError("distributed_optimizer=True and layer_spec='transformer_engine' need CUDA devices")

        self.layout.check_world(self.world_size)
        if ps.model_parallel_is_initialized():  # a second Trainer in this process
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=self.layout.tensor, pipeline_model_parallel_size=self.layout.pipeline,
            context_parallel_size=self.layout.context, expert_model_parallel_size=self.layout.expert,
            order="tp-cp-ep-pp-dp", create_gloo_process_groups=False,
            distributed_timeout_minutes=max(1, int(self._timeout.total_seconds() // 60)) if self._timeout else 30)
        if self.root_device.type == "cpu":
            self._cpu_workarounds = CPUWorkarounds()
            self._cpu_workarounds.install()
        else:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(torch.initial_seed() % 2**31)

        self._checkpoint = ShardedCheckpoint(self.root_device.type)
        self._offloader = Offloader(self.offload, self.root_device)

    def teardown(self) -> None:
        """Undo Megatron's process groups and the CPU workarounds. The process group stays (the Trainer, like
        Fabric, never tears it down; Fabric's own teardown would fail here on ``checkpoint_io``)."""
        from megatron.core import parallel_state as ps

        if self._cpu_workarounds is not None:
            self._cpu_workarounds.remove()
            self._cpu_workarounds = None
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()

    # ------------------------------------------------------------------ models
    def setup_module(self, module: nn.Module) -> nn.Module:
        """This rank's Megatron shard of a policy (``TokenLogProbs``) or critic (``ValueHeadModel``); any other
        module (a reward model) is placed whole on this rank's device."""
        from rlflow.models.critic import ValueHeadModel
        from rlflow.models.logprobs import TokenLogProbs

        if not isinstance(module, (TokenLogProbs, ValueHeadModel)):
            # e.g. a reward model (ModelReward shards under FSDP2): nothing trains it, so every rank holds it whole
            return module.to(self.root_device)
        if getattr(module, "sp_group", None) is not None:
            raise ValueError("Ulysses sequence parallelism (sequence_parallel_size) does not combine with the Megatron "
                             "strategy; use its tensor/context parallelism")
        hf_model = module.lm
        peft = type(hf_model).__module__.startswith("peft.")  # a LoRA policy: adapters beside Megatron's layers
        base = hf_model.get_base_model() if peft else hf_model
        if is_vision_language(base.config) and (peft or self.dist_checkpoints):
            raise ValueError(f"{base.config.model_type} under the Megatron strategy: "
                             + ("LoRA does not adapt a vision-language model's Megatron layers yet" if peft
                                else "dist checkpoints hold megatron-core's GPTModel weights only, not the "
                                "vision tower (start from the Hugging Face weights or an rlflow checkpoint)"))
        on_cpu = self.root_device.type == "cpu"
        trained = any(p.requires_grad for p in hf_model.parameters())
        replay = self.router_replay and trained and isinstance(module, TokenLogProbs) and architecture(base.config).moe
        overrides = self._overrides(base, on_cpu) | ({"moe_enable_routing_replay": True} if replay else {})
        mtp = self.mtp if trained and isinstance(module, TokenLogProbs) else None  # the policy's MTP layers (.mtp)
        if mtp is not None:
            if peft:
                raise ValueError("multi-token prediction (mtp) does not combine with LoRA under the Megatron strategy")
            overrides |= megatron_mtp.config_overrides(mtp, base.config)
        lm = MegatronLM(base, self.layout, self.layer_spec, on_cpu=on_cpu, overrides=overrides).to(self.root_device)
        if replay:
            lm.routing_replay = RoutingReplay(lm, lm.padding_idx if lm.padding_idx is not None else 0,
                                              self.router_replay)
        if peft:
            megatron_lora.attach(lm, hf_model)
        slots = lm_slots(lm)
        state = megatron_lora.base_state(hf_model) if peft else hf_model.state_dict()
        load_from_hf([(s.name, s) for s in slots], megatron_mtp.with_mtp_weights(state, base) if mtp else state)
        mark_split_parameters(slots)
        if mtp is not None:
            megatron_mtp.attach(lm, mtp, module)
        if isinstance(module, TokenLogProbs):
            converted = MegatronLogProbs(lm, module.temperature, module.chunk_tokens, module.remove_padding)
            # the Policy reads it through Fabric's wrapper, which forwards attribute reads to the module it was given
            module.replays_rollout_routing = converted.replays_rollout_routing
        else:
            converted = MegatronValueModel(lm, module.value_head.to(self.root_device), module.remove_padding)
            if converted.value_head is None:
                module.value_head = None  # not on this pipeline stage

        check_coverage(converted, module_slots(converted))
        role = "critic" if isinstance(module, ValueHeadModel) else "policy" if trained else "reference"
        if role in self.dist_checkpoints:  # verl's use_dist_checkpointing: megatron-core's weights over the HF ones
            dist_checkpoint.load(converted, self.dist_checkpoints[role], self.dist_checkpoint_prefix)
            self.loaded_policy_weights |= role == "policy"
        if not trained:
            converted.requires_grad_(False)  # a frozen reference stays frozen
        elif peft:  # only the adapter trains (and a critic's value head, new)
            lm.requires_grad_(False)
            lm.lora.requires_grad_(True)
        # Fabric keeps the module it was given as the "original" (its parameters() and attribute lookups go
        # there): its Hugging Face model is replaced by the Megatron shard so both views hold the same weights.
        module.lm = lm
        self._converted.append(converted)
        # read by rlflow.weights.full_weight_buckets (and, with LoRA, rlflow.models.lora.merged_weight_buckets)
        hf_model.weight_buckets = (WeightExporter(*megatron_lora.export_slots(slots, lm.lora)) if peft
                                   else WeightExporter(megatron_mtp.engine_slots(slots))).buckets
        hf_model.to("meta")  # the Hugging Face tensors are not needed any more
        base.tie_weights()  # .to("meta") unties them; weight sync names a tied embedding's aliases (lm_head.weight)
        if role in self.offload:
            self._offloader.add_module(role, converted)
            if role == "policy":
                hf_model.weight_buckets = self._exported_by_policy(hf_model.weight_buckets)
        return converted

    def _exported_by_policy(self, buckets: Callable) -> Callable:
        """The policy's weight export with its offloaded tensors on the device; everything offloaded after it (the
        end of the Trainer's RL step, as verl offloads after syncing the rollout)."""
        def exported(*args, **kwargs):
            self._offloader.use("policy")
            try:
                yield from buckets(*args, **kwargs)
            finally:
                self._offloader.offload_all()

        return exported

    def _use(self, optimizer: Optimizer) -> None:
        """The role the optimizer trains is about to reduce, clip or step: its tensors onto the device."""
        if self._offloader is not None and self._offloader.modules:
            self._offloader.use(self._optimizer_roles.get(id(optimizer)))

    def _overrides(self, hf_model: nn.Module, on_cpu: bool) -> dict:
        """The ``TransformerConfig`` overrides; gradient checkpointing on the Hugging Face model becomes
        Megatron's full recomputation, which needs CUDA (it saves and restores CUDA RNG states)."""
        overrides = dict(self.transformer_overrides)
        if activation_checkpointing(hf_model) and not any(k.startswith("recompute") for k in overrides):
            if on_cpu:
                from lightning_fabric.utilities import rank_zero_warn

                rank_zero_warn("gradient checkpointing is off under the Megatron strategy on CPU: Megatron's "
                               "recomputation saves CUDA RNG states")
            else:
                overrides |= {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
        return overrides

    # ------------------------------------------------------------------ gradients and steps
    def backward(self, tensor, module, *args, **kwargs) -> None:
        super().backward(tensor, module, *args, **kwargs)
        self._reduced.clear()

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if not self.distributed_optimizer:
            dtypes = precision_dtypes(self.optimizer_overrides)
            if dtypes is not None and getattr(self.precision, "scaler", None) is not None:
                raise ValueError("use_precision_aware_optimizer with float16 mixed precision: its gradient scaler "
                                 "unscales param.grad, not the precision-aware optimizer's main_grad; use bf16-mixed "
                                 "or 32-true")
            optimizer = optimizer if dtypes is None else PrecisionAwareAdamW.replacing(optimizer, dtypes)
            if self._offloader is not None:
                self._optimizer_roles[id(optimizer)] = self._offloader.add_optimizer(optimizer)
            return optimizer

        return DistributedOptimizer(optimizer, self._converted, self.layout.model_parallel, self.optimizer_overrides)

    def _finalize(self, optimizer: Optimizer) -> list[nn.Parameter]:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if id(optimizer) not in self._reduced:
            reduce_gradients(params)
            self._reduced.add(id(optimizer))
        return params

    def clip_gradients_norm(self, module, optimizer: Optimizer, max_norm, norm_type=2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        if isinstance(optimizer, DistributedOptimizer):
            return optimizer.clip(float(max_norm))
        self._use(optimizer)
        self.precision.unscale_gradients(optimizer)
        params = self._finalize(optimizer)
        norm = global_grad_norm(params, float(norm_type))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of the gradients is {norm.item()}")
        clip_(params, float(max_norm), norm)
        return norm

    def clip_gradients_value(self, module, optimizer: Optimizer, clip_val) -> None:
        self._use(optimizer)
        self.precision.unscale_gradients(optimizer)
        for grad in map(main_grad, self._finalize(optimizer)):
            if grad is not None:
                grad.clamp_(-clip_val, clip_val)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        if not isinstance(optimizer, DistributedOptimizer):  # that one reduces its own gradients
            self._use(optimizer)
            self._finalize(optimizer)  # no-op when clip_gradients already reduced them
        return super().optimizer_step(optimizer, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path, state: dict, storage_options: Any | None = None,
                        filter: dict[str, Callable] | None = None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError("the Megatron strategy saves whole sharded checkpoints (no storage_options, no filter)")
        self._offloader.load_all()
        try:
            self._checkpoint.save(Path(self.broadcast(str(path))), state, self.global_rank)
        finally:
            self._offloader.offload_all()

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: bool | None = None) -> dict:
        if not isinstance(state, dict) or not state:
            raise ValueError("the Megatron strategy loads into a state dict holding the modules it set up")
        self._offloader.load_all()
        try:
            return self._checkpoint.load(Path(self.broadcast(str(path))), state, strict)
        finally:
            self._offloader.offload_all()
