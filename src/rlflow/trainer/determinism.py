"""Bitwise-reproducible runs: verl's ``full_determinism`` (``verl.workers.engine.utils.enable_full_determinism``).

``with full_determinism(seed):`` around building and fitting a Trainer sets what verl sets for the run and
puts it back afterwards (a test session or a notebook goes on as before):

- ``torch.use_deterministic_algorithms(True, warn_only=True)`` (an op with no deterministic kernel warns),
  cuDNN deterministic, its autotuner and cuDNN itself off, as verl does;
- the environment of deterministic cuBLAS / FlashAttention / NCCL (``CUBLAS_WORKSPACE_CONFIG=:16:8``,
  ``NCCL_ALGO=Ring``, ...), ``PYTHONHASHSEED`` for the processes the run starts, and with ``batch_invariant``
  vLLM's batch-invariant kernels (``VLLM_BATCH_INVARIANT=1``, verl's ``rollout.full_determinism``; GPU kernels);
- ``random``, NumPy and torch seeded with ``seed`` (the Trainer seeds them again at ``fit``).

On CPU torch's kernels are already deterministic run to run; the switch matters on GPUs.
"""

from __future__ import annotations

import contextlib
import os
import random

# torch and numpy are imported when the switch is used: the verl entry point imports this module before any checks.

ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "FLASH_ATTENTION_DETERMINISTIC": "1", "NCCL_DETERMINISTIC": "1",
       "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "VERL_FULL_DETERMINISM": "1"}


@contextlib.contextmanager
def full_determinism(seed: int, batch_invariant: bool = False):
    """Deterministic kernels, their environment and seeds for the block; everything is restored after it."""
    import numpy as np
    import torch

    env = ENV | {"PYTHONHASHSEED": str(seed)} | ({"VLLM_BATCH_INVARIANT": "1"} if batch_invariant else {})
    saved_env = {k: os.environ.get(k) for k in env}
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.enabled)
    os.environ.update(env)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.enabled = True, False, False
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every device's generator, CUDA's included
    try:
        yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.enabled = saved[2:]
