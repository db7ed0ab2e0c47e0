"""Where a test run's time goes, file by file, and two runs side by side: from pytest's durations
report (``--durations=0`` in a saved output) or a JUnit XML file (``.ci/run`` writes
``build/ci/junit.xml``). Prints a Markdown table of the files that took longest and draws them.

    python -m bench.suite_time test.log slow.log ci.xml --labels before before after --out bench/suite_time.png

A test's time is its setup, call and teardown together (a session server's start is counted in the
setup of the first test that uses it).
"""

from __future__ import annotations

import argparse
import re
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from journeyman.backend.app.plots import pyplot, save

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(.+)$")


def by_test(report: Path) -> dict[str, float]:
    """Seconds per test id (``path::name[params]``) from a durations report or a JUnit XML file."""
    seconds: dict[str, float] = defaultdict(float)
    if report.suffix == ".xml":
        for case in ET.parse(report).getroot().iter("testcase"):
            path = case.get("classname", "").replace(".", "/") + ".py"
            seconds[f"{path}::{case.get('name')}"] += float(case.get("time", 0))
        return dict(seconds)
    for line in report.read_text(errors="replace").splitlines():
        if match := _DURATION.match(line.strip()):
            seconds[match[3]] += float(match[1])
    if not seconds:
        raise SystemExit(f"{report}: no durations (run pytest with --durations=0, or give a JUnit XML file)")
    return dict(seconds)


def by_file(tests: dict[str, float]) -> dict[str, float]:
    files: dict[str, float] = defaultdict(float)
    for test, seconds in tests.items():
        files[test.split("::")[0]] += seconds
    return dict(files)


def table(runs: dict[str, dict[str, float]], top: int) -> str:
    labels = list(runs)
    files = sorted(
        {f for run in runs.values() for f in run}, key=lambda f: -max(r.get(f, 0) for r in runs.values())
    )
    lines = [
        "| file | " + " | ".join(f"{label} s" for label in labels) + " |",
        "|---" * (len(labels) + 1) + "|",
    ]
    for name in files[:top]:
        lines.append(
            f"| `{name}` | " + " | ".join(f"{runs[label].get(name, 0):.0f}" for label in labels) + " |"
        )
    lines.append("| all tests | " + " | ".join(f"{sum(runs[label].values()):.0f}" for label in labels) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, dict[str, float]], top: int, out: Path) -> Path:
    plt = pyplot()
    files = sorted(
        {f for run in runs.values() for f in run}, key=lambda f: -max(r.get(f, 0) for r in runs.values())
    )
    files = files[:top][::-1]
    figure, axis = plt.subplots(figsize=(10, 0.32 * len(files) + 1.5))
    height = 0.8 / len(runs)
    for i, (label, run) in enumerate(runs.items()):
        total = sum(run.values()) / 60
        axis.barh(
            [y + i * height for y in range(len(files))], [run.get(f, 0) for f in files], height,
            label=f"{label} ({total:.1f} min of tests)",
        )  # fmt: skip
    axis.set_yticks([y + height * (len(runs) - 1) / 2 for y in range(len(files))])
    axis.set_yticklabels([f.removeprefix("tests/") for f in files], fontsize=8)
    axis.set_xlabel("seconds (setup, call and teardown of the file's tests)")
    axis.legend(loc="lower right")
    axis.set_title(f"The {len(files)} test files that took longest")
    return save(figure, out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reports", nargs="+", type=Path, help="durations reports or JUnit XML files")
    parser.add_argument("--labels", nargs="+", help="one name per report (default: the file names)")
    parser.add_argument("--top", type=int, default=25, help="files shown")
    parser.add_argument("--out", type=Path, help="draw the files as bars into this PNG")
    args = parser.parse_args()
    labels = args.labels or [str(r) for r in args.reports]
    if len(labels) != len(args.reports):
        parser.error("give one label per report")
    runs: dict[str, dict[str, float]] = {}
    for label, report in zip(labels, args.reports, strict=True):  # a label given twice: one run of two
        run = runs.setdefault(label, {})
        for name, seconds in by_file(by_test(report)).items():
            run[name] = run.get(name, 0.0) + seconds
    print(table(runs, args.top))
    if args.out:
        print(f"picture: {plot(runs, args.top, args.out)}")


if __name__ == "__main__":
    main()
