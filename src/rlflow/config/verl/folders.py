"""Where the models of a verl config are and what their transformers configs say (no weights are read): the
folders of ``actor_rollout_ref.model.*`` and ``critic.model.*``, and transformers' refusals as errors naming the key
that changes them. The tree (:mod:`rlflow.config.verl.tree`), the build and the dry run read them."""

from __future__ import annotations

from contextlib import contextmanager

from rlflow.config.verl.loading import ConfigError
from rlflow.config.verl.plan import Plan
from rlflow.models.hf_config import OverrideError, load_config
from rlflow.models.hub import ModelNotFoundError, locate_model
from rlflow.models.vision import load_processor


def local_model(path: str, key: str) -> str:
    """What transformers should load for the model at ``key``: a local folder, a cached hub model when
    offline, or the hub id itself when the hub is reachable (see :mod:`rlflow.models.hub`)."""
    try:
        return locate_model(path, key).path
    except ModelNotFoundError as e:
        raise ConfigError(str(e)) from None


def model_files(plan: Plan) -> dict[str, str]:
    """What transformers loads for the policy: its model, and its tokenizer and config (verl's
    ``model.tokenizer_path`` / ``model.hf_config_path``: the model folder unless set)."""
    model = local_model(plan.model_path, "actor_rollout_ref.model.path")
    given = {k: local_model(plan.policy_kwargs[k], f"actor_rollout_ref.model.{key}")
             for k, key in (("tokenizer_path", "tokenizer_path"), ("config_path", "hf_config_path"))
             if plan.policy_kwargs.get(k)}
    return {"model": model, "tokenizer_path": model, "config_path": model} | given


TRUST = "actor_rollout_ref.model.trust_remote_code"
TRUST_TOKENIZER = f"{TRUST}=True, or data.trust_remote_code=True for the tokenizer alone"


@contextmanager
def remote_code_errors(path_key: str, trust_key: str, override_key: str | None = None):
    """transformers' refusal to run a folder's own code, and a config override it cannot take, as a
    :class:`ConfigError` naming the verl key that changes it."""
    try:
        yield
    except OverrideError as e:
        raise ConfigError(f"{override_key}{str(e).removeprefix('override_config')}" if override_key else str(e)) \
            from None
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ConfigError(f"{path_key}: {e} (verl key: {trust_key})") from None


def policy_config(plan: Plan):
    """The policy's transformers config (``model.hf_config_path`` when set) with its overrides (no weights read)."""
    kw, key = plan.policy_kwargs, "actor_rollout_ref.model"
    with remote_code_errors(f"{key}.path", f"{TRUST}=True", f"{key}.override_config"):
        return load_config(model_files(plan)["config_path"], kw.get("override_config"),
                           kw.get("trust_remote_code", False))


def vision_policy(plan: Plan) -> bool:
    """Whether the policy is a vision-language model (its config has a ``vision_config``)."""
    return getattr(policy_config(plan), "vision_config", None) is not None


def critic_config(plan: Plan):
    """The critic's transformers config with its overrides (no weights read)."""
    kw, key = plan.critic_kwargs, "critic.model"
    with remote_code_errors(f"{key}.path", f"{key}.trust_remote_code=True", f"{key}.override_config"):
        config = kw.get("config_path") and local_model(kw["config_path"], f"{key}.hf_config_path")
        return load_config(config or local_model(plan.critic_path, f"{key}.path"), kw.get("override_config"),
                           kw.get("trust_remote_code", False))


def load_vision_processor(plan: Plan):
    """The processor of an image-text-to-text model folder (its images' size bounds from ``data.min/max_pixels``),
    else ``None``; no weights are read."""
    files, kw = model_files(plan), plan.policy_kwargs
    if not vision_policy(plan):
        return None
    trust = kw.get("tokenizer_trust_remote_code", kw.get("trust_remote_code", False))
    with remote_code_errors("actor_rollout_ref.model.path", TRUST_TOKENIZER):
        return load_processor(files["tokenizer_path"], kw.get("min_pixels"), kw.get("max_pixels"),
                              trust_remote_code=trust)
