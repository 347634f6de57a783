"""The norm family's benchmark: RMSNorm, channels-first LayerNorm over axis=1 and the fused
residual adds, each against what a user would otherwise run and against its memory floor.

Usage, from the repository root:
    python -m benchmarks.family [--threads N[,M]] [--quick] [--fresh] [--markdown PATH]
                                [--cases SUBSTRING]

--cases keeps the comparisons whose label contains SUBSTRING (--cases block: the examples' rows).

What is timed (one row per comparison, at each thread count; single-threaded peers once; the
copy cut into a part per thread, the fastest of at most the table's thread count):
    rms fwd/bwd    layernorm.rms_norm / rms_norm_backward vs torch.nn.functional.rms_norm and
                   its forward and autograd backward together (backward alone: ours; torch 2.13
                   has no CPU kernel for aten._fused_rms_norm_backward), on the main benchmark's
                   standard cases;
                   forward also vs ONNX Runtime's RMSNormalization (opset 23) when installed
    channels-first layer_norm(x, 64, w, b, axis=1) on (8, 64, 56, 56) float32 NCHW, and its
                   backward, vs torch's permute route (permute to NHWC, contiguous, layer_norm,
                   permute back) and vs np.copyto of x (forward) or of 1.5 times x (backward);
                   and in place (out=x) on (24, 64, 32, 32), whose channels are 4 KiB apart,
                   without a target
    add            add_layer_norm / add_rms_norm on 2048x4096 float32 vs np.add followed by
                   layer_norm / rms_norm, and vs np.copyto of x: the floor is two copies (input
                   and residual read, sum and output written)
    block          the end-to-end examples' forwards, NumPy with layernorm vs torch, without
                   targets; left out when torch is not installed (the examples import it):
                   GPT-2-style and Llama-style stacks of examples/transformer_blocks.py
                   (d_model 384, 6 heads, 2 layers, batch 1, 64 tokens), and ConvNeXt's
                   channels-first LayerNorm of examples/convnext_norm.py on (8, 96, 56, 56)
                   float32 (ConvNeXt-T's first stage) vs torch's permute route and vs np.copyto
                   of x.  NumPy's matrix products run on NumPy's BLAS at its own thread count:
                   the thread count of a table is layernorm's and torch's

Every call is checked before it is timed: against the float64 reference (layernorm._reference),
and the block rows against torch by their example's own difference and tolerance.
The method is the main benchmark's (benchmarks/timing.py): interleaved round-robin turns, best
turn per call.  The report ends with the targets as a checklist (met / NOT met).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

import layernorm
from layernorm import _reference

from . import peers, timing
from .cases import EPS
from .peers import ort_timed, torch, torch_no_grad
from .report import cpu_model_name, load_average_text, table_lines

STANDARD_SHAPES = [(4, 20), (16, 768), (512, 768), (2048, 4096), (1_000_000, 8), (8, 1_000_000)]
CHANNELS_FIRST_SHAPE = (8, 64, 56, 56)
IN_PLACE_SHAPE = (24, 64, 32, 32)  # 32 x 32 images: channel strides of a power of two bytes
ADD_SHAPE = (2048, 4096)
# The examples' sizes: one NumPy forward of each stack takes a few ms
BLOCK_SIZE = {"d_model": 384, "n_heads": 6, "n_layers": 2, "batch": 1, "seq": 64}
CONVNEXT_SHAPE = (8, 96, 56, 56)  # ConvNeXt-T's first stage
EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")

# (what, the peer it is compared with, the largest ratio the targets allow)
TARGETS = {
    "rms": ("torch", 0.5),
    "rms vs ort": ("ort", 0.8),
    "channels-first vs copy": ("copy", 1.5),
    "channels-first vs torch": ("torch", 0.3),
    "add vs copy": ("copy", 2.2),
    "add vs unfused": ("unfused", 0.8),
}


@dataclass
class Comparison:
    """Calls timed together: "ours" and its peers (name -> Timed), checked first."""

    label: str
    calls: dict
    checks: list  # (target name, peer) pairs reported as ratios of ours to that peer
    error: str = ""
    times: dict = field(default_factory=dict)  # (name, threads) -> seconds


def threaded(call, *args):
    return timing.Timed(call, args, set_num_threads=layernorm.set_num_threads)


def torch_threaded(call, *args):
    return timing.Timed(call, args, set_num_threads=torch.set_num_threads)


def close_to(ours, reference, dtype):
    """Whether ours is within the float tolerance of its dtype of the float64 reference."""
    tolerance = {np.float16: 2e-2, np.float32: 1e-4, np.float64: 1e-10}[np.dtype(dtype).type]
    ours = np.asarray(ours, np.float64)
    scale = max(1.0, float(np.max(np.abs(reference)))) if reference.size else 1.0
    return ours.shape == reference.shape and float(np.max(np.abs(ours - reference), initial=0.0)) <= tolerance * scale


def torch_rms_backward(dy_t, x_t, cols, w_t):
    """torch's gradients of F.rms_norm by autograd (torch 2.13 has no CPU kernel for
    aten._fused_rms_norm_backward): the forward is part of what torch must run to get them."""
    with torch.enable_grad():
        x_req, w_req = x_t.detach().requires_grad_(), w_t.detach().requires_grad_()
        torch.nn.functional.rms_norm(x_req, [cols], w_req, EPS).backward(dy_t)
    return x_req.grad, w_req.grad


def rms_comparisons(rng):
    comparisons = []
    for rows, cols in STANDARD_SHAPES:
        x = rng.standard_normal((rows, cols), dtype=np.float32)
        dy = rng.standard_normal((rows, cols), dtype=np.float32)
        w = rng.standard_normal(cols).astype(np.float32)
        _, rstd = layernorm.native_rms_norm(x, cols, w, EPS)
        forward = {"ours": threaded(layernorm.rms_norm, x, cols, w, EPS)}
        backward = {"ours": threaded(layernorm.rms_norm_backward, dy, x, cols, rstd, w)}
        if torch:
            x_t, dy_t, w_t = torch.from_numpy(x), torch.from_numpy(dy), torch.from_numpy(w)
            forward["torch"] = torch_threaded(torch.nn.functional.rms_norm, x_t, [cols], w_t, EPS)
            backward["torch"] = torch_threaded(torch_rms_backward, dy_t, x_t, cols, w_t)
        reference = _reference.rms_norm(x, cols, w, EPS)[0]
        reference_grad = _reference.rms_norm_backward(dy, x, cols, w, EPS)[0]
        label = f"rms fwd {rows}x{cols} float32"
        ort_call = ort_timed("RMSNormalization", label, x, w)
        if ort_call:
            forward["ort"] = ort_call
        fwd = Comparison(label, forward, [("rms", "torch"), ("rms vs ort", "ort")])
        bwd = Comparison(f"rms bwd {rows}x{cols} float32", backward, [("rms", "torch")])
        fwd.error = "" if close_to(forward["ours"].run(), reference, np.float32) else "WRONG"
        bwd.error = "" if close_to(backward["ours"].run()[0], reference_grad, np.float32) else "WRONG"
        comparisons += [fwd, bwd]
    return comparisons


def channels_first_comparisons(rng):
    x = rng.standard_normal(CHANNELS_FIRST_SHAPE, dtype=np.float32)
    dy = rng.standard_normal(CHANNELS_FIRST_SHAPE, dtype=np.float32)
    channels = CHANNELS_FIRST_SHAPE[1]
    w = rng.standard_normal(channels).astype(np.float32)
    b = rng.standard_normal(channels).astype(np.float32)
    _, mean, rstd = layernorm.native_layer_norm(x, channels, w, b, EPS, axis=1)
    forward = {
        "ours": threaded(lambda x, w, b: layernorm.layer_norm(x, channels, w, b, EPS, axis=1), x, w, b),
        "copy": peers.copy(x),
    }
    backward = {
        "ours": threaded(lambda dy, x, mean, rstd, w, b: layernorm.layer_norm_backward(
            dy, x, channels, mean, rstd, w, b, axis=1), dy, x, mean, rstd, w, b),
        "copy": peers.copy(np.concatenate((x.ravel(), dy.ravel()[: x.size // 2]))),
    }
    if torch:
        x_t, dy_t, w_t, b_t = map(torch.from_numpy, (x, dy, w, b))

        def torch_forward(x_t, w_t, b_t):
            nhwc = x_t.permute(0, 2, 3, 1).contiguous()
            return torch.nn.functional.layer_norm(nhwc, [channels], w_t, b_t, EPS).permute(0, 3, 1, 2)

        nhwc = x_t.permute(0, 2, 3, 1).contiguous()
        _, mean_t, rstd_t = torch.ops.aten.native_layer_norm(nhwc, [channels], w_t, b_t, EPS)

        def torch_backward(dy_t, nhwc, mean_t, rstd_t, w_t, b_t):
            grads = torch.ops.aten.native_layer_norm_backward(
                dy_t.permute(0, 2, 3, 1).contiguous(), nhwc, [channels], mean_t, rstd_t, w_t, b_t,
                [True, True, True])
            return (grads[0].permute(0, 3, 1, 2),) + tuple(grads[1:])

        forward["torch"] = torch_threaded(torch_forward, x_t, w_t, b_t)
        backward["torch"] = torch_threaded(torch_backward, dy_t, nhwc, mean_t, rstd_t, w_t, b_t)
    label = "x".join(map(str, CHANNELS_FIRST_SHAPE))
    checks = [("channels-first vs copy", "copy"), ("channels-first vs torch", "torch")]
    fwd = Comparison(f"channels-first fwd {label} axis=1", forward, checks)
    bwd = Comparison(f"channels-first bwd {label} axis=1", backward, checks)
    reference = _reference.layer_norm(x, channels, w, b, EPS, axis=1)[0]
    reference_grad = _reference.layer_norm_backward(dy, x, channels, w, b, EPS, axis=1)[0]
    fwd.error = "" if close_to(forward["ours"].run(), reference, np.float32) else "WRONG"
    bwd.error = "" if close_to(backward["ours"].run()[0], reference_grad, np.float32) else "WRONG"
    return [fwd, bwd, channels_first_in_place_comparison(rng, w, b)]


def channels_first_in_place_comparison(rng, w, b):
    x = rng.standard_normal(IN_PLACE_SHAPE, dtype=np.float32)
    channels = IN_PLACE_SHAPE[1]
    calls = {
        "ours": threaded(lambda x, w, b: layernorm.layer_norm(x, channels, w, b, EPS, axis=1, out=x), x, w, b),
        "copy": peers.copy(x),
    }
    if torch:
        def torch_forward(x_t, w_t, b_t):
            nhwc = x_t.permute(0, 2, 3, 1).contiguous()
            return torch.nn.functional.layer_norm(nhwc, [channels], w_t, b_t, EPS).permute(0, 3, 1, 2)

        calls["torch"] = torch_threaded(torch_forward, *map(torch.from_numpy, (x.copy(), w, b)))
    label = "x".join(map(str, IN_PLACE_SHAPE))
    comparison = Comparison(f"channels-first fwd {label} axis=1 in place", calls, [])
    reference = _reference.layer_norm(x, channels, w, b, EPS, axis=1)[0]
    ours = x.copy()
    layernorm.layer_norm(ours, channels, w, b, EPS, axis=1, out=ours)
    comparison.error = "" if close_to(ours, reference, np.float32) else "WRONG"
    return comparison


def add_comparisons(rng):
    x = rng.standard_normal(ADD_SHAPE, dtype=np.float32)
    residual = rng.standard_normal(ADD_SHAPE, dtype=np.float32)
    cols = ADD_SHAPE[1]
    w = rng.standard_normal(cols).astype(np.float32)
    b = rng.standard_normal(cols).astype(np.float32)
    out, total = np.empty_like(x), np.empty_like(x)

    def unfused_layer_norm(x, residual, w, b, out, total):
        np.add(x, residual, out=total)
        return layernorm.layer_norm(total, cols, w, b, EPS, out=out), total

    def unfused_rms_norm(x, residual, w, out, total):
        np.add(x, residual, out=total)
        return layernorm.rms_norm(total, cols, w, EPS, out=out), total

    copy = peers.copy(x)
    checks = [("add vs copy", "copy"), ("add vs unfused", "unfused")]
    layer = Comparison(f"add_layer_norm {ADD_SHAPE[0]}x{cols} float32 out=", {
        "ours": threaded(lambda *a: layernorm.add_layer_norm(*a[:2], cols, *a[2:4], EPS, out=a[4], residual_out=a[5]),
                         x, residual, w, b, out, total),
        "unfused": threaded(unfused_layer_norm, x, residual, w, b, np.empty_like(x), np.empty_like(x)),
        "copy": copy,
    }, checks)
    rms = Comparison(f"add_rms_norm {ADD_SHAPE[0]}x{cols} float32 out=", {
        "ours": threaded(lambda *a: layernorm.add_rms_norm(*a[:2], cols, a[2], EPS, out=a[3], residual_out=a[4]),
                         x, residual, w, out, total),
        "unfused": threaded(unfused_rms_norm, x, residual, w, np.empty_like(x), np.empty_like(x)),
        "copy": copy,
    }, checks)
    layer.error = "" if close_to(layer.calls["ours"].run()[0], _reference.layer_norm(
        (x + residual), cols, w, b, EPS)[0], np.float32) and np.array_equal(total, x + residual) else "WRONG"
    rms.error = "" if close_to(rms.calls["ours"].run()[0], _reference.rms_norm(
        (x + residual), cols, w, EPS)[0], np.float32) and np.array_equal(total, x + residual) else "WRONG"
    return [layer, rms]


def load_example(name):
    """examples/<name>.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", os.path.join(EXAMPLES_DIR, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def block_comparisons(rng):
    """The examples' NumPy forwards against torch's forwards of the same models; none without
    torch, which the examples import."""
    if not torch:
        print("  torch not installed: the block rows are left out", file=sys.stderr)
        return []
    blocks, convnext = load_example("transformer_blocks"), load_example("convnext_norm")
    seed = int(rng.integers(1 << 31))
    comparisons = []
    shape = "x".join(map(str, (BLOCK_SIZE["batch"], BLOCK_SIZE["seq"], BLOCK_SIZE["d_model"])))
    for name, build in (("GPT-2", blocks.build_gpt2), ("Llama", blocks.build_llama)):
        built = build(**BLOCK_SIZE, seed=seed)
        comparison = Comparison(f"block {name} {BLOCK_SIZE['n_layers']} layers {shape} float32", {
            "ours": threaded(built.numpy, built.input),
            "torch": torch_threaded(built.torch, torch.from_numpy(built.input)),
        }, [])
        comparison.error = "" if blocks.difference(built) <= blocks.TOLERANCE else "WRONG"
        comparisons.append(comparison)
    built = convnext.build_convnext_norm(CONVNEXT_SHAPE, seed=seed)
    comparison = Comparison(f"block ConvNeXt norm {'x'.join(map(str, CONVNEXT_SHAPE))} axis=1", {
        "ours": threaded(built.numpy, built.input),
        "torch": torch_threaded(built.torch_permute, torch.from_numpy(built.input)),
        "copy": peers.copy(built.input),
    }, [])
    differences = convnext.forward_differences(built)
    comparison.error = "" if max(differences.values()) <= convnext.TOLERANCE else "WRONG"
    return comparisons + [comparison]


