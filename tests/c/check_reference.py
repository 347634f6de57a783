"""Checks the C kernel layer, through ctypes, against the float64 reference
(layernorm/_reference.py) and against itself across SIMD levels and thread counts.

    python tests/c/check_reference.py                       builds the library with gcc first
    python tests/c/check_reference.py --library LIB.so      a library built with
                                                            tests/c/build-driver.sh CC LIB.so

Two parts, each from NumPy arrays and nothing of the Python package but its reference:

  plan     ln_layout_plan on random shapes, strides (negative, zero, padded) and normalized
           axes: every element's address from the walk it plans equals NumPy's.
  kernels  every route through the kernels -- rows of adjacent elements (short, 16 rows at a
           time, pipelined, long, huge), rows one lane each (channels-first, transposed,
           gathered, several normalized axes), for LayerNorm and RMSNorm, forward, backward
           (statistics broadcast too) and the residual add (in place too) -- planned by
           ln_layout_plan as the binding plans a call, at every level the CPU runs and at 1
           and 2 threads: within the tolerances of the suite (tests/helpers.py) of the float64
           truth, one result at every level and thread count, and a residual call bit for bit
           the norm of its sum.

Exits 1 at the first failure, saying which case.  Run from anywhere; needs NumPy.
"""
import argparse
import ctypes
import hashlib
import importlib.util
import itertools
import pathlib
import random
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The reference by its path: importing the package would need its compiled extension.
_spec = importlib.util.spec_from_file_location("reference", ROOT / "layernorm" / "_reference.py")
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)

# ---------------------------------------------------------------------------------------------
# The C API (src/ln_kernels.h, src/ln_layout.h)
# ---------------------------------------------------------------------------------------------

P = ctypes.c_ssize_t
LAYER, RMS = 0, 1
DTYPES = {np.dtype(np.float16): 0, np.dtype(np.float32): 1, np.dtype(np.float64): 2}


class Extent(ctypes.Structure):
    _fields_ = [("blocks", P), ("rows", P), ("row_len", P)]


class Walk(ctypes.Structure):
    _fields_ = [("block_step", P), ("row_step", P), ("elem_step", P)]


class Array(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("walk", Walk)]


