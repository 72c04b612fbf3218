"""Liger kernels (verl's ``model.use_liger``): the liger-kernel package's Triton kernels patched into a
transformers model (RMSNorm, RoPE, SwiGLU), as verl does. Triton runs them on CUDA GPUs only.

rlflow computes log-probs with its own chunked head (``rlflow.models.logprobs``), so Liger's cross-entropy
kernels are left off. liger-kernel patches the model type's transformers classes too, so every model of that
type built afterwards in the process (the critic, a reference) gets its kernels as well.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

INSTALL = 'pip install -e ".[liger]" (the liger-kernel package) on a machine with a CUDA GPU'


def liger_missing(*, need_cuda: bool = True) -> str | None:
    """Why Liger kernels cannot run here (naming what they need), or None when they can."""
    if need_cuda and not torch.cuda.is_available():
        return "Liger kernels are Triton kernels for CUDA GPUs, and torch sees none here"
    if importlib.util.find_spec("liger_kernel") is None:
        return f"the liger-kernel package is not installed: {INSTALL}"
    return None


def apply_liger(model: nn.Module) -> nn.Module:
    """Patch Liger's kernels into ``model`` (in place); a model type liger-kernel has none for is an error."""
    missing = liger_missing(need_cuda=False)  # patching needs the package; running needs CUDA (the caller's check)
    if missing is not None:
        raise RuntimeError(f"use_liger=True: {missing}")
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(f"use_liger=True: liger-kernel has no kernels for model type {model_type!r}; it has "
                         f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}")
    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, fused_linear_cross_entropy=False)
    return model
