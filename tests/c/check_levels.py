"""Checks kernel_driver outputs: every case must give one hash at every level and thread count
in every file (one file per architecture or compiler).

    python3 tests/c/check_levels.py x86_64-gcc.txt aarch64-gcc.txt

Each line of a file reads "<case> <level> t<threads> <hash>".  Exits 1, listing the first
differences, if any case's hashes differ or a case is missing from a file.  The driver hashes
forward outputs as written (the one quiet NaN included) and backward outputs with every NaN
replaced by one quiet NaN.
"""
import argparse
import os
import sys

SHOWN = 10  # differences listed before "... and N more"


def read_runs(path):
    """{case: [(level, threads, hash), ...]} in file order."""
    runs = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            fields = line.split()
            if len(fields) != 4 or not fields[2].startswith("t"):
                sys.exit(f"{path}:{number}: not '<case> <level> t<threads> <hash>': {line.rstrip()!r}")
            case, level, threads, digest = fields
            runs.setdefault(case, []).append((level, threads, digest))
    if not runs:
        sys.exit(f"{path}: no runs (did the driver fail?)")
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outputs", nargs="+", help="kernel_driver output files")
    args = parser.parse_args()

    files = {os.path.basename(path).removesuffix(".txt"): read_runs(path) for path in args.outputs}
    cases = list(dict.fromkeys(case for runs in files.values() for case in runs))
    problems = []
    for case in cases:
        reference = None  # (where, hash) of the case's first run
        for label, runs in files.items():
            if case not in runs:
                problems.append(f"{case}: missing from {label}")
                continue
            for level, threads, digest in runs[case]:
                where = f"{label} {level} {threads}"
                if reference is None:
                    reference = (where, digest)
                elif digest != reference[1]:
                    problems.append(f"{case}: {where} gives {digest}, {reference[0]} gives {reference[1]}")

    if problems:
        print(f"check_levels: {len(problems)} differences:", file=sys.stderr)
        for problem in problems[:SHOWN]:
            print("  " + problem, file=sys.stderr)
        if len(problems) > SHOWN:
            print(f"  ... and {len(problems) - SHOWN} more", file=sys.stderr)
        sys.exit(1)

    print(f"check_levels: {len(cases)} cases, bits identical across")
    for label, runs in files.items():
        settings = next(iter(runs.values()))
        levels = " ".join(dict.fromkeys(level for level, _, _ in settings))
        threads = " ".join(dict.fromkeys(threads for _, threads, _ in settings))
        print(f"  {label}: levels {levels}; threads {threads}")


if __name__ == "__main__":
    main()