class ForwardArgs(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("dtype", ctypes.c_int), ("extent", Extent), ("input", Array),
                ("residual", Array), ("sum", Array), ("output", Array), ("weight", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("eps", ctypes.c_double), ("mean", Array), ("rstd", Array),
                ("copy", Array)]


class BackwardArgs(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("dtype", ctypes.c_int), ("extent", Extent), ("grad_output", Array),
                ("input", Array), ("mean", Array), ("rstd", Array), ("weight", ctypes.c_void_p),
                ("grad_input", Array), ("grad_weight", ctypes.c_void_p), ("grad_bias", ctypes.c_void_p)]


def load(path):
    lib = ctypes.CDLL(str(path))
    lib.ln_layout_plan.restype = ctypes.c_int
    lib.ln_simd_name.restype = ctypes.c_char_p
    lib.ln_forward.argtypes = [ctypes.POINTER(ForwardArgs)]
    lib.ln_backward.argtypes = [ctypes.POINTER(BackwardArgs)]
    return lib


def plan(lib, shape, axes, arrays):
    """(status, extent, walks) of ln_layout_plan for arrays of the common shape."""
    nd, n = len(shape), len(arrays)
    strides = [(P * nd)(*a.strides) for a in arrays]
    stride_ptrs = (ctypes.POINTER(P) * n)(*[ctypes.cast(s, ctypes.POINTER(P)) for s in strides])
    extent, walks = Extent(), (Walk * n)()
    status = lib.ln_layout_plan(nd, (P * nd)(*shape), len(axes), (ctypes.c_int * len(axes))(*axes), n,
                                stride_ptrs, (P * n)(*[a.itemsize for a in arrays]), ctypes.byref(extent), walks)
    return status, extent, list(walks)


def address(a):
    return a.__array_interface__["data"][0]


def levels(lib):
    """[(level, name)] of the levels this build has and this CPU runs."""
    best = lib.ln_simd_best()
    return [(level, lib.ln_simd_name(level).decode()) for level in range(best + 1)
            if lib.ln_simd_name(level) and lib.ln_simd_set(level) == 0]


# ---------------------------------------------------------------------------------------------
# The layout plan
# ---------------------------------------------------------------------------------------------

def check_plan(lib, shape, axes, arrays):
    """'copy' when the plan refuses the layout, else 'ok' once every address agrees."""
    status, extent, walks = plan(lib, shape, axes, arrays)
    if status != 0:
        return "copy"
    batch_axes = [d for d in range(len(shape)) if d not in axes]
    assert extent.blocks * extent.rows == int(np.prod([shape[d] for d in batch_axes])), (shape, axes)
    assert extent.row_len == int(np.prod([shape[d] for d in axes])), (shape, axes)
    for a, w in zip(arrays, walks):
        for r, batch_index in enumerate(itertools.product(*[range(shape[d]) for d in batch_axes])):
            block, row = divmod(r, extent.rows)
            for j, row_index in enumerate(itertools.product(*[range(shape[d]) for d in axes])):
                index = [0] * len(shape)
                for d, i in itertools.chain(zip(batch_axes, batch_index), zip(axes, row_index)):
                    index[d] = i
                want = sum(i * s for i, s in zip(index, a.strides))
                got = block * w.block_step + row * w.row_step + j * w.elem_step
                assert want == got, (shape, axes, a.strides, block, row, j)
    return "ok"


def random_view(rng, shape):
    """A view of the given shape into a larger array: axes permuted, some strided by 2 or
    reversed, of a random float dtype."""
    nd = len(shape)
    perm = list(range(nd))
    if rng.random() < 0.4:
        rng.shuffle(perm)
    dtype = rng.choice([np.float16, np.float32, np.float64])
    big = np.zeros([shape[p] * (2 if rng.random() < 0.2 else 1) for p in perm], dtype)
    view = big[tuple(slice(None, None, 2) if big.shape[i] != shape[p] else slice(None) for i, p in enumerate(perm))]
    if rng.random() < 0.2:
        view = view[(slice(None, None, -1),) * nd]
    return np.transpose(view, np.argsort(perm))


def check_plans(lib):
    rng = random.Random(0)
    counts = {"ok": 0, "copy": 0}
    for _ in range(3000):
        nd = rng.randint(1, 4)
        shape = [rng.choice([0, 1, 2, 3, 4]) if rng.random() < 0.1 else rng.choice([1, 2, 3, 5]) for _ in range(nd)]
        axes = rng.sample(range(nd), rng.randint(1, nd))
        if rng.random() < 0.5:
            axes = sorted(axes)
        arrays = [random_view(rng, shape) for _ in range(rng.randint(1, 3))]
        counts[check_plan(lib, shape, axes, arrays)] += 1
    assert counts["ok"] > 1000 and counts["copy"] > 100, counts

    # layouts that must walk: NCHW over C with its statistics, C order over trailing axes,
    # statistics broadcast along the other axes; and one that cannot (element order with the
    # middle axis fastest is no single step in C order)
    x = np.zeros((4, 5, 6), np.float32)
    nchw = np.zeros((2, 3, 4, 5), np.float32)
    expected = [
        (nchw.shape, [1], [nchw, np.broadcast_to(np.zeros((2, 1, 4, 5), np.float32), nchw.shape)], "ok"),
        (x.shape, [2], [x], "ok"),
        (x.shape, [1, 2], [x, np.broadcast_to(np.zeros((4, 1, 1)), x.shape)], "ok"),
        (x.shape, [2], [x, np.broadcast_to(np.zeros((1, 1, 1), np.float32), x.shape)], "ok"),
        (x.shape, [2, 1], [x], "copy"),
    ]
    for shape, axes, arrays, outcome in expected:
        assert check_plan(lib, shape, axes, arrays) == outcome, (shape, axes)
    status, extent, walks = plan(lib, nchw.shape, [1], [nchw])
    assert (extent.blocks, extent.rows, extent.row_len) == (2, 20, 3), "NCHW over C: N blocks of H*W rows"
    assert (walks[0].block_step, walks[0].row_step, walks[0].elem_step) == (240, 4, 80)
    for shape in [(3,), (2, 3), (2, 3, 4), (2, 1, 3, 4)]:
        for k in range(1, len(shape) + 1):
            status, extent, walks = plan(lib, shape, list(range(len(shape) - k, len(shape))), [np.zeros(shape)])
            assert status == 0 and extent.blocks == 1 and walks[0].elem_step == 8, (shape, k)
    print(f"plan: {counts['ok']} random layouts walk as NumPy addresses them, {counts['copy']} refused; "
          f"{len(expected)} chosen layouts as expected")


# ---------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------

# Forward: the suite's tolerances (tests/helpers.py REF_REL_TOL), relative to the size of the
# terms a kernel rounds (_reference.output_scale), plus one float16 ulp of the output.
OUTPUT_TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 4 * float(np.finfo(np.float32).eps),
              np.dtype(np.float16): 4 * float(np.finfo(np.float32).eps)}
