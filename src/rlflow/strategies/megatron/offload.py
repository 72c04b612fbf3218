"""verl's Megatron CPU offload (``megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload``): a role's
parameters, gradients and optimizer states wait in (pinned) host memory while other roles run.

verl's workers (``verl/utils/megatron_utils.py``: ``offload_megatron_model_to_cpu``, ``load_megatron_model_to_gpu``,
``offload_megatron_optimizer``) offload after building a model and after each phase, and load before the next phase
that needs the tensors: a log-prob pass, the update, the weight export to the rollout. Here the strategy marks the
phases itself, without the Trainer's help (:class:`Offloader`):

- a role's tensors come onto the device when it is used: its module's forward (a log-prob or value pass, a
  micro-batch of its update), its gradients' reduction and clipping, its optimizer step, the policy's weight export;
- using one role sends the others' tensors to the host (the reference's after the old-log-prob pass starts, the
  critic's when the actor's update starts, ...), and so does the end of the policy's weight export, which ends the
  Trainer's RL step: between steps every offloading role is on the host;
- a checkpoint's save and load bring every role onto the device, then back.

Moves keep each ``Parameter`` object (``param.data`` is swapped), so the optimizer's state (keyed by parameters) and
Fabric's wrappers still hold them; a parameter keeps one pinned host buffer, reused at every offload (as verl's
``cpu_data``), so host memory holds one copy. Gradients (``param.grad``, and ``param.main_grad`` of the
precision-aware optimizer) move with ``grads``; the Trainer frees them after each optimizer step, so between phases
there are usually none. Optimizer states move with ``optimizer``: the tensors of each parameter's state that have its
shape (Adam's moments, master weights), not scalars such as ``step``. On a CPU device every move is a no-op: the
tensors already live in host memory.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

KINDS = ("params", "grads", "optimizer")
HOST = torch.device("cpu")


def _pinned_like(t: Tensor) -> Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=HOST, pin_memory=torch.cuda.is_available())


@torch.no_grad()
def params_to(params: Iterable[nn.Parameter], device: torch.device) -> None:
    """Each parameter's data onto ``device`` (the host: into its pinned buffer, made once), the object kept."""
    for p in params:
        if p.device == device:
            continue
        if device == HOST:
            host = getattr(p, "host_buffer", None)
            if host is None or host.shape != p.shape or host.dtype != p.dtype:
                host = p.host_buffer = _pinned_like(p)
            host.copy_(p.data)
            p.data = host
        else:
            p.data = p.data.to(device, non_blocking=True)


def _moved(t: Tensor, device: torch.device) -> Tensor:
    if t.device == device:
        return t
    return _pinned_like(t).copy_(t) if device == HOST else t.to(device, non_blocking=True)


@torch.no_grad()
def grads_to(params: Iterable[nn.Parameter], device: torch.device) -> None:
    """Each parameter's gradient (``grad``; ``main_grad`` when the precision-aware optimizer keeps one) onto
    ``device``."""
    for p in params:
        if p.grad is not None:
            p.grad = _moved(p.grad, device)
        if getattr(p, "main_grad", None) is not None:
            p.main_grad = _moved(p.main_grad, device)


@torch.no_grad()
def optimizer_state_to(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """The optimizer's per-element state tensors (those shaped as their parameter) onto ``device``."""
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, Tensor) and value.shape == p.shape:
                state[key] = _moved(value, device)


class Offloader:
    """Which roles offload what (``{"policy": {"params", "grads", "optimizer"}, "reference": {"params"}, ...}``)
    and where each role's tensors are now; ``device``: the strategy's."""

    def __init__(self, roles: dict[str, Iterable[str]], device: torch.device):
        self.roles = {role: set(kinds) for role, kinds in roles.items() if kinds}
        for role, kinds in self.roles.items():
            unknown = kinds - set(KINDS)
            if unknown:
                raise ValueError(f"offload[{role!r}]: unknown {sorted(unknown)}; choose from {KINDS}")
        self.device = device
        self.modules: dict[str, nn.Module] = {}
        self.optimizers: dict[str, list[torch.optim.Optimizer]] = {}
        self.on_host: set[str] = set()  # roles whose offloaded tensors are in host memory now

    def add_module(self, role: str, module: nn.Module) -> None:
        """Track ``module`` (its forward uses ``role``) and send it to the host, as verl does after building."""
        if role not in self.roles:
            return
        self.modules[role] = module
        module.register_forward_pre_hook(lambda *_: self.use(role))
        self.offload(role)

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> str | None:
        """Track ``optimizer`` under the role whose module holds its parameters; that role (or ``None``)."""
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        role = next((r for r, m in self.modules.items() if any(id(p) in mine for p in m.parameters())), None)
        if role is not None:
            self.optimizers.setdefault(role, []).append(optimizer)
        return role

    def _move(self, role: str, device: torch.device) -> None:
        kinds, params = self.roles[role], list(self.modules[role].parameters())
        if "params" in kinds:
            params_to(params, device)
        if "grads" in kinds:
            grads_to(params, device)
        if "optimizer" in kinds:
            for optimizer in self.optimizers.get(role, []):
                optimizer_state_to(optimizer, device)

    def offload(self, role: str) -> None:
        if role in self.modules and role not in self.on_host:
            self._move(role, HOST)
            self.on_host.add(role)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def load(self, role: str) -> None:
        if role in self.on_host:
            self._move(role, self.device)
            self.on_host.discard(role)

    def use(self, role: str | None) -> None:
        """``role`` is about to run: its tensors onto the device, every other role's to the host."""
        for other in self.modules:
            if other != role:
                self.offload(other)
        if role is not None:
            self.load(role)

    def load_all(self) -> None:
        for role in list(self.on_host):
            self.load(role)

    def offload_all(self) -> None:
        self.use(None)
