"""The heartbeat's report on a real c10d TCPStore (in this process: two ranks' heartbeats on one store):
a silent peer is named with its last phase; when every peer still beats (a collective timeout), their
phases are what the report gives; and a real 2-process gloo run whose collective times out while one rank is
stuck in its reward. tests/distributed/test_multinode.py SIGKILLs a real rank."""

import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from rlflow.trainer.metrics import Timer
from rlflow.trainer.watchdog import Heartbeat, current_phase, phase

from ..distributed.launch import free_port


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)


def test_timer_phases_are_the_current_phase_and_a_failure_is_remembered():
    timer = Timer()
    with timer("gen"):
        assert current_phase() == "gen"
        with phase("reward"):
            assert current_phase() == "reward"
    assert current_phase() == "setup"
    seen = []
    with phase("gen"):  # another thread's phases are not the main thread's
        worker = threading.Thread(target=lambda: seen.append(phase("save").__enter__() or current_phase()))
        worker.start(), worker.join()
    assert seen == ["gen"]
    with pytest.raises(StopIteration), phase("gen"):  # the prompt stream ran out: an end, not a failure
        next(iter([]))
    assert current_phase() == "setup"
    with pytest.raises(ValueError), timer("update_actor"):
        raise ValueError
    assert current_phase() == "failed in update_actor"  # what the heartbeat publishes from now on
    from rlflow.trainer import watchdog

    watchdog._failed.clear()


def test_a_silent_peer_is_named_with_its_last_phase(store):
    me, peer = Heartbeat(store, 0, 2, timeout=60), Heartbeat(store, 1, 2, timeout=60)
    me.interval = peer.interval = 0.1
    with phase("reward"):
        peer.beat()  # its last beat, then silence: as after a SIGKILL
    me.start()
    with phase("update_weights"):
        report = me.explain(wait=5)
    me.stop()
    assert "[rlflow] rank 1 stopped: its heartbeat stopped" in report
    assert "in phase 'reward' (reward)" in report
    assert "this rank (0) was in phase 'update_weights' (weight sync to the rollout engine)" in report


def test_with_every_peer_alive_the_report_gives_their_phases(store):
    me, peer = Heartbeat(store, 0, 2, timeout=60), Heartbeat(store, 1, 2, timeout=60)
    me.interval = peer.interval = 0.1
    with phase("gen"):  # the peer keeps beating from 'gen' (as a rank stuck in generation would)
        peer.start()
        me.start()
        report = me.explain(wait=1)
    me.stop(), peer.stop()
    assert "every other rank is still sending heartbeats" in report
    assert "the other ranks: rank 1 in phase 'gen' (generation)" in report


def test_a_peer_that_finished_is_not_dead(store):
    me, peer = Heartbeat(store, 0, 2, timeout=0.5), Heartbeat(store, 1, 2, timeout=0.5)
    peer.stop()  # left fit normally: its last beat says so
    me.beat(), me.observe()
    me.peers[1]["moved"] -= 10
    assert me.silent(0.5) == []


def test_a_bad_timeout_names_the_variable(monkeypatch):
    from rlflow.trainer.watchdog import heartbeat_timeout

    monkeypatch.setenv("RLFLOW_HEARTBEAT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="RLFLOW_HEARTBEAT_TIMEOUT='soon'"):
        heartbeat_timeout()
    monkeypatch.setenv("RLFLOW_HEARTBEAT_TIMEOUT", "2.5")
    assert heartbeat_timeout() == 2.5


def test_a_peer_not_heard_from_yet_gets_the_startup_grace(store, monkeypatch):
    """Ranks reach fit at different times (CI: one rank was still starting its vLLM engine after 10 s): a peer
    that has not sent its first beat is not called dead at the heartbeat timeout, only after the startup grace."""
    monkeypatch.setenv("RLFLOW_HEARTBEAT_STARTUP", "30")
    me = Heartbeat(store, 0, 2, timeout=0.5)
    me.beat(), me.observe()
    me.peers[1]["moved"] -= 10  # silent for 10 s, never heard from
    assert me.silent(me.timeout, first_beat=me.startup) == []
    assert me.silent(me.timeout) == [1]  # the exception path still names it at once
    me.peers[1]["moved"] -= 30
    assert me.silent(me.timeout, first_beat=me.startup) == [1]


def test_a_collective_timeout_names_the_rank_that_never_reached_it_and_its_phase(tmp_path):
    """A real 2-process gloo run: rank 1's reward hangs from step 2 on while rank 0 goes on into the next
    collective, which times out (3 s, set after step 1). Rank 0's report names rank 1 and 'reward' (the
    experience stream marks generation and scoring as phases), and says to look there."""
    from ..distributed.launch import torchrun

    proc = torchrun(2, tmp_path, worker=Path(__file__).parents[1] / "distributed" / "hang_worker.py", timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Timed out waiting 3000ms" in log, log[-4000:]
    report = next((line for line in log.splitlines() if line.startswith("[rlflow] a collective timed out")), None)
    assert report is not None, log[-4000:]
    assert "on this rank in phase '" in report and "rank 1 is in phase 'reward' (reward) after 1 finished step(s)" in report
    assert "not at that collective" in report and "reward_model.timeout_s" in report