# Statistics: rounded once to their param type.
STATS_TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-6, np.dtype(np.float16): 1e-6}
# Backward: the suite's (tests/test_backward_values.py RTOL), relative to the size of the
# terms each gradient sums or cancels.
GRAD_TOL = {np.dtype(np.float64): 1e-9, np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2e-3}
EPS = 1e-5


def param_dtype(dtype):
    return np.float64 if dtype == np.float64 else np.float32


def close(what, got, want, tol):
    """|got - want| <= tol (broadcast), NaN exactly where want is NaN."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    nan = np.isnan(want)
    if not np.array_equal(np.isnan(got), nan):
        sys.exit(f"check_reference: {what}: NaNs in other places than the reference's")
    err = np.abs(got - want)[~nan]
    bound = np.broadcast_to(tol, want.shape)[~nan]
    if np.any(err > bound):
        worst = int(np.argmax(err / np.maximum(bound, 1e-300)))
        sys.exit(f"check_reference: {what}: error {err[worst]:.3g} over the tolerance {bound[worst]:.3g}")


def digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        if a is not None:
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


class Layout:
    """How a case lays out its element arrays: `make(base)` gives a view of the C-contiguous
    array `base` (the values) in the memory order of the inputs (x, residual, dy), and
    `make_out` in that of the results (output, sum, grad_input), by default the same."""

    def __init__(self, name, shape, axes, make, make_out=None):
        self.name, self.shape, self.axes = name, shape, axes
        self.make, self.make_out = make, make_out or make

    def empty(self, dtype):
        """An uninitialized result array of the case's shape."""
        return self.make_out(np.empty(self.shape, dtype))


def c_order(base):
    return base


def transposed(base):
    """Stored in reverse axis order (Fortran order)."""
    return np.asfortranarray(base)


def spread(base):
    """Every other element of a wider array along every axis: no two elements adjacent."""
    wide = np.empty([2 * n for n in base.shape], base.dtype)
    view = wide[(slice(None, None, 2),) * base.ndim]
    view[...] = base
    return view


def off_line(base):
    """`base` 16 bytes past the start of a 64-byte line: large rows whose results begin so are
    streamed in 16-byte pieces, not whole lines."""
    raw = np.empty(base.nbytes + 128, np.uint8)
    start = -raw.ctypes.data % 64 + 16
    view = raw[start:start + base.nbytes].view(base.dtype).reshape(base.shape)
    view[...] = base
    return view


