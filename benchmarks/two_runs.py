"""Two full runs' targets side by side: a target counts as met when both runs meet it (the
machine is shared, so one run can pass or fail on noise).

Usage, from the repository root:
    python -m benchmarks --markdown run1.md && python -m benchmarks --markdown run2.md
    python -m benchmarks.two_runs run1.md run2.md [--markdown PATH]

Reads the checklists the reports end with (the main benchmark's, or the norm family's from
python -m benchmarks.family --markdown PATH) and prints one Markdown table, a row per target in
the first run's order: the value each run measured and whether both, one or neither met it,
then the counts.
"""

from __future__ import annotations

import argparse
import re
import sys

# The checklists' lines: report.checklist_line's, "- [x] <target>: measured <value>, met" (or
# ", NOT met", or ", not measured (<why>)"), and the norm family's (family.py), "- [met] <case>,
# <threads>: ours / <peer> = <value> (target <= <limit>)" (or "[NOT met]", or "[n/a]")
CHECK_LINE = re.compile(r"- \[[ x]\] (?P<target>.+): measured (?P<value>.+?), (?P<status>met|NOT met|not measured.*)")
FAMILY_CHECK_LINE = re.compile(r"- \[(?P<status>met|NOT met|n/a)\] (?P<case>.+) = (?P<value>\S+) \((?P<limit>target .+)\)")


def read_checks(path):
    """{target: (value, met)} of a report's checklist, in its order; met is None where the run
    did not measure it."""
    checks = {}
    with open(path, encoding="utf-8") as report:
        for line in report:
            line = line.rstrip("\n")
            found, family = CHECK_LINE.fullmatch(line), FAMILY_CHECK_LINE.fullmatch(line)
            if found:
                target = found["target"]
            elif family:
                found, target = family, f"{family['case']} ({family['limit']})"
            else:
                continue
            status = found["status"]
            checks[target] = (found["value"], None if status.startswith("n") else status == "met")
    return checks


def verdict(first, second):
    """'both', 'one' or 'neither' (of two runs' met flags), or 'not measured'."""
    if first is None or second is None:
        return "not measured"
    return {2: "both", 1: "one", 0: "neither"}[first + second]


def two_runs_lines(first, second):
    """The Markdown table and the counts of two runs' {target: (value, met)}."""
    targets = list(first) + [target for target in second if target not in first]
    missing = ("n/a", None)
    rows, counts = [], {}
    for target in targets:
        (value1, met1), (value2, met2) = first.get(target, missing), second.get(target, missing)
        met_in = verdict(met1, met2)
        counts[met_in] = counts.get(met_in, 0) + 1
        rows.append(f"| {target} | {value1} | {value2} | {met_in} |")
    summary = ", ".join(f"{counts.get(key, 0)} in {key}" for key in ("both", "one", "neither"))
    if counts.get("not measured"):
        summary += f", {counts['not measured']} not measured in one run or both"
    header = ["| target | run 1 | run 2 | met in |", "|---|---:|---:|---|"]
    return [f"Targets of two runs: met {summary} (of {len(targets)}).", ""] + header + rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", help="the first run's report (python -m benchmarks --markdown PATH)")
    parser.add_argument("second", help="the second run's report")
    parser.add_argument("--markdown", help="also write the table to this file")
    arguments = parser.parse_args(argv)
    first, second = read_checks(arguments.first), read_checks(arguments.second)
    if not first or not second:
        empty = arguments.first if not first else arguments.second
        parser.error(f"{empty} has no targets checklist: is it a report of python -m benchmarks --markdown?")
    text = "\n".join(two_runs_lines(first, second)) + "\n"
    sys.stdout.write(text)
    if arguments.markdown:
        with open(arguments.markdown, "w", encoding="utf-8") as out:
            out.write(text)


if __name__ == "__main__":
    main()
