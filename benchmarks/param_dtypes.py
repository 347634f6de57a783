"""Parameter-dtype benchmark: 16-bit inputs with parameters in their own dtype or in float32.

Usage, from the repository root:
    python -m benchmarks.param_dtypes [--threads N[,M]] [--quick] [--markdown PATH]

    --threads N[,M]  thread counts for layernorm and torch (default: 1 and all usable cores)
    --quick          one shape, few turns (smoke test, < 1 min)
    --markdown PATH  also write the report to PATH

Case: float16 and bfloat16 rows (1x4096, 16x768, 16x4096, 512x768), with weight and bias in the
input's dtype, as a module made with dtype=float16 or loaded from a bfloat16 checkpoint holds
them, and in float32: layer_norm against torch.nn.functional.layer_norm (no_grad) given the same
parameters.  The main benchmark (python -m benchmarks) gives every case float32 parameters.

Method: the calls of one case and thread count take turns, each the best of its turns
(benchmarks.timing's round robin).  Reported: microseconds per call, ours / torch, and ours with
16-bit parameters / ours with float32 ones (what converting the parameters costs a call).
"""

from __future__ import annotations

import datetime
import os
import sys

import numpy as np

import layernorm

from . import peers
from .cases import EPS, numpy_dtype
from .report import cpu_model_name, load_average_text, run_sweep_script, table_lines, thread_counts_text
from .timing import FULL_SETTINGS, QUICK_SETTINGS, Timed, best_times_round_robin, threads_text

SHAPES = ((1, 4096), (16, 768), (16, 4096), (512, 768))
QUICK_SHAPES = ((16, 768),)
DTYPES = ("float16", "bfloat16")
PARAMS = ("same", "float32")  # weight and bias in the input's dtype, or in float32


def dtype_names():
    """The 16-bit dtypes this environment has: bfloat16 needs ml_dtypes."""
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return DTYPES[:1]
    return DTYPES


def calls(shape, dtype_name, threads):
    """name -> Timed: ours and torch's forward, with each kind of parameters."""
    dtype = numpy_dtype(dtype_name)
    rng = np.random.default_rng(shape[-1])
    x = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    n = shape[-1]
    same = (rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype))
    params = {"same": same, "float32": tuple(param.astype(np.float32) for param in same)}  # the same values
    timed = {f"ours {kind}": Timed(layernorm.layer_norm, (x, (n,), *params[kind], EPS), layernorm.set_num_threads)
             for kind in PARAMS}
    torch = peers.torch
    if torch is not None:
        tx = peers.as_torch(x, dtype)
        for kind in PARAMS:
            tw, tb = (peers.as_torch(p, p.dtype) for p in params[kind])

            def torch_forward(tw=tw, tb=tb):
                with torch.no_grad():
                    return torch.nn.functional.layer_norm(tx, (n,), tw, tb, EPS)

            timed[f"torch {kind}"] = Timed(torch_forward, (), torch.set_num_threads)
    return {name: t.at(threads) for name, t in timed.items()}


def measure(thread_counts, quick):
    """{threads: {(dtype name, shape): {name: seconds}}}."""
    settings = QUICK_SETTINGS if quick else FULL_SETTINGS
    shapes = QUICK_SHAPES if quick else SHAPES
    results = {threads: {} for threads in thread_counts}
    for _ in range(settings.rounds):
        for threads in thread_counts:
            for dtype_name in dtype_names():
                for shape in shapes:
                    best = best_times_round_robin(calls(shape, dtype_name, threads), settings)
                    key = (dtype_name, shape)
                    previous = results[threads].get(key, {})
                    results[threads][key] = {name: min(t, previous.get(name, t)) for name, t in best.items()}
                    print(f"  {threads_text(threads)}, {dtype_name} {shape}: "
                          + ", ".join(f"{name} {t * 1e6:.1f} us" for name, t in best.items()), file=sys.stderr)
    return results


def ratio_text(numerator, denominator):
    return f"{numerator / denominator:.2f}" if numerator and denominator else "n/a"


def report(results, quick, loads):
    lines = [
        "# layernorm parameter-dtype benchmark",
        "",
        f"- machine: {cpu_model_name()}, {os.cpu_count()} cores; simd level {layernorm.simd_level()}",
        f"- versions: numpy {np.__version__}, torch {peers.torch_version() or 'not installed'},"
        f" layernorm {layernorm.__version__}",
        f"- load average: {load_average_text(loads[0])} before, {load_average_text(loads[1])} after",
        "- forward of 16-bit rows, weight and bias in the input's dtype (same) or float32, the same"
        f" arrays every call; {'quick run' if quick else 'best of interleaved turns'} at"
        f" {thread_counts_text(list(results))} threads",
        f"- {datetime.date.today().isoformat()}",
    ]
    for threads, by_case in results.items():
        rows = []
        for (dtype_name, shape), times in by_case.items():
            ours_same, ours_f32 = times["ours same"], times["ours float32"]
            rows.append([f"{shape[0]}x{shape[1]} {dtype_name}", f"{ours_same * 1e6:.1f}", f"{ours_f32 * 1e6:.1f}",
                         ratio_text(ours_same, times.get("torch same")),
                         ratio_text(ours_f32, times.get("torch float32")), ratio_text(ours_same, ours_f32)])
        lines += [""] + table_lines(
            f"## {threads_text(threads)}",
            ["case", "ours same µs", "ours float32 µs", "same: ours / torch", "float32: ours / torch",
             "ours same / float32"],
            rows,
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    run_sweep_script(__doc__, measure, report, argv)


if __name__ == "__main__":
    main()
