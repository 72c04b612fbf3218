"""Thread counts chosen on purpose (rlflow.threads) and quiet output: one copy of each message, no noise."""

import os
import subprocess
import sys
import warnings

import pandas as pd
import pytest
import torch
from tensordict import TensorDict

import rlflow.threads as threads
from rlflow.data import keys as K
from rlflow.data.prompts import PromptData
from rlflow.models.policy import Policy


@pytest.fixture
def no_thread_env(monkeypatch):
    """No user choice in the environment; torch back at one thread afterwards (the suite's setting)."""
    for name in threads.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "_chosen", None)
    lines = []
    yield lines
    torch.set_num_threads(1)


def test_the_users_choice_wins(no_thread_env, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads.choose_threads(10**9, log=no_thread_env.append) == 1 and not no_thread_env
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads, "physical_cores", lambda: 4)  # torch.set_num_threads(1) was called: not 4
    assert threads.choose_threads(10**9, log=no_thread_env.append) == 1 and not no_thread_env
    monkeypatch.setenv("RLFLOW_NUM_THREADS", "2")
    assert threads.choose_threads(100, log=no_thread_env.append) == 2 and torch.get_num_threads() == 2


def test_tiny_models_get_one_thread_and_large_ones_the_idle_cores(no_thread_env, monkeypatch):
    torch.set_num_threads(2)
    monkeypatch.setattr(threads, "physical_cores", lambda: 2)  # 2 is torch's default here: no user choice
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    assert threads.choose_threads(500_000, log=no_thread_env.append) == 1 and torch.get_num_threads() == 1
    assert "a 0.5M-parameter model runs fastest on one" in no_thread_env[-1]
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 1.0, 1.0))  # this process alone
    assert threads.choose_threads(10**9, log=no_thread_env.append) == 2  # rlflow's own earlier 1 is no user choice
    assert "2 idle core(s)" in no_thread_env[-1]
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 3.0, 3.0))  # two other processes keep both cores busy
    assert threads.choose_threads(10**9, log=no_thread_env.append) == 1
    assert "2 core(s), 2.0 kept busy by other processes" in no_thread_env[-1]


def test_gradient_checkpointing_warns_nothing(model, tokenizer):
    policy = Policy(model, tokenizer, gradient_checkpointing=True)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    batch = TensorDict({K.PROMPT_IDS: ids, K.PROMPT_MASK: torch.ones_like(ids), K.RESPONSE_IDS: ids[:, :2]},
                       batch_size=[2])
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log_probs, _ = policy.log_probs(batch)
        log_probs.sum().backward()
    assert not [str(w.message) for w in caught], [str(w.message) for w in caught]


def test_reading_a_data_file_shows_no_progress_bars(tmp_path, capfd):
    import datasets

    pd.DataFrame({"prompt": ["1+1=", "2+2="], "ground_truth": ["2", "4"]}).to_parquet(tmp_path / "d.parquet")
    assert len(PromptData(str(tmp_path / "d.parquet")).train) == 2
    assert "Generating train split" not in capfd.readouterr().err
    assert datasets.is_progress_bar_enabled()  # the caller's setting is back


def test_ranks_other_than_zero_print_no_warnings():
    from rlflow.logs import quiet_other_ranks

    filters = list(warnings.filters)
    quiet_other_ranks(0)  # rank 0 keeps every message
    assert warnings.filters == filters
    code = ("from rlflow.logs import quiet_other_ranks; quiet_other_ranks(1); import warnings; "
            "warnings.warn('a repeated warning'); print('done')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "done" and "a repeated warning" not in out.stderr, out.stderr