LAYOUTS = [
    # rows of adjacent elements: short, 16 at a time forward (with and without a part group),
    # pipelined (within a chunk, and longer than one), huge (split across threads forward,
    # column spans backward)
    Layout("rows-7", (300, 7), (1,), c_order),
    Layout("rows-100", (64, 100), (1,), c_order),
    Layout("rows-64", (37, 64), (1,), c_order),
    Layout("rows-700", (40, 700), (1,), c_order),
    Layout("rows-5000", (20, 5000), (1,), c_order),
    Layout("rows-huge", (3, 40000), (1,), c_order),
    Layout("rows-reversed", (50, 33), (1,), lambda b: np.ascontiguousarray(b[::-1])[::-1]),
    # rows of 16, 16 at a time backward, whose 4 MiB of float32 grad_input (8 MiB of float64)
    # is streamed in 16-byte pieces
    Layout("rows-16-pieces", (1 << 16, 16), (1,), c_order, off_line),
    # rows one lane each: NCHW over C (partial tiles; enough for threads and row blocks),
    # a 2-D array over axis 0, several normalized axes, rows longer than a chunk, gathered
    Layout("nchw-c", (3, 24, 5, 7), (1,), c_order),
    Layout("nchw-c-large", (8, 64, 14, 14), (1,), c_order),
    Layout("columns", (40, 300), (0,), c_order),
    Layout("two-axes", (3, 4, 5, 6), (1, 2), c_order),
    Layout("long-lanes", (2, 2100, 5), (1,), c_order),
    Layout("fortran-rows", (37, 24), (1,), transposed),
    Layout("spread", (4, 24, 9), (1,), spread),
    # results laid out unlike the inputs: rows one lane each either way
    Layout("fortran-to-c", (37, 24), (1,), transposed, c_order),
    Layout("c-to-spread", (20, 18), (1,), c_order, spread),
]


class Case:
    """One layout, kind, dtype and parameter choice: its inputs, and the kernel calls on them
    with arguments planned by ln_layout_plan."""

    def __init__(self, lib, layout, kind, dtype, affine, seed):
        self.lib, self.layout, self.kind, self.dtype = lib, layout, kind, np.dtype(dtype)
        rng = np.random.default_rng(seed)
        shape, axes = layout.shape, layout.axes
        self.ns = tuple(shape[a] for a in axes)
        stats_shape = tuple(1 if d in axes else n for d, n in enumerate(shape))
        offset = rng.uniform(-50, 50, size=stats_shape)
        self.x = layout.make((rng.standard_normal(shape) * rng.uniform(0.1, 10, stats_shape) + offset).astype(dtype))
        self.residual = layout.make(rng.standard_normal(shape).astype(dtype))
        self.dy = layout.make(rng.standard_normal(shape).astype(dtype))
        pdt = param_dtype(dtype)
        self.weight = rng.uniform(0.5, 1.5, self.ns).astype(pdt) if affine else None
        self.bias = rng.uniform(-1, 1, self.ns).astype(pdt) if affine and kind == LAYER else None
        self.stats_shape = stats_shape

    def plan(self, arrays):
        """The extent and ln_arrays of element arrays and statistics (shaped stats_shape, walked
        broadcast along the normalized axes) planned together; None stays absent."""
        present = [np.broadcast_to(a, self.layout.shape) for a in arrays if a is not None]
        status, extent, walks = plan(self.lib, self.layout.shape, list(self.layout.axes), present)
        assert status == 0, f"{self.layout.name}: the plan refused the layout"
        walks = iter(walks)
        return extent, [Array(address(a), next(walks)) if a is not None else Array() for a in arrays]

    def forward(self, x, output, mean, rstd, residual=None, total=None):
        """ln_forward of x (total: where the sum x + residual goes); None: absent."""
        extent, (x, r, s, y, m, v) = self.plan([x, residual, total, output, mean, rstd])
        args = ForwardArgs(self.kind, DTYPES[self.dtype], extent, x, r, s, y, pointer(self.weight),
                           pointer(self.bias), EPS, m, v)
        assert self.lib.ln_forward(ctypes.byref(args)) == 0

    def backward(self, mean, rstd, grad_input, grad_weight, grad_bias):
        """ln_backward of the case's dy and x with these statistics; None: absent."""
        extent, (dy, x, m, v, dx) = self.plan([self.dy, self.x, mean, rstd, grad_input])
        args = BackwardArgs(self.kind, DTYPES[self.dtype], extent, dy, x, m, v, pointer(self.weight), dx,
                            pointer(grad_weight), pointer(grad_bias))
        assert self.lib.ln_backward(ctypes.byref(args)) == 0


