"""What the checks of :func:`rlflow.config.verl.validate.validate` share: the config, the problems found so far,
and facts found on the way (:class:`Context`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlflow.config.verl import checks
from rlflow.config.verl.loading import ConfigError, VerlConfig


@dataclass
class Context:
    """What the checks share: the config, the problems so far, facts found on the way."""

    cfg: VerlConfig
    environment: bool
    dry_run: bool = False  # model folders need no weights (a dry run reads config.json only)
    problems: list[ConfigError] = field(default_factory=list)
    model_configs: dict[str, dict] = field(default_factory=dict)  # model key -> its config.json
    processes: int | None = None

    def get(self, key: str) -> Any:
        """A value without marking it read (the unused-key notes must not count validation)."""
        return self.cfg.flat.get(key)

    def ok(self, *keys: str) -> bool:
        """Every key has a value of the right type (a badly typed one was reported already)."""
        return not any(k in self.cfg.bad_keys for k in keys)

    def set_by_user_or_own(self, key: str) -> bool:
        """False for a key whose value only interpolates another key (its problem is reported there)."""
        return key in self.cfg.provided or key not in self.cfg.deps

    def add(self, message: str | ConfigError) -> None:
        self.problems.append(message if isinstance(message, ConfigError) else ConfigError(message))

    @property
    def with_critic(self) -> bool:
        enable = self.get("critic.enable")
        return bool(enable) if enable is not None else self.get("algorithm.adv_estimator") in checks.NEEDS_CRITIC


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
