"""Where a pytest run's time went, per test file, from its `--durations=0` report.

    python -m pytest -m "not gpu and not docker" tests --durations=0 -q > durations.txt
    python bench/suite_durations.py durations.txt [--top 40] [--json]
    python bench/suite_durations.py after.txt --against before.txt     # per file, before and after

pytest reports each phase of each test on its own line (`12.34s setup tests/a/test_b.py::test_c[x]`).
Summed per file: setup is mostly the module's fixtures (stacks started, models built), call the tests'
own bodies, teardown the stacks stopped. Prints a Markdown table, largest file first, and the total;
phases pytest rounded away (below 0.005 s) are not counted.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

LINE = re.compile(r"^\s*(?P<seconds>\d+(?:\.\d+)?)s\s+(?P<phase>setup|call|teardown)\s+(?P<nodeid>\S.*?)\s*$")


@dataclass
class FileTime:
    path: str
    phases: dict[str, float] = field(default_factory=lambda: {"setup": 0.0, "call": 0.0, "teardown": 0.0})
    tests: set[str] = field(default_factory=set)
    slowest: tuple[float, str] = (0.0, "")
    """(seconds, test name) of the test whose phases sum to the most."""

    @property
    def total(self) -> float:
        return sum(self.phases.values())


def parse(lines) -> dict[str, FileTime]:
    files: dict[str, FileTime] = {}
    per_test: dict[str, float] = {}
    for line in lines:
        m = LINE.match(line)
        if not m:
            continue
        nodeid = m["nodeid"]
        path = nodeid.split("::", 1)[0]
        entry = files.setdefault(path, FileTime(path))
        entry.phases[m["phase"]] += float(m["seconds"])
        entry.tests.add(nodeid)
        per_test[nodeid] = per_test.get(nodeid, 0.0) + float(m["seconds"])
    for nodeid, seconds in per_test.items():
        entry = files[nodeid.split("::", 1)[0]]
        if seconds > entry.slowest[0]:
            entry.slowest = (seconds, nodeid.split("::", 1)[1])
    return files


def table(files: dict[str, FileTime], top: int) -> str:
    ranked = sorted(files.values(), key=lambda f: f.total, reverse=True)
    total = sum(f.total for f in ranked)
    rows = ["| file | s | setup | call | teardown | tests timed | slowest test (s) |",
            "|---|---:|---:|---:|---:|---:|---|"]
    for f in ranked[:top]:
        p = f.phases
        rows.append(f"| {f.path} | {f.total:.0f} | {p['setup']:.0f} | {p['call']:.0f} | {p['teardown']:.0f} | "
                    f"{len(f.tests)} | {f.slowest[1]} ({f.slowest[0]:.0f}) |")
    rest = ranked[top:]
    if rest:
        rows.append(f"| {len(rest)} other files | {sum(f.total for f in rest):.0f} | | | | "
                    f"{sum(len(f.tests) for f in rest)} | |")
    rows.append(f"| **all {len(ranked)} files** | **{total:.0f}** | | | | {sum(len(f.tests) for f in ranked)} | |")
    return "\n".join(rows)


def comparison(after: dict[str, FileTime], before: dict[str, FileTime]) -> str:
    """Per file of either report: seconds before and after, largest before first."""
    paths = sorted(set(after) | set(before), key=lambda p: before[p].total if p in before else 0, reverse=True)
    rows = ["| file | before s | after s | tests timed before | after |", "|---|---:|---:|---:|---:|"]
    for path in paths:
        b, a = before.get(path), after.get(path)
        rows.append(f"| {path} | {b.total if b else 0:.0f} | {a.total if a else 0:.0f} | "
                    f"{len(b.tests) if b else 0} | {len(a.tests) if a else 0} |")
    rows.append(f"| **all** | **{sum(f.total for f in before.values()):.0f}** | "
                f"**{sum(f.total for f in after.values()):.0f}** | | |")
    return "\n".join(rows)


def _read(path: Path):
    return sys.stdin if str(path) == "-" else path.read_text(errors="replace").splitlines()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="a pytest --durations=0 report ('-' for stdin)")
    parser.add_argument("--top", type=int, default=40, help="files listed one by one (the rest summed)")
    parser.add_argument("--json", action="store_true", help="one JSON object per file instead of the table")
    parser.add_argument("--against", type=Path, help="an earlier report: print both, per file")
    args = parser.parse_args(argv)
    files = parse(_read(args.report))
    if not files:
        print(f"{args.report}: no `--durations` lines found", file=sys.stderr)
        return 1
    if args.against is not None:
        print(comparison(files, parse(_read(args.against))))
    elif args.json:
        for f in sorted(files.values(), key=lambda f: f.total, reverse=True):
            print(json.dumps({"file": f.path, "seconds": round(f.total, 2),
                              **{k: round(v, 2) for k, v in f.phases.items()}, "tests": len(f.tests)}))
    else:
        print(table(files, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
