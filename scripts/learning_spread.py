"""How far float rounding alone moves each learning test's figures: the measurement their thresholds come from.

Runs the tests marked ``learning`` once per jitter ``K`` (``RLFLOW_WARM_START_JITTER=K``: the shipped warm
start's weights times ``1 + 1e-4 z``, standing in for another CPU: rlflow/tasks/warm_start.py says why; 0 is
the shipped weights themselves) and prints, for every figure a test records with ``record_property`` (``reward_rise``,
``accuracy_rise``), its values, minimum and median, and which runs failed. A threshold belongs well
below the minimum.

    python scripts/learning_spread.py --jitters 0 1 2 3          # all learning tests (about 40 min on 2 cores)
    python scripts/learning_spread.py --jitters 0 1 -- tests/algorithms/test_learning.py -k rloo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def run(jitter: int, pytest_args: list[str], out: Path) -> dict[str, dict]:
    """{test id: {"passed": bool, figure: value, ...}} of one pytest run under ``jitter``."""
    env = dict(os.environ, RLFLOW_WARM_START_JITTER=str(jitter))
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "learning", "-p", "no:cacheprovider", f"--junitxml={out}",
           "-o", "junit_family=xunit1", *pytest_args]  # xunit1: the format that keeps record_property's values
    subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parents[1])
    results = {}
    for case in ET.parse(out).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        row = {"passed": case.find("failure") is None and case.find("error") is None and case.find("skipped") is None}
        row["skipped"] = case.find("skipped") is not None
        for prop in case.iter("property"):
            row[prop.get("name")] = float(prop.get("value"))
        results[name] = row
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jitters", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--keep", default=None, help="a folder for each jitter's results; a jitter already there is "
                                                    "not run again (an interrupted measurement resumes)")
    parser.add_argument("pytest_args", nargs="*", help="after --: test paths and pytest options")
    args = parser.parse_args(argv)
    table: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    failed: dict[str, list[int]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.jitters:
            kept = Path(args.keep) / f"jitter{k}.json" if args.keep else None
            if kept is not None and kept.is_file():
                results = json.loads(kept.read_text())
            else:
                results = run(k, args.pytest_args, Path(tmp) / f"j{k}.xml")
                if kept is not None:
                    kept.parent.mkdir(parents=True, exist_ok=True)
                    kept.write_text(json.dumps(results, indent=1))
            for name, row in results.items():
                if row.pop("skipped"):
                    continue
                if not row.pop("passed"):
                    failed[name].append(k)
                for figure, value in row.items():
                    table[(name, figure)][k] = value
                table.setdefault((name, "(ran)"), {})[k] = 1.0
    print(f"\njitters {args.jitters}")
    for (name, figure), values in sorted(table.items()):
        if figure == "(ran)":
            if failed.get(name):
                print(f"{name}: FAILED under jitter {failed[name]}")
            continue
        shown = " ".join(f"{values[k]:+.3f}" for k in args.jitters if k in values)
        print(f"{name} {figure}: {shown}  min {min(values.values()):+.3f} "
              f"median {statistics.median(values.values()):+.3f}  failed {failed.get(name, [])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
