"""How many CPU threads torch uses in a single-process run, chosen on purpose.

torch's default is one thread per physical core. That is right on an idle machine and a large
model; it is badly wrong on a shared machine (threads of an operator wait for each other while
another process holds a core: the default job ran ~5x slower on 2 busy cores) and for tiny models
(each operator is too small to split). :func:`choose_threads`, called by the Trainer and the warm
start, therefore picks:

- the user's choice, whenever there is one: ``RLFLOW_NUM_THREADS``, ``OMP_NUM_THREADS`` or
  ``MKL_NUM_THREADS`` in the environment, or an earlier ``torch.set_num_threads(n)`` call (a thread
  count other than torch's default and other than rlflow's own earlier choice);
- 1 thread for a model under ``SMALL_MODEL`` parameters;
- otherwise the cores this process may use, less those other processes keep busy (the 1-minute
  load average), at least 1.

The choice is printed once when it changes the thread count. Processes launched by ``torchrun``
get ``OMP_NUM_THREADS=1`` from it, which counts as the user's choice.
"""

from __future__ import annotations

import os
from typing import Callable

__all__ = ["choose_threads", "SMALL_MODEL"]

SMALL_MODEL = 5_000_000  # parameters; below: one thread (default job ~5x faster on busy cores: benchmarks/threads.py)
ENV_VARS = ("RLFLOW_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_chosen: int | None = None  # what rlflow set last (so that it is not mistaken for the user's choice)


def physical_cores() -> int:
    """Physical cores of the machine, as torch counts them for its default (logical CPUs when unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        cores, physical = set(), "0"
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "physical id":
                physical = value.strip()
            elif key.strip() == "core id":
                cores.add((physical, value.strip()))
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1


def usable_cores() -> int:
    """CPUs this process may run on (its affinity, e.g. a container's or taskset's limit)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def user_choice() -> int | None:
    """The thread count the user asked for, if any (environment, or ``torch.set_num_threads``)."""
    import torch

    value = os.environ.get("RLFLOW_NUM_THREADS")
    if value and value.isdigit() and int(value) > 0:
        return int(value)
    current = torch.get_num_threads()
    if any(os.environ.get(name) for name in ENV_VARS[1:]):
        return current  # torch read the variable when it started
    if current not in (physical_cores(), _chosen):
        return current  # torch.set_num_threads(current) was called
    return None


def choose_threads(num_parameters: int | None = None, log: Callable[[str], None] | None = print) -> int:
    """Set torch's intra-op threads for a model of ``num_parameters`` (see the module docstring).

    Returns the thread count in use. ``log`` gets one line when the count changes (``None``: silent).
    """
    import torch

    global _chosen
    asked = user_choice()
    if asked is not None:
        want, why = asked, "as asked"
    elif num_parameters is not None and num_parameters < SMALL_MODEL:
        want, why = 1, f"a {num_parameters / 1e6:.1f}M-parameter model runs fastest on one"
    else:
        cores = min(usable_cores(), physical_cores())
        others = max(0.0, os.getloadavg()[0] - 1) if hasattr(os, "getloadavg") else 0.0  # less this process
        want = max(1, min(cores, int(cores - others + 0.5)))
        why = (f"{cores} core(s), {others:.1f} kept busy by other processes" if others >= 0.5
               else f"{cores} idle core(s)")
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)
        if log is not None:
            log(f"[rlflow] torch uses {want} CPU thread(s) ({why}; set OMP_NUM_THREADS or call "
                "torch.set_num_threads to choose)")
    _chosen = want if asked is None else _chosen
    return want