def pointer(a):
    return address(a) if a is not None else None


def new_stats(case):
    """(mean, rstd) arrays for a forward call: no mean for RMSNorm."""
    pdt = param_dtype(case.dtype)
    return np.empty(case.stats_shape, pdt) if case.kind == LAYER else None, np.empty(case.stats_shape, pdt)


def check_forward(case, where):
    """The output and statistics against the reference; the residual call's sum against
    NumPy's x + residual, and its results (in place too) against a plain call on that sum,
    bit for bit.  Returns a digest of every result."""
    axes = case.layout.axes
    with np.errstate(all="ignore"):
        if case.kind == LAYER:
            y, mean, rstd = reference.layer_norm(case.x, case.ns, case.weight, case.bias, EPS, axis=axes)
        else:
            (y, rstd), mean = reference.rms_norm(case.x, case.ns, case.weight, EPS, axis=axes), None
        scale = reference.output_scale(case.x, case.ns, case.weight, case.bias, EPS, centred=case.kind == LAYER,
                                       axis=axes)
    tol = OUTPUT_TOL[case.dtype] * scale + (f16_ulp(y) if case.dtype == np.float16 else 0.0)
    plain = (case.layout.empty(case.dtype), *new_stats(case))
    case.forward(case.x, *plain)
    close(f"{where}: output", plain[0], y, tol)
    row_size = np.max(np.abs(case.x.astype(np.float64)), axis=axes, keepdims=True)
    if mean is not None:
        close(f"{where}: mean", plain[1], mean, STATS_TOL[case.dtype] * row_size)
    close(f"{where}: rstd", plain[2], rstd, STATS_TOL[case.dtype] * np.abs(rstd))

    total = case.layout.empty(case.dtype)
    added = (case.layout.empty(case.dtype), *new_stats(case))
    case.forward(case.x, *added, case.residual, total)
    if not bitwise_equal(total, case.x + case.residual):
        sys.exit(f"check_reference: {where}: sum is not NumPy's input + residual, bit for bit")
    of_total = (case.layout.empty(case.dtype), *new_stats(case))
    case.forward(total, *of_total)
    # input, sum and output in one array laid out as the input, and a plain call laid out so
    in_place = case.layout.make(np.ascontiguousarray(case.x))
    case.forward(in_place, in_place, None, None, case.residual, in_place)
    total_in_place = case.layout.make(np.ascontiguousarray(total))
    of_total_in_place = case.layout.make(np.empty(case.layout.shape, case.dtype))
    case.forward(total_in_place, of_total_in_place, None, None)
    for name, got, want in [("output", added[0], of_total[0]), ("mean", added[1], of_total[1]),
                            ("rstd", added[2], of_total[2]), ("in-place output", in_place, of_total_in_place)]:
        if got is not None and not bitwise_equal(got, want):
            sys.exit(f"check_reference: {where}: residual {name} is not the norm of the sum, bit for bit")
    return digest(*plain, total, *added, in_place)


