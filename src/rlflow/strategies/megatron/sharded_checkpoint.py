"""Megatron checkpoints in transformers' naming, resumable at any parallel layout.

A checkpoint is a ``torch.distributed.checkpoint`` folder, laid out as Fabric's FSDP2 checkpoints:
``{"policy": {"lm.<transformers name>": weight}, "optimizer": {"state": {"lm.<name>": {"exp_avg": ...,
"exp_avg_sq": ..., "step": ...}}, "param_groups": [...]}}`` plus ``meta.pt`` (everything else, from
rank 0). Each rank writes its blocks as DTensor shards (:mod:`.slots`) of the full transformers tensors,
so the files do not depend on the layout that wrote them: a run at another tensor / pipeline / data /
expert layout reads the blocks it needs, and ``rlflow export`` turns the folder into a Hugging Face
model as it does for FSDP2 checkpoints. Optimizer states are elementwise per parameter, so they are
cut into the same blocks as their weights.

A checkpoint that does not match the model (another architecture or size) is refused before anything
is read, naming the keys that differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.optim import Optimizer

from rlflow.strategies.megatron.distopt import DistributedOptimizer
from rlflow.strategies.megatron.heads import MegatronLogProbs, MegatronValueModel
from rlflow.strategies.megatron.slots import EXPERT, TENSOR, Slot, group_ranks, module_slots
from rlflow.strategies.megatron.weight_buckets import gather_full

META_FILE = "meta.pt"  # Fabric's name for the non-tensor part of a sharded checkpoint


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


class ShardedCheckpoint:
    """Saves and loads the Megatron modules and optimizers of a Fabric ``state`` dict (see the module docstring)."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self._meshes: dict[str, Any] = {}
        self._blockwise: set[tuple[str, str, str]] = set()  # (optimizer, slot key, state name) cut like the weights

    def _mesh(self, group_name: str):
        if group_name not in self._meshes:
            from megatron.core import parallel_state as ps
            from torch.distributed.device_mesh import DeviceMesh

            group = {TENSOR: ps.get_tensor_model_parallel_group,
                     EXPERT: ps.get_expert_model_parallel_group}[group_name]()
            self._meshes[group_name] = DeviceMesh.from_group(group, self.device_type)
        return self._meshes[group_name]

    def _as_saved(self, slot: Slot, block: Tensor):
        """The block as a shard of the full tensor (a plain tensor when this rank holds all of it)."""
        from torch.distributed.tensor import DTensor, Shard

        rank, size = group_ranks(slot)
        if slot.dim is None or size == 1:
            return block
        if slot.sections:  # a rank's block is not one shard of the full tensor (Qwen3.5's in_proj_qkv): saved whole
            return gather_full([slot], [block])[0]
        return DTensor.from_local(block.contiguous(), self._mesh(slot.group), [Shard(slot.dim)], run_check=False,
                                  shape=torch.Size(slot.shape), stride=_contiguous_stride(slot.shape))

    # ------------------------------------------------------------------ building the state dicts
    def _parts(self, state: dict) -> tuple[dict, dict, dict]:
        """(modules, optimizers, rest) of a Fabric state dict; modules are those with Megatron slots."""
        for value in state.values():
            if isinstance(value, DistributedOptimizer):
                value.state_dict()  # refuses, with the reason
        modules = {k: v for k, v in state.items() if isinstance(v, (MegatronLogProbs, MegatronValueModel))}
        optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
        other = [k for k, v in state.items() if isinstance(v, nn.Module) and k not in modules]
        if other:
            raise TypeError(f"the Megatron strategy saves modules it set up; {other} are other modules")
        rest = {k: v for k, v in state.items() if k not in modules and k not in optimizers}
        return modules, optimizers, rest

    def _all_slots(self, modules: dict) -> list[tuple[str, Slot]]:
        return [(key, slot) for m in modules.values() for key, slot in module_slots(m)]

    def _module_state(self, module: nn.Module, fresh: bool) -> dict:
        out = {}
        for key, slot in module_slots(module):
            if not fresh and not slot.primary:
                continue
            block = slot.read([p.detach() for p in slot.params])
            out[key] = self._as_saved(slot, torch.empty_like(block) if fresh else block)
        return out

    def _optimizer_slots(self, optimizer: Optimizer, slots: list, primary_only: bool) -> list[tuple[str, Slot]]:
        """The slots whose parameters this optimizer updates."""
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [(key, slot) for key, slot in slots if all(id(p) in mine for p in slot.params)
                and (slot.primary or not primary_only)]

    def _optimizer_state(self, optimizer: Optimizer, slots: list) -> dict:
        state = {}
        updated = self._optimizer_slots(optimizer, slots, primary_only=True)
        for key, slot in updated:
            # float32 values of a precision-aware optimizer's scaled states (.precision_aware), else the state itself
            per_param = [optimizer.unscaled_state(p) if hasattr(optimizer, "unscaled_state")
                         else optimizer.state.get(p, {}) for p in slot.params]
            if not per_param[0]:
                continue
            entry = {}
            for name, value in per_param[0].items():
                if isinstance(value, Tensor) and value.shape == slot.params[0].shape:
                    entry[name] = self._as_saved(slot, slot.read([s[name] for s in per_param]))
                else:
                    entry[name] = value
            state[key] = entry
        # param_groups name each parameter once (an alias such as a tied lm_head.weight is not listed), as
        # torch.distributed.checkpoint's get_optimizer_state_dict does, so one-process and FSDP2 runs load them
        named, seen = [], set()
        for key, slot in updated:
            identity = (tuple(map(id, slot.params)), slot.read)
            if identity not in seen:
                seen.add(identity)
                named.append((key, slot))
        groups = []
        for g in optimizer.param_groups:
            ids = {id(p) for p in g["params"]}
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [key for key, slot in named if id(slot.params[0]) in ids]})
        return {"state": state, "param_groups": groups}

    # ------------------------------------------------------------------ save / load
    def save(self, path: Path, state: dict, rank: int) -> None:
        modules, optimizers, rest = self._parts(state)
        slots = self._all_slots(modules)
        converted = {k: self._module_state(m, fresh=False) for k, m in modules.items()}
        converted |= {k: self._optimizer_state(o, slots) for k, o in optimizers.items()}
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        dcp.save(converted, checkpoint_id=path)
        if rank == 0:
            torch.save(rest, path / META_FILE)

    def load(self, path: Path, state: dict, strict: bool = True) -> dict:
        """Restore modules and optimizers in place; put the rest of ``state``'s keys back; return what is left."""
        if not (path.is_dir() and (path / META_FILE).is_file()):
            raise ValueError(f"{path} is not a sharded checkpoint: the Megatron strategy resumes the folders written "
                             "by the Megatron (or FSDP2) strategy, at any parallel layout; a single-file checkpoint of "
                             "a one-process run cannot be resumed with Megatron")
        modules, optimizers, rest = self._parts(state)
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        slots = self._all_slots(modules)
        targets = {k: self._module_state(m, fresh=True) for k, m in modules.items()}
        self._check_model(saved, targets)
        opt_targets = {k: self._optimizer_targets(o, slots, saved, k) for k, o in optimizers.items()}
        dcp.load(targets | {k: v for k, v in opt_targets.items() if v["state"]}, checkpoint_id=path)
        with torch.no_grad():
            for key, module in modules.items():
                for name, slot in module_slots(module):
                    slot.write([p.data for p in slot.params], _local(targets[key][name], slot))
            for key, optimizer in optimizers.items():
                self._restore_optimizer(optimizer, slots, opt_targets[key], key)
        meta = torch.load(path / META_FILE, weights_only=False)  # our own file
        missing = [k for k in rest if k not in meta]
        if strict and missing:
            raise KeyError(f"{path}: the checkpoint has no {missing}")
        for k in rest:
            if k in meta:
                state[k] = meta.pop(k)
        return meta

    def _check_model(self, saved: dict, targets: dict) -> None:
        """Refuse, on every rank, a checkpoint whose weights are not exactly the model's (names and shapes)."""
        expected = {f"{m}.{k}": tuple(v.shape) for m, entries in targets.items() for k, v in entries.items()}
        if dist.is_initialized() and dist.get_world_size() > 1:  # each rank holds some stages' weights
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, expected)
            expected = {k: v for part in everyone for k, v in part.items()}
        problems = []
        for key, shape in expected.items():
            md = saved.get(key)
            if md is None:
                problems.append(f"{key} is missing")
            elif tuple(md.size) != shape:
                problems.append(f"{key} is {tuple(md.size)}, the model's is {shape}")
        prefixes = tuple(f"{m}." for m in targets)
        problems += [f"{k} is not in the model" for k in saved if k.startswith(prefixes) and k not in expected]
        if problems:
            raise ValueError("the checkpoint's state_dict was written for another model: " + "; ".join(problems[:5])
                             + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))

    def _optimizer_targets(self, optimizer: Optimizer, slots: list, saved: dict, opt_key: str) -> dict:
        state = {}
        for key, slot in self._optimizer_slots(optimizer, slots, primary_only=False):
            prefix = f"{opt_key}.state.{key}."
            entry = {}
            for name in {k.removeprefix(prefix) for k in saved if k.startswith(prefix)}:
                md = saved[prefix + name]
                size = tuple(getattr(md, "size", ()))
                if size == slot.shape:  # a per-element state (exp_avg, ...): this rank's block of it
                    block = slot.read([p.detach() for p in slot.params])
                    entry[name] = self._as_saved(slot, torch.empty_like(block))
                    self._blockwise.add((opt_key, key, name))
                elif hasattr(md, "size"):
                    entry[name] = torch.empty(size, dtype=md.properties.dtype)
            if entry:
                state[key] = entry
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def _restore_optimizer(self, optimizer: Optimizer, slots: list, loaded: dict, opt_key: str) -> None:
        for key, slot in self._optimizer_slots(optimizer, slots, primary_only=False):
            entry = loaded["state"].get(key)
            if not entry:
                continue
            for p in slot.params:
                optimizer.state.setdefault(p, {})
            for name, value in entry.items():
                if (opt_key, key, name) in self._blockwise:
                    value = _local(value, slot)
                    tensors = [optimizer.state[p].setdefault(name, torch.zeros_like(p)) for p in slot.params]
                    slot.write(tensors, value)
                else:
                    value = _local(value)
                    for p in slot.params:
                        optimizer.state[p][name] = value.clone()
        if loaded["state"]:
            for group, saved in zip(optimizer.param_groups, loaded["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})


def _local(value, slot: Slot | None = None):
    """This rank's block of a loaded value: a shard's local tensor, or the block of a sectioned slot saved whole."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if slot is not None and slot.sections and slot.dim is not None:
        return slot.block_of(value, *group_ranks(slot))
    return value

