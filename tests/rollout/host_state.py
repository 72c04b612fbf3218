"""What vLLM's in-process start and sampling would change in the host process, captured for comparison."""

import gc
import os
import random

import numpy as np
import torch


def host_state() -> dict:
    return {
        "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "numpy_rng": np.random.get_state()[1].copy(),
        "set_num_threads": torch.set_num_threads, "num_threads": torch.get_num_threads(),
        "environ": dict(os.environ), "gc_frozen": gc.get_freeze_count(), "default_dtype": torch.get_default_dtype(),
    }


def differences(a: dict, b: dict) -> list[str]:
    """The names of what differs between two captures (environment variables by name)."""
    out = []
    for key in a:
        x, y = a[key], b[key]
        if key == "environ":
            out += [f"environ[{k}]" for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
        elif isinstance(x, torch.Tensor):
            out += [] if torch.equal(x, y) else [key]
        elif isinstance(x, np.ndarray):
            out += [] if np.array_equal(x, y) else [key]
        elif x is not y and x != y:
            out.append(key)
    return out
