"""docs/verl-compat.md and the key tables agree (issue 23, "no silent acceptance"), read from the tables themselves:
every key ``tables.NOT_SUPPORTED`` lists is documented as not supported and is refused when set, and every key the
page says has no effect (a note says so) is one ``tables.INERT`` notes. Rows added to or removed from the tables
need no edit here."""

import re
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import ConfigError, load_config, make_plan
from rlflow.config.verl import tables
from rlflow.config.verl.loading import flatten

PAGE = (Path(__file__).parents[2] / "docs" / "verl-compat.md").read_text()
BASE = ["actor_rollout_ref.model.path=m", "data.train_files=t.parquet", "trainer.device=cpu", "trainer.n_gpus_per_node=1"]


def documented() -> dict[str, str]:
    """The page's table rows: each key of a row's first cell (``| `a`, `b` | ...``) -> the row's last cell."""
    rows = {}
    for line in PAGE.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        for key in re.findall(r"`([^`]+)`", cells[0]) if cells else []:
            rows[key] = cells[-1]
    return rows


ROWS = documented()
DEFAULTS = flatten(load_config([]).tree)


def rows_of(pattern: str) -> dict[str, str]:
    """The rows that document ``pattern``: its own, or its subtree's (a ``x.*`` pattern: the ``x`` row too)."""
    if pattern in ROWS:
        return {pattern: ROWS[pattern]}
    return {k: v for k, v in ROWS.items() if fnmatchcase(k, pattern) or (pattern.endswith(".*") and k == pattern[:-2])}


@pytest.mark.parametrize("pattern", sorted(tables.NOT_SUPPORTED))
def test_every_not_supported_key_is_documented_as_refused(pattern):
    rows = rows_of(pattern)
    assert rows, f"{pattern}: tables.NOT_SUPPORTED refuses it; docs/verl-compat.md has no row for it"
    for key, text in rows.items():
        assert re.search(r"not supported|refused", text, re.I), f"{key}: refused, but the page says: {text}"


def trigger(pattern: str):
    """A key of ``pattern`` and a value the table refuses (``+key`` when verl's tree has no such key)."""
    _, refused = tables.NOT_SUPPORTED[pattern]
    keys = [pattern] if "*" not in pattern else [k for k in DEFAULTS if fnmatchcase(k, pattern)]
    key = keys[0] if keys and keys[0] in DEFAULTS else "+" + pattern.replace("*", "x")
    value = next(v for v in ((True, "x", 2) if isinstance(DEFAULTS.get(key.lstrip("+")), bool) else ("x", True, 2))
                 if refused(v))
    return key, value


@pytest.mark.parametrize("pattern", sorted(tables.NOT_SUPPORTED))
def test_every_not_supported_key_is_refused_when_set(pattern, monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    key, value = trigger(pattern)
    with pytest.raises(ConfigError) as refusal:
        make_plan(load_config(BASE + [f"{key}={str(value).lower() if isinstance(value, bool) else value}"]))
    said = " ".join(str(refusal.value).split())
    assert key.lstrip("+") in said and "not supported" in said, said


def test_every_key_the_page_says_has_no_effect_is_one_the_tables_note():
    silent = [k for k, text in ROWS.items() if text.startswith("no effect (a note says so)") and k in DEFAULTS
              and not tables.inert_reason(k)]
    assert not silent, f"the page promises a note, but tables.INERT does not list: {silent}"