def measure(comparisons, settings, thread_counts, fresh):
    for comparison in comparisons:
        if comparison.error:
            continue
        timed = {}
        for name, call in comparison.calls.items():
            for threads in peers.floor_thread_counts(name, thread_counts) if call.threaded else [None]:
                timed[name, threads] = call if threads is None else call.at(threads)
        comparison.times = peers.floor_times(timing.best_times_round_robin(timed, settings, fresh))
        print(f"  {comparison.label}: done", file=sys.stderr, flush=True)


def ratio(comparison, peer, threads):
    ours = comparison.times.get(("ours", threads))
    other = comparison.times.get((peer, threads), comparison.times.get((peer, None)))
    return None if ours is None or other is None else ours / other


def report_lines(comparisons, thread_counts, settings, loads, fresh):
    torch_text = f"torch {torch.__version__}" if torch else "torch not installed (its columns: n/a)"
    lines = [
        "# layernorm norm-family benchmark",
        "",
        f"- machine: {cpu_model_name()}, {timing.usable_cores()} usable cores; simd level {layernorm.simd_level()}",
        f"- versions: numpy {np.__version__}, {torch_text}, layernorm {layernorm.__version__}",
        f"- load average: {load_average_text(loads[0])} before, {load_average_text(loads[1])} after",
        f"- method: best of {settings.rounds * settings.repetitions} interleaved turns of ~"
        f"{settings.loop_seconds * 1e3:.0f} ms; {'fresh arrays every call' if fresh else 'the same arrays every call'}",
        "",
    ]
    checklist = []
    for threads in thread_counts:
        rows = []
        for comparison in comparisons:
            if comparison.error:
                rows.append([comparison.label, comparison.error, "", "", "", ""])
                continue
            ours = comparison.times[("ours", threads)]
            cells = [comparison.label, f"{ours * 1e6:.1f}"]
            for peer in ("torch", "ort", "copy", "unfused"):
                value = ratio(comparison, peer, threads)
                cells.append("n/a" if value is None else f"{value:.2f}")
            rows.append(cells)
            for target, peer in comparison.checks:
                value = ratio(comparison, peer, threads)
                limit = TARGETS[target][1]
                status = "n/a" if value is None else "met" if value <= limit else "NOT met"
                shown = "n/a" if value is None else f"{value:.2f}"
                checklist.append(f"- [{status}] {comparison.label}, {timing.threads_text(threads)}: "
                                 f"ours / {peer} = {shown} (target <= {limit})")
        lines += table_lines(f"## {timing.threads_text(threads)}",
                             ["case", "ours µs", "ours / torch", "ours / ort", "ours / copy", "ours / unfused"], rows)
        lines.append("")
    lines += ["## Targets", "", *checklist, ""]
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.family", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default=",".join(map(str, timing.default_thread_counts())))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--markdown")
    parser.add_argument("--cases", default="", metavar="SUBSTRING",
                        help="time only the comparisons whose label contains SUBSTRING")
    arguments = parser.parse_args(argv)
    thread_counts = tuple(int(part) for part in arguments.threads.split(","))
    settings = timing.QUICK_SETTINGS if arguments.quick else timing.FULL_SETTINGS
    rng = np.random.default_rng(0)
    load_at_start = os.getloadavg()
    started = time.perf_counter()
    with torch_no_grad():
        comparisons = [comparison for comparison in rms_comparisons(rng) + channels_first_comparisons(rng)
                       + add_comparisons(rng) + block_comparisons(rng) if arguments.cases in comparison.label]
        if not comparisons:
            parser.error(f"no comparison's label contains {arguments.cases!r}")
        # rounds: each comparison measured at several moments of the run, best kept
        best = {}
        for _ in range(settings.rounds):
            measure(comparisons, timing.Settings(1, settings.repetitions, settings.loop_seconds),
                    thread_counts, arguments.fresh)
            for comparison in comparisons:
                for key, seconds in comparison.times.items():
                    best[comparison.label, key] = min(seconds, best.get((comparison.label, key), float("inf")))
        for comparison in comparisons:
            comparison.times = {key: seconds for (label, key), seconds in best.items() if label == comparison.label}
    print(f"finished in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    report = "\n".join(report_lines(comparisons, thread_counts, settings, (load_at_start, os.getloadavg()),
                                    arguments.fresh)) + "\n"
    sys.stdout.write(report)
    if arguments.markdown:
        with open(arguments.markdown, "w", encoding="utf-8") as markdown_file:
            markdown_file.write(report)
    if any(comparison.error for comparison in comparisons):
        sys.exit(1)


if __name__ == "__main__":
    main()
