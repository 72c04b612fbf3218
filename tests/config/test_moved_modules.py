"""The verl-specific config modules moved to ``rlflow.config.verl``; their old paths still import, as the same
module, with a DeprecationWarning naming the new path."""

import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import rlflow.config

HERE = Path(rlflow.config.__file__).parent
MOVED = sorted(m.name for m in pkgutil.iter_modules([str(HERE)])
               if not m.ispkg and "as _moved" in (HERE / f"{m.name}.py").read_text())


def test_there_are_moved_modules():
    assert len(MOVED) == 18, MOVED


@pytest.mark.parametrize("name", MOVED)
def test_an_old_path_warns_and_is_the_new_module(name):
    old = f"rlflow.config.{name}"
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} is now (rlflow\.config\.verl\.\w+)") as record:
        module = importlib.import_module(old)
    new = str(record[0].message).split(" is now ")[1].split(";")[0]
    assert module is importlib.import_module(new)
