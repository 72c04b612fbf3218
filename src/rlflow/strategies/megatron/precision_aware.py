"""Megatron's precision-aware optimizer, for every device: AdamW whose gradients, master weights and moments are
stored in the dtypes megatron-core's ``OptimizerConfig`` names (verl's ``optim.use_precision_aware_optimizer``).

megatron-core builds its precision-aware optimizer only inside its distributed optimizer, from Transformer Engine's
``FusedAdam`` (``master_weight_dtype``, ``exp_avg_dtype``, ``exp_avg_sq_dtype``, ``use_decoupled_grad``): CUDA and
the transformer-engine package. ``MegatronStrategy(distributed_optimizer=True)`` passes the settings there
(:func:`rlflow.strategies.megatron.distopt.optimizer_config`); otherwise the strategy trains with
:class:`PrecisionAwareAdamW`, which keeps the same four dtypes on any device:

- ``main_grads_dtype``: the gradient is accumulated over micro-batches in ``param.main_grad`` (Megatron's name for
  the gradient buffer) in that dtype (``param.main_grads_dtype`` marks such a parameter): after each backward a
  hook adds ``param.grad`` into it (rounding) and frees ``param.grad``. The strategy reduces, measures and clips ``main_grad`` (:mod:`.grads`). When it is the parameter's
  dtype, ``param.grad`` is used as is.
- ``main_params_dtype`` (fp32 or fp16, as Transformer Engine's ``master_weight_dtype``): the weights the update is
  applied to. The parameter's own dtype (rlflow's Megatron parameters are float32): the parameter itself; fp16: a
  copy in ``state["main_param"]``, updated and copied into the parameter.
- ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (fp32, bf16, fp16 or fp8): Adam's moments, stored in these dtypes.

Each step computes in float32 with ``torch.optim.adam.adam`` (decoupled weight decay: AdamW's arithmetic, op for op),
then rounds what it stores to its dtype (round to nearest even). With every dtype float32 it *is* torch's AdamW.
As in Transformer Engine's ``FusedAdam``, bf16 is a plain cast, while fp16 and fp8 (E4M3, Megatron's ``uint8``)
tensors are stored divided by a per-tensor scale, ``absmax / range`` (range: half of fp16's largest value, 448 for
E4M3), kept as ``state[name + "_scale"]``: without it fp16's ``exp_avg_sq`` (squared gradients, ~1e-10) underflows
to zero and the update explodes. An fp8 ``exp_avg_sq`` is refused here even so (:func:`check_own`). Spellings: verl's ``fp32`` / ``bf16`` / ``fp16`` / ``fp8``, the long names, or torch
dtypes (``torch.uint8`` for fp8, as megatron-core's ``OptimizerConfig`` takes it).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim.adam import adam

FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
SWITCH = "use_precision_aware_optimizer"
FP8 = torch.float8_e4m3fn
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "32": torch.float32,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16, "16": torch.float16,
          "fp8": FP8, "uint8": FP8, "float8_e4m3fn": FP8}
CHOICES = {"main_grads_dtype": ("fp32", "bf16"), "main_params_dtype": ("fp32", "fp16"),  # as Megatron-LM / TE allow
           "exp_avg_dtype": ("fp32", "bf16", "fp16", "fp8"), "exp_avg_sq_dtype": ("fp32", "bf16", "fp16", "fp8")}
RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0, FP8: 448.0}  # Transformer Engine's per-tensor ranges


def to_dtype(field: str, value) -> torch.dtype:
    """verl's / megatron-core's spelling of ``field``'s dtype (``"bf16"``, ``torch.bfloat16``, ...) as a torch dtype
    (fp8: ``float8_e4m3fn``); a ``ValueError`` naming ``field`` and its choices otherwise."""
    dtype = DTYPES.get(str(value).removeprefix("torch.").lower())
    if dtype is None or dtype not in {DTYPES[c] for c in CHOICES[field]}:
        raise ValueError(f"{field}={value!r}: choose {', '.join(CHOICES[field])}")
    return dtype


def precision_dtypes(overrides: dict) -> dict[str, torch.dtype] | None:
    """The four dtypes ``overrides`` (megatron-core ``OptimizerConfig`` fields) ask for, ``None`` when
    ``use_precision_aware_optimizer`` is off; a dtype other than float32 without it is a ``ValueError`` (as
    megatron-core asserts)."""
    dtypes = {f: to_dtype(f, overrides.get(f, torch.float32)) for f in FIELDS}
    if overrides.get(SWITCH):
        return dtypes
    lowered = [f"{f}={overrides[f]!r}" for f in FIELDS if dtypes[f] != torch.float32]
    if lowered:
        raise ValueError(f"{', '.join(lowered)} needs {SWITCH}=True (megatron-core keeps float32 optimizer tensors "
                         "otherwise)")
    return None


def check_own(dtypes: dict[str, torch.dtype] | None) -> None:
    """The dtypes :class:`PrecisionAwareAdamW` refuses (Transformer Engine's ``FusedAdam`` takes them): an fp8 second
    moment. E4M3 with one scale per tensor keeps ~6 decades below the largest value; squared gradients span more,
    so the smallest become zero, ``sqrt(0) + eps`` divides and the update explodes (a tiny Llama trained 8 steps
    ends 35x its float32 update away from AdamW's)."""
    if dtypes is not None and dtypes["exp_avg_sq_dtype"] is FP8:
        raise ValueError("exp_avg_sq_dtype=fp8: rlflow's precision-aware AdamW stores the second moment in fp32, bf16 "
                         "or fp16 (fp8 flushes small squared gradients to zero); Transformer Engine's FusedAdam takes "
                         "it: MegatronStrategy(distributed_optimizer=True) on CUDA with transformer-engine installed")


def as_megatron(overrides: dict) -> dict:
    """``overrides`` with the dtype fields as megatron-core's ``OptimizerConfig`` takes them: torch dtypes (it compares
    them with ``torch.float32``; a config file gives strings), fp8 as ``torch.uint8``."""
    megatron = {k: to_dtype(k, v) if k in FIELDS else v for k, v in overrides.items()}
    return {k: torch.uint8 if v is FP8 else v for k, v in megatron.items()}


def trained_bytes(dtypes: dict[str, torch.dtype] | None, param_dtype: torch.dtype = torch.float32) -> int:
    """Bytes per trained parameter: the weight, its gradient, its master copy (when it has one) and two moments."""
    if dtypes is None:
        return 4 * param_dtype.itemsize
    master = 0 if dtypes["main_params_dtype"] == param_dtype else dtypes["main_params_dtype"].itemsize
    return (param_dtype.itemsize + dtypes["main_grads_dtype"].itemsize + master + dtypes["exp_avg_dtype"].itemsize
            + dtypes["exp_avg_sq_dtype"].itemsize)


def main_grad(p: Tensor) -> Tensor | None:
    """The gradient the optimizer steps with: ``p.main_grad`` when a :class:`PrecisionAwareAdamW` accumulates it,
    else ``p.grad``."""
    return p.main_grad if hasattr(p, "main_grads_dtype") else p.grad


def zero_main_grad(p: Tensor) -> None:
    """Give ``p`` a zero gradient where :func:`main_grad` reads it, in its dtype (collectives line up by dtype)."""
    if hasattr(p, "main_grads_dtype"):
        p.main_grad = torch.zeros_like(p, dtype=p.main_grads_dtype)
    else:
        p.grad = torch.zeros_like(p)


STORED = {"exp_avg": "exp_avg_dtype", "exp_avg_sq": "exp_avg_sq_dtype", "main_param": "main_params_dtype"}


def _load(state: dict, name: str) -> Tensor:
    """``state[name]`` in float32, its scale applied (the tensor itself when it is stored in float32)."""
    stored = state[name]
    scale = state.get(f"{name}_scale")
    return stored.float() if scale is None else stored.float() * scale


@torch.no_grad()
def _store(state: dict, name: str, value: Tensor) -> None:
    """Write the float32 ``value`` into ``state[name]``, scaled per tensor for fp16 and fp8 (see the module
    docstring)."""
    stored = state[name]
    if stored is value:
        return
    if stored.dtype in RANGE:
        scale = value.abs().max().float() / RANGE[stored.dtype]
        state[f"{name}_scale"] = scale
        value = value * torch.where(scale > 0, scale.reciprocal(), 0.0)
    stored.copy_(value)


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW with Megatron's precision-aware storage (see the module docstring); ``dtypes``: :data:`FIELDS`."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, **dtypes):
        unknown = sorted(set(dtypes) - set(FIELDS))
        if unknown:
            raise TypeError(f"PrecisionAwareAdamW takes no argument {unknown[0]!r} (its dtypes: {', '.join(FIELDS)})")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.dtypes = {f: to_dtype(f, dtypes.get(f, torch.float32)) for f in FIELDS}
        check_own(self.dtypes)
        self._hooks = []
        for p in self._params():
            if p.requires_grad and p.dtype != self.dtypes["main_grads_dtype"]:
                p.main_grads_dtype, p.main_grad = self.dtypes["main_grads_dtype"], None
                self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))

    @classmethod
    def replacing(cls, optimizer: torch.optim.Optimizer, dtypes: dict) -> PrecisionAwareAdamW:
        """The same parameters and hyperparameters as ``optimizer`` (an Adam/AdamW, decoupled weight decay as with
        megatron-core's ``adam``)."""
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(f"{SWITCH}=True replaces an Adam/AdamW optimizer (megatron-core's is Adam); got "
                             f"{type(optimizer).__name__}")
        if any(g["amsgrad"] or g["maximize"] for g in optimizer.param_groups):
            raise ValueError(f"{SWITCH}=True: megatron-core's Adam has no amsgrad or maximize")
        groups = [{k: g[k] for k in ("params", "lr", "betas", "eps", "weight_decay")} for g in optimizer.param_groups]
        return cls(groups, **dtypes)

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def _accumulate(self, p: Tensor) -> None:
        if p.main_grad is None:
            p.main_grad = p.grad.to(p.main_grads_dtype)
        else:
            p.main_grad.add_(p.grad)  # computed in float32, stored rounded to main_grads_dtype
        p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self._params():
            if getattr(p, "main_grad", None) is not None:
                if set_to_none:
                    p.main_grad = None
                else:
                    p.main_grad.zero_()

    @torch.no_grad()
    def _state(self, p: Tensor) -> dict:
        """``p``'s state, made (zero moments, the master copy) or brought back to the configured dtypes: a loaded
        checkpoint holds unscaled float32 values (:meth:`unscaled_state`)."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
        for name, field in STORED.items():
            dtype, value = self.dtypes[field], state.get(name)
            if name == "main_param" and dtype == p.dtype:
                state.pop(name, None)  # the parameter is its own master copy
                continue
            if value is not None and value.dtype == dtype and (dtype not in RANGE or f"{name}_scale" in state):
                continue  # already stored as configured
            if value is None:
                value = p.detach().float() if name == "main_param" else torch.zeros_like(p, dtype=torch.float32)
            state[name] = torch.empty_like(p, dtype=dtype)
            _store(state, name, value.float())
        return state

    def unscaled_state(self, p: Tensor) -> dict:
        """``p``'s state as float32 values (scales applied), as checkpoints hold it: independent of the per-tensor
        scales, so a run at another layout (other shards, other scales) loads it."""
        state = self.state.get(p, {})
        return {k: (_load(state, k) if k in STORED else v) for k, v in state.items() if not k.endswith("_scale")}

    def state_dict(self) -> dict:
        saved = super().state_dict()
        params = self._params()  # torch numbers the parameters in this order
        saved["state"] = {i: self.unscaled_state(params[i]) for i in saved["state"]}
        return saved

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                grad = main_grad(p)
                if grad is None:
                    continue
                state = self._state(p)
                names = [n for n in STORED if n in state]  # the moments, and the master weights when kept apart
                work = {n: _load(state, n) for n in names}  # float32 (the stored tensors themselves when float32)
                main = work.get("main_param", p)
                adam([main], [grad.float()], [work["exp_avg"]], [work["exp_avg_sq"]], [], [state["step"]],
                     foreach=False, decoupled_weight_decay=True, amsgrad=False, beta1=group["betas"][0],
                     beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                     maximize=False)
                for name in names:
                    _store(state, name, work[name])
                if main is not p:
                    p.copy_(_load(state, "main_param"))  # the parameter is its master copy's value
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """The float32 values of :meth:`state_dict`, stored back in the configured dtypes."""
        super().load_state_dict(state_dict)
        for p in self._params():
            if p in self.state:
                self._state(p)

    def state_bytes(self) -> int:
        """Bytes of the optimizer's tensors: moments, master weights and accumulated gradients (not ``param.grad``,
        which autograd owns)."""
        tensors = [t for s in self.state.values() for k, t in s.items() if k != "step"]
        tensors += [p.main_grad for p in self._params() if getattr(p, "main_grad", None) is not None]
        return sum(t.numel() * t.element_size() for t in tensors)
