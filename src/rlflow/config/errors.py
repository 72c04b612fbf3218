"""The errors of config loading and validation; every message names the key it is about."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config key or value that rlflow cannot use; the message names the key."""


class NotSupportedError(ConfigError):
    """A recognised key asks for a feature rlflow does not have yet."""

    def __init__(self, key: str, value: Any, feature: str, hint: str = ""):
        self.key, self.value, self.feature = key, value, feature
        super().__init__(f"{key}={value!r}: {feature} is not supported yet in rlflow.{' ' + hint if hint else ''}")


class ConfigProblems(ConfigError):
    """Every problem found in one config, reported together (``problems`` holds each one)."""

    def __init__(self, problems: list[ConfigError]):
        self.problems = list(problems)
        listed = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problems in the config:\n{listed}")


def raise_problems(problems: list[ConfigError]) -> None:
    """Nothing for no problem; the problem itself for one (its type kept); :class:`ConfigProblems` for more."""
    unique = list({str(p): p for p in problems}.values())
    if len(unique) == 1:
        raise unique[0]
    if unique:
        raise ConfigProblems(unique)
