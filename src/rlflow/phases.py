"""The phase the main thread is in (``gen``, ``reward``, ``update_actor``, ...), for fault reports.

A leaf module (standard library only) so that every layer can mark its phases: the experience stream marks
generation and scoring, the Trainer's timer the rest, checkpointing ``save``. The watchdog
(:mod:`rlflow.trainer.watchdog`) publishes :func:`current_phase` in every rank's heartbeat, so that a dead
rank or a collective time-out is reported with what each rank was doing.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

_stack = ["setup"]          # the main thread's phases, innermost last
_failed: list[str] = []     # the innermost phase an exception left (the first one recorded)


def current_phase() -> str:
    return f"failed in {_failed[0]}" if _failed else _stack[-1]


@contextmanager
def phase(name: str):
    """Mark the main thread as being in ``name`` (other threads' phases are not tracked)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _stack.append(name)
    try:
        yield
    except (StopIteration, GeneratorExit):
        raise  # an iterator that ended or was closed (the experience stream's parts): not a failure
    except BaseException:
        if not _failed:
            _failed.append(name)
        raise
    finally:
        _stack.pop()
