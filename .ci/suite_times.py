"""Where the suite's time goes: a JUnit XML report (pytest --junitxml) summed per test file.

    python .ci/suite_times.py report.xml [--top N]

Prints a Markdown table (tests, summed seconds, the slowest test) sorted by time, then the N
slowest tests. The seconds are each test's own (setup + call + teardown as pytest reports them);
with parallel workers their sum is more than the wall time.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ElementTree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="a pytest --junitxml file")
    parser.add_argument("--top", type=int, default=20, help="how many of the slowest tests to list (default 20)")
    args = parser.parse_args()
    cases = [
        (case.get("classname", ""), case.get("name", ""), float(case.get("time", 0) or 0))
        for case in ElementTree.parse(args.report).getroot().iter("testcase")
    ]
    per_file: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)
    for classname, name, seconds in cases:
        per_file[classname.replace(".", "/") + ".py"].append((name, seconds))
    total = sum(seconds for _, _, seconds in cases)
    print(f"{len(cases)} tests, {total:.0f} s of test time\n")
    print("| file | tests | seconds | share | slowest test (s) |")
    print("| --- | ---: | ---: | ---: | --- |")
    for path, tests in sorted(per_file.items(), key=lambda item: -sum(s for _, s in item[1])):
        seconds = sum(s for _, s in tests)
        name, slowest = max(tests, key=lambda test: test[1])
        print(f"| `{path}` | {len(tests)} | {seconds:.0f} | {seconds / total:.0%} | {name} ({slowest:.0f}) |")
    print(f"\nthe {args.top} slowest tests:")
    for classname, name, seconds in sorted(cases, key=lambda case: -case[2])[: args.top]:
        print(f"  {seconds:7.1f}  {classname}::{name}")


if __name__ == "__main__":
    main()