def bitwise_equal(a, b):
    """Same shape and the same bits, NaNs of any payload alike."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = np.isnan(a)
    return np.array_equal(nan, np.isnan(b)) and np.ascontiguousarray(a[~nan]).tobytes() == \
        np.ascontiguousarray(b[~nan]).tobytes()


def f16_ulp(values):
    """One float16 ulp at |values| (tests/helpers.py)."""
    mag = np.abs(np.asarray(values, dtype=np.float64)).astype(np.float16)
    return np.spacing(mag).astype(np.float64)


def given_stats_gradients(case, mean, rstd):
    """The float64 gradients for exactly these statistics (as the kernel reads them)."""
    mean = np.zeros(case.stats_shape) if mean is None else np.broadcast_to(mean, case.stats_shape).astype(np.float64)
    rstd = np.broadcast_to(rstd, case.stats_shape).astype(np.float64)
    with np.errstate(all="ignore"):
        xhat = (case.x.astype(np.float64) - mean) * rstd
        normalized = reference.Normalized(xhat, mean, rstd, case.layout.axes)
        dx, dw, db = reference._backward(case.dy, normalized, case.weight, centred=case.kind == LAYER)
        g = np.abs(case.dy.astype(np.float64)) * np.abs(normalized.expand(case.weight))
        dx_scale = max(float(np.max(rstd * g, initial=0.0)), 1.0)
        other = tuple(d for d in range(case.x.ndim) if d not in case.layout.axes)
        terms = np.abs(case.dy.astype(np.float64)) * (np.abs(case.x.astype(np.float64)) + np.abs(mean)) * rstd
        dw_scale = max(float(np.max(terms.sum(axis=other), initial=0.0)), 1.0)
    return (dx, dx_scale), (dw, dw_scale), (db if case.kind == LAYER else None, 1.0)


def check_backward(case, where, broadcast):
    """Gradients from the statistics forward wrote, or (broadcast) from those of the first
    index of the first batch axis, walked with a zero step along that axis."""
    pdt = param_dtype(case.dtype)
    mean, rstd = new_stats(case)
    case.forward(case.x, case.layout.empty(case.dtype), mean, rstd)
    if broadcast:
        first_batch_axis = next(d for d in range(case.x.ndim) if d not in case.layout.axes)
        pick = tuple(slice(0, 1) if d == first_batch_axis else slice(None) for d in range(case.x.ndim))
        mean = None if mean is None else np.broadcast_to(mean[pick], case.stats_shape)
        rstd = np.broadcast_to(rstd[pick], case.stats_shape)
    got = [case.layout.empty(case.dtype), np.empty(case.ns, pdt) if case.weight is not None else None,
           np.empty(case.ns, pdt) if case.kind == LAYER else None]
    case.backward(mean, rstd, *got)
    expected = given_stats_gradients(case, mean, rstd)
    for name, value, (want, scale) in zip(("grad_input", "grad_weight", "grad_bias"), got, expected):
        if value is None:
            continue
        want = np.asarray(want)
        size = max(float(np.max(np.abs(want), initial=0.0)), scale)
        close(f"{where}: {name}", value, want, GRAD_TOL[case.dtype] * size)
    return digest(*got)


def check_kernels(lib):
    runs = levels(lib)
    checked = 0
    for layout in LAYOUTS:
        for kind, dtype, affine in itertools.product((LAYER, RMS), (np.float16, np.float32, np.float64), (1, 0)):
            seed = checked
            hashes = {}
            for (level, level_name), threads in itertools.product(runs, (1, 2)):
                lib.ln_simd_set(level)
                lib.ln_threads_set(threads)
                where = (f"{layout.name} {'rms' if kind == RMS else 'layer'} {np.dtype(dtype).name}"
                         f"{' affine' if affine else ''} {level_name} t{threads}")
                case = Case(lib, layout, kind, dtype, affine, seed)
                hashes[where] = (check_forward(case, where), check_backward(case, where, broadcast=False),
                                 check_backward(case, where, broadcast=True))
            if len(set(hashes.values())) != 1:
                sys.exit(f"check_reference: results differ between levels or threads: {sorted(hashes)}")
            checked += 1
    names = " ".join(name for _, name in runs)
    print(f"kernels: {checked} cases ({len(LAYOUTS)} layouts x 2 kinds x 3 dtypes x 2 parameter choices) "
          f"within the suite's tolerances of the float64 reference, forward, residual, backward and "
          f"broadcast statistics; one result each at levels {names} and threads 1 2")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", help="a shared build of the kernel sources (tests/c/build-driver.sh)")
    args = parser.parse_args()
    library = args.library
    if library is None:
        library = ROOT / "build" / "kernel-driver" / "libln_kernels.so"
        subprocess.run(["bash", str(ROOT / "tests" / "c" / "build-driver.sh"), "gcc", str(library)], check=True)
    lib = load(library)
    check_plans(lib)
    check_kernels(lib)


if __name__ == "__main__":
    main()
