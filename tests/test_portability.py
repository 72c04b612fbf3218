"""No machine-specific paths in what users run or read: benchmarks, docs, recipes, examples, notebooks."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:work|home|root|Users|mnt|scratch)/[\w.-]+|\S*venv/bin/python\S*")


def test_no_machine_specific_paths():
    files = [p for pattern in ("benchmarks/*.py", "benchmarks/*.md", "docs/**/*.md", "README.md", "recipes/**/*",
                               "examples/**/*", "notebooks/*.ipynb", "mkdocs.yml")
             for p in ROOT.glob(pattern) if p.is_file()]
    assert len(files) > 10
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files
             for m in MACHINE_PATH.finditer(p.read_text(errors="replace"))]
    assert not found, found
