"""Pool wake benchmark: a call after idle time against the same call back to back.

Usage, from the repository root:
    python -m benchmarks.pool_wake [--threads N[,M]] [--idle MS] [--quick] [--markdown PATH]

    --threads N[,M]  thread counts (default: all usable cores)
    --idle MS        idle time before each call of the "after idle" column (default 3 ms)
    --quick          fewer calls, one round (smoke test, a few seconds)
    --markdown PATH  also write the report to PATH

Case: layer_norm(x, (768,), weight, bias, out=y) on float32 (rows, 768), large enough to run on
several threads.  The pool's workers spin for about a millisecond after a job, then sleep; a
program that calls layer_norm between other work (a matmul, a Python loop) finds them asleep.
"back to back" is the median of calls made one after the other; "after idle" the median of
calls each made after sleeping --idle milliseconds.  A round times every case both ways; the
time is the best median over ROUNDS rounds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import numpy as np

import layernorm

from .report import cpu_model_name, load_average_text, table_lines
from .timing import default_thread_counts, garbage_collector_paused, threads_text

ROWS = (128, 512, 2048)
COLS = 768
ROUNDS = 3
BACK_TO_BACK_CALLS = 200
AFTER_IDLE_CALLS = 60


def median_call_seconds(call, calls, idle_seconds):
    """The median time of `calls` calls, each after sleeping idle_seconds (0: back to back)."""
    times = []
    for _ in range(calls):
        if idle_seconds:
            time.sleep(idle_seconds)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def measure(threads, idle_seconds, quick):
    """[(rows, back-to-back seconds, after-idle seconds)] at `threads` threads."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal(COLS).astype(np.float32)
    bias = rng.standard_normal(COLS).astype(np.float32)
    cases = []
    for rows in ROWS:
        x = rng.standard_normal((rows, COLS)).astype(np.float32)
        y = np.empty_like(x)
        cases.append((rows, lambda x=x, y=y: layernorm.layer_norm(x, (COLS,), weight, bias, out=y)))
    layernorm.set_num_threads(threads)
    best = {rows: [float("inf"), float("inf")] for rows, _ in cases}
    scale = 10 if quick else 1
    for _ in range(1 if quick else ROUNDS):
        for rows, call in cases:
            best[rows][0] = min(best[rows][0], median_call_seconds(call, BACK_TO_BACK_CALLS // scale, 0.0))
            best[rows][1] = min(best[rows][1], median_call_seconds(call, AFTER_IDLE_CALLS // scale, idle_seconds))
    return [(rows, *best[rows]) for rows, _ in cases]


def report(results, idle_ms, rounds):
    lines = ["# layernorm pool wake benchmark", "",
             f"- machine: {cpu_model_name()}, simd level {layernorm.simd_level()}",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"- load average (1, 5, 15 min): {load_average_text(os.getloadavg())}",
             f"- case: layer_norm(x, ({COLS},), weight, bias, out=y), float32; median per call, best of "
             f"{rounds} round(s); after idle: each call {idle_ms:g} ms after the previous one", ""]
    for threads, rows in results:
        lines += table_lines(f"## {threads_text(threads)}",
                             ["case", "back to back µs", "after idle µs", "after idle / back to back"],
                             [[f"{n}x{COLS} float32", f"{hot * 1e6:.1f}", f"{cold * 1e6:.1f}", f"{cold / hot:.2f}"]
                              for n, hot, cold in rows])
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pool_wake", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", help="thread counts, comma-separated (default: all usable cores)")
    parser.add_argument("--idle", type=float, default=3.0, help="idle milliseconds before each timed call")
    parser.add_argument("--quick", action="store_true", help="fewer calls, one round")
    parser.add_argument("--markdown", help="also write the report to this path")
    arguments = parser.parse_args(argv)
    thread_counts = ([int(t) for t in arguments.threads.split(",")] if arguments.threads
                     else default_thread_counts()[-1:])
    with garbage_collector_paused():
        results = [(threads, measure(threads, arguments.idle / 1e3, arguments.quick)) for threads in thread_counts]
    text = report(results, arguments.idle, 1 if arguments.quick else ROUNDS)
    print(text)
    if arguments.markdown:
        with open(arguments.markdown, "w", encoding="utf-8") as file:
            file.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
