"""Megatron's distributed optimizer behind the torch optimizer the Trainer holds (GPU only).

``MegatronStrategy(distributed_optimizer=True)`` replaces the Trainer's AdamW (its ``lr``, ``betas``,
``eps`` and ``weight_decay`` carry over, weight decay on every parameter as with AdamW; ``optimizer_overrides``
set further ``OptimizerConfig`` fields, e.g. CPU offload or the precision-aware optimizer's dtypes, which need
Transformer Engine) by megatron-core's ``DistributedDataParallel`` +
distributed optimizer: float32 master weights and moments sharded over the
data-parallel ranks, gradients reduce-scattered into contiguous buffers. Megatron's optimizer refuses
CPU tensors, so this path only runs on GPUs; ``tests/megatron/test_gpu.py`` checks it against the default
optimizer (it did not run in the session that wrote it: no GPU).

:class:`DistributedOptimizer` is a ``torch.optim.Optimizer`` subclass so that Fabric and the Trainer's
``LambdaLR`` take it: ``param_groups`` are Megatron's (setting ``lr`` there is what its step reads),
``zero_grad`` also empties the gradient buffers, and the strategy's ``clip_gradients`` calls
:meth:`clip` (reduce, measure over all shards, clip) before :meth:`step`.

Gradient scale: Megatron's reduction averages over the ``DP`` data-parallel ranks; the Trainer's losses
expect a division by all ``W`` processes (``rlflow.strategies.megatron.grads``), so the gradients are then
scaled by ``DP / W`` (one over the model-parallel size).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from torch import nn

from rlflow.strategies.megatron.precision_aware import SWITCH, as_megatron, precision_dtypes  # noqa: F401 (as_megatron: re-exported)

# OptimizerConfig fields rlflow fills from the Trainer's optimizer and its own clipping: not overridable
OWN_FIELDS = ("optimizer", "lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "decoupled_weight_decay",
              "use_distributed_optimizer", "clip_grad", "params_dtype")


def check_overrides(overrides: dict | None) -> dict:
    """``overrides`` as megatron-core ``OptimizerConfig`` fields (verl's ``optim.override_optimizer_config``): an
    unknown field, or one rlflow sets from the optimizer itself, is a ``ValueError`` naming it."""
    from megatron.core.optimizer import OptimizerConfig

    fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    for name in overrides or {}:
        if name not in fields:
            raise ValueError(f"{name!r} is not a field of megatron-core's OptimizerConfig (its fields: "
                             f"{', '.join(sorted(fields - set(OWN_FIELDS)))})")
        if name in OWN_FIELDS:
            raise ValueError(f"{name!r} comes from the Trainer's optimizer and clipping (lr, weight decay, betas, "
                             "eps, max_grad_norm), not from the overrides")
    precision_dtypes(overrides or {})  # the precision-aware dtypes: known, and only with the switch on
    return dict(overrides or {})


def optimizer_config(group: dict, overrides: dict | None = None):
    """megatron-core's ``OptimizerConfig`` for an Adam/AdamW param group: its lr, betas, eps and weight decay
    (decoupled, as AdamW), float32, no clipping of its own (the strategy clips), then ``overrides``
    (e.g. ``optimizer_cpu_offload``, ``optimizer_offload_fraction``, ``overlap_cpu_optimizer_d2h_h2d``)."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=group["lr"], weight_decay=group["weight_decay"], adam_beta1=group["betas"][0],
        adam_beta2=group["betas"][1], adam_eps=group["eps"], decoupled_weight_decay=True,
        use_distributed_optimizer=True, clip_grad=0.0, params_dtype=torch.float32,
        **as_megatron(check_overrides(overrides)))


def reduces_in_fp32(overrides: dict | None) -> bool:
    """Megatron's DDP ``grad_reduce_in_fp32``: off when the precision-aware optimizer keeps lower-precision main
    gradients (as verl sets it from ``main_grads_dtype``)."""
    dtypes = precision_dtypes(overrides or {})
    return dtypes is None or dtypes["main_grads_dtype"] == torch.float32


class DistributedOptimizer(torch.optim.Optimizer):
    """Megatron's DDP + distributed optimizer for the Megatron models whose parameters ``optimizer`` holds."""

    def __init__(self, optimizer: torch.optim.Optimizer, models: list[nn.Module], model_parallel_size: int,
                 overrides: dict | None = None):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import get_megatron_optimizer

        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or len(optimizer.param_groups) != 1:
            raise ValueError("distributed_optimizer=True takes the hyperparameters of one Adam/AdamW param group; got "
                             f"{type(optimizer).__name__} with {len(optimizer.param_groups)} groups")
        mine = {id(p) for p in optimizer.param_groups[0]["params"]}
        gpts = [m.lm.gpt for m in models if any(id(p) in mine for p in m.lm.gpt.parameters())]
        covered = {id(p) for gpt in gpts for p in gpt.parameters()}
        if mine - covered:
            raise ValueError("distributed_optimizer=True: the optimizer holds parameters outside the Megatron models "
                             "(a critic's value head?); use the default optimizer")
        group = optimizer.param_groups[0]
        if (overrides or {}).get(SWITCH) and not (overrides or {}).get("optimizer_cpu_offload") \
                and importlib.util.find_spec("transformer_engine") is None:
            raise ValueError(f"{SWITCH}=True with distributed_optimizer=True: megatron-core builds it from Transformer "
                             "Engine's FusedAdam; install transformer-engine, or train without the distributed "
                             "optimizer (rlflow's PrecisionAwareAdamW keeps the same dtypes)")
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=reduces_in_fp32(overrides),
                                                   overlap_grad_reduce=False,
                                                   use_distributed_optimizer=True)
        self.ddps = [DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt) for gpt in gpts]
        config = optimizer_config(group, overrides)
        # config_overrides={}: Megatron's default exempts biases and norms from weight decay; AdamW does not
        self.inner = get_megatron_optimizer(config, self.ddps, config_overrides={})
        self.model_parallel_size = model_parallel_size
        self.defaults, self.state = dict(group), {}
        self._ready = False

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def clip(self, max_norm: float) -> torch.Tensor:
        """Reduce-scatter the gradients, copy them to the master weights, clip by the global norm; return it."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(self.ddps)
        for ddp in self.ddps:
            ddp.scale_gradients(1.0 / self.model_parallel_size)
        self.inner.prepare_grads()
        norm = self.inner.clip_grad_norm(max_norm) if max_norm != float("inf") else self.inner.get_grad_norm()
        self._ready = True
        return torch.as_tensor(float(norm))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("the distributed optimizer takes no closure")
        if not self._ready:
            self.clip(float("inf"))
        self._ready = False
        return self.inner.step_with_ready_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for ddp in self.ddps:
            ddp.zero_grad_buffer()
        self.inner.zero_grad(set_to_none)

    def state_dict(self):
        raise NotImplementedError("checkpoints of Megatron's distributed optimizer are not supported yet: train with "
                                  "save_every=0 or with the default optimizer (distributed_optimizer=False)")

    def load_state_dict(self, state_dict) -> None:
        self.state_dict()
