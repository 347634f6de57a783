"""Rows whose statistics leave the row kernels' number ranges get the float64 reference's answer
on every route: float64 rows whose squared deviations overflow, float16/float32 rows whose rstd
is beyond float32's range or whose rstd * weight is below float32's normal range, float32 rows
of subnormal data whose mean float32 arithmetic cannot hold.  Rows holding
NaN or Inf give NaN, as one quiet NaN.  bfloat16 (with ml_dtypes) goes the float32 rows' way.

Each route of the kernel layer is reached by its shape: rows shorter than a group (3), rows of
one chunk (40), rows of several chunks (5000), one huge row split across threads (70000), rows
whose elements are strided (a transposed input), and the fused residual add."""

import numpy as np
import pytest

import layernorm
from helpers import REF_REL_TOL, TINY_PRODUCT_MAGNITUDES, assert_within, tiny_product_id
from layernorm import _reference

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

BF16 = np.dtype(ml_dtypes.bfloat16) if ml_dtypes else None
DTYPES = [np.float16, np.float32, np.float64] + ([BF16] if BF16 else [])
ROW_LENGTHS = [3, 40, 5000, 70000]
LAYOUTS = ["rows", "transposed", "residual"]


def _extreme(kind, row_len):
    """(dtype, x rows, weight, eps) for each kind of extreme row, two rows of row_len elements,
    the first extreme, the second ordinary."""
    rows = np.zeros((2, row_len))
    rows[1] = np.linspace(-1.0, 1.0, row_len)
    if kind == "float64-squares-overflow":
        rows[0, :2] = [1e200, -1e200]
        return np.float64, rows, None, 1e-5
    if kind == "float64-squares-overflow-near-max":
        rows[0] = 1e308
        rows[0, :2] = [np.nextafter(1e308, 0), np.nextafter(1e308, np.inf)]
        return np.float64, rows, None, 1e-5
    if kind == "float32-constant-row-eps-1e-80":
        rows[0] = 1.0
        return np.float32, rows, None, 1e-80
    if kind == "float16-constant-row-eps-5e-324":
        return np.float16, rows, None, 5e-324
    if kind == "float32-subnormal-rstd-times-weight":
        rows[0, :2] = [3e37, -3e37]
        return np.float32, rows, np.full(row_len, 1e-5, np.float32), 1e-5
    if kind == "float32-centred-overflows":  # x - mean beyond float32: 3e38 - (-2.9e38)
        rows[0] = -3e38
        rows[0, 0] = 3e38
        return np.float32, rows, None, 1e-5
    if kind == "bfloat16-squares-overflow":
        rows[0, :2] = [3e38, -3e38]
        return BF16, rows, None, 1e-5
    if kind == "bfloat16-constant-row-eps-1e-80":
        rows[0] = 1.0
        return BF16, rows, None, 1e-80
    # squares below the normal range of the type they are summed in (float32 for bfloat16,
    # float64 for float64), with no eps to outweigh their rounding
    wave = np.sin(np.arange(row_len) + 1.0)
    if kind == "bfloat16-squares-subnormal-eps-0":
        rows[0] = 1e-30 * wave
        return BF16, rows, None, 0.0
    if kind == "bfloat16-squares-subnormal-eps-1e-70":
        rows[0] = 1e-22 * wave
        return BF16, rows, None, 1e-70
    if kind == "float64-squares-subnormal-eps-0":
        rows[0] = 1e-160 * wave
        return np.float64, rows, None, 0.0
    # float32 data spread over a few hundred of the subnormals' steps, whose mean float32
    # arithmetic cannot hold as two floats (the output is normal with eps 1e-30, subnormal
    # with 1e-5)
    if kind == "float32-subnormal-spread-eps-1e-30":
        rows[0] = 1e-39 + 1e-42 * wave
        return np.float32, rows, None, 1e-30
    if kind == "float32-subnormal-spread-eps-1e-5":
        rows[0] = 1e-39 + 1e-42 * wave
        return np.float32, rows, None, 1e-5
    raise AssertionError(kind)


KINDS = ["float64-squares-overflow", "float64-squares-overflow-near-max", "float32-constant-row-eps-1e-80",
         "float16-constant-row-eps-5e-324", "float32-subnormal-rstd-times-weight", "float32-centred-overflows",
         "float64-squares-subnormal-eps-0", "float32-subnormal-spread-eps-1e-30",
         "float32-subnormal-spread-eps-1e-5"] + (
    ["bfloat16-squares-overflow", "bfloat16-constant-row-eps-1e-80", "bfloat16-squares-subnormal-eps-0",
     "bfloat16-squares-subnormal-eps-1e-70"] if BF16 else [])


def _run(norm, layout_name, x, weight, eps):
    """(y, rstd) of LayerNorm ("layer") or RMSNorm ("rms") over the last axis of x laid out as
    layout_name (rstd None with a residual, whose functions return the sum instead)."""
    ns = (x.shape[-1],)
    if layout_name == "residual":
        half = (x / 2).astype(x.dtype)
        assert np.array_equal(half + (x - half), x)
        if norm == "layer":
            return layernorm.add_layer_norm(half, x - half, ns, weight, None, eps)[0], None
        return layernorm.add_rms_norm(half, x - half, ns, weight, eps)[0], None
    if layout_name == "transposed":
        x = np.ascontiguousarray(x.T).T
    if norm == "layer":
        y, _, rstd = layernorm.native_layer_norm(x, ns, weight, None, eps)
        return y, rstd
    return layernorm.native_rms_norm(x, ns, weight, eps)


def _tolerance(expected, dtype):
    """helpers' reference tolerance (and a float16 ulp) of each row's largest value, plus the
    smallest subnormal."""
    dtype = np.dtype(dtype)
    if BF16 is not None and dtype == BF16:
        return (REF_REL_TOL[np.dtype(np.float32)] + float(ml_dtypes.finfo(dtype).eps)) * _size(expected) + float(
            ml_dtypes.finfo(dtype).smallest_subnormal)
    ulp = float(np.finfo(dtype).eps) if dtype == np.float16 else 0.0
    return (REF_REL_TOL[dtype] + ulp) * _size(expected) + float(np.finfo(dtype).smallest_subnormal)


def _size(expected):
    """Each row's largest magnitude."""
    return np.abs(expected).max(axis=-1, keepdims=True, initial=0.0)


@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("row_len", ROW_LENGTHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_an_extreme_row_gets_the_reference_answer(norm, kind, row_len, layout_name):
    dtype, rows, weight, eps = _extreme(kind, row_len)
    x = rows.astype(dtype)
    y, rstd = _run(norm, layout_name, x, weight, eps)
    if norm == "layer":
        want_y, _, want_rstd = _reference.layer_norm(x, (row_len,), weight, None, eps)
    else:
        want_y, want_rstd = _reference.rms_norm(x, (row_len,), weight, eps)
    with np.errstate(over="ignore", invalid="ignore"):
        want_y = want_y.astype(dtype).astype(np.float64)
        assert_within(y, want_y, _tolerance(want_y, dtype), "output")
        if rstd is not None:
            want_rstd = want_rstd.astype(rstd.dtype).astype(np.float64)
            assert_within(rstd, want_rstd, _tolerance(want_rstd, rstd.dtype), "rstd")


@pytest.mark.parametrize("row_len", [2, 3, 5, 15])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_read_across_keep_their_bits_next_to_an_inf_row(dtype, row_len):
    """Rows read across (the strided route's tiles of 16 rows) give the same bits whether or not
    their tile holds a row of Inf, short float16/bfloat16 rows included (computed in float64;
    float32 arithmetic would round their rare near-ties apart: many rows)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32000, row_len)).astype(dtype)
    pdt = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    weight = rng.standard_normal(row_len).astype(pdt)
    bias = rng.standard_normal(row_len).astype(pdt)
    with_inf = x.copy()
    with_inf[::16, 0] = np.inf
    ordinary = np.ones(len(x), bool)
    ordinary[::16] = False
    outputs = [layernorm.native_layer_norm(np.ascontiguousarray(rows.T), (row_len,), weight, bias, axis=0)[0].T
               for rows in (x, with_inf)]
    assert outputs[1][ordinary].tobytes() == outputs[0][ordinary].tobytes()


@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("row_len", ROW_LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [np.nan, -np.nan, np.inf])
def test_a_row_holding_nan_or_inf_gives_one_quiet_nan(value, dtype, row_len, layout_name):
    x = np.ones((2, row_len), dtype)
    x[1] = np.linspace(-1.0, 1.0, row_len)
    x[0, row_len // 2] = value
    if layout_name == "residual":
        y = layernorm.add_layer_norm(x, np.zeros_like(x), (row_len,))[0]
    else:
        y = layernorm.native_layer_norm(np.ascontiguousarray(x.T).T if layout_name == "transposed" else x,
                                        (row_len,), None, None, 1e-5)[0]
    canonical = np.array(np.nan, dtype).tobytes()
    assert all(y[0, i].tobytes() == canonical for i in (0, row_len // 2, row_len - 1))
    assert np.isfinite(y[1]).all()


@pytest.mark.parametrize("row_len", ROW_LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_weight_gives_one_quiet_nan(dtype, row_len):
    x = np.linspace(-1.0, 1.0, 2 * row_len).reshape(2, row_len).astype(dtype)
    weight = np.ones(row_len, np.float64 if dtype == np.float64 else np.float32)
    weight[row_len // 2] = -np.nan
    y = layernorm.native_layer_norm(x, (row_len,), weight, None, 1e-5)[0]
    assert y[0, row_len // 2].tobytes() == y[1, row_len // 2].tobytes() == np.array(np.nan, dtype).tobytes()
    assert np.isfinite(np.delete(y, row_len // 2, axis=1)).all()


def _backward_extreme(kind, row_len):
    """(x, dy, eps) of two rows of row_len elements, the first extreme for the backward, the
    second ordinary."""
    x = np.zeros((2, row_len))
    x[1] = np.linspace(-1.0, 1.0, row_len)
    dy = np.tile(np.linspace(1.0, -1.0, row_len), (2, 1))
    if kind == "float32-products-overflow":  # dy * (x - mean) beyond float32
        x[0, :3] = [2e35, -3.8e35, 1e35]
        dy[0, :3] = [400.0, -1000.0, 900.0]
        return x.astype(np.float32), dy.astype(np.float32), 1e-5
    if kind == "float64-rstd-squared-overflows":  # a constant row: rstd 1e155
        return x, dy, 1e-310
    if kind == "float64-rstd-squared-subnormal":  # std ~ 3e161: rstd**2 ~ 1e-323, a few bits
        x[0] = np.sin(np.arange(row_len) + 1.0) * 4e161
        dy[0] *= 1e70
        return x, dy, 1e-5
    if kind == "float32-tiny-values-eps-0":  # rstd ~ 1e38: rstd**2 * mean(g * xhat) beyond float32
        x[0] = np.linspace(-2e-38, 2e-38, row_len)
        return x.astype(np.float32), dy.astype(np.float32), 0.0
    raise AssertionError(kind)


def _layer_norm_backward_by(route, dy, x, mean, rstd, weight, bias):
    """layer_norm_backward over the last axis of 2-D rows: as they are ("rows", the contiguous
    route), or transposed and normalized over axis 0 ("axis", the strided route: a row a lane)."""
    ns = (x.shape[-1],)
    if route == "rows":
        return layernorm.layer_norm_backward(dy, x, ns, mean, rstd, weight, bias)
    got = layernorm.layer_norm_backward(dy.T.copy(), x.T.copy(), ns, mean.T.copy(), rstd.T.copy(), weight, bias,
                                        axis=0)
    return (got[0].T,) + tuple(got[1:])


def _rms_norm_backward_by(route, dy, x, rstd, weight):
    """rms_norm_backward as _layer_norm_backward_by runs layer_norm_backward."""
    ns = (x.shape[-1],)
    if route == "rows":
        return layernorm.rms_norm_backward(dy, x, ns, rstd, weight)
    got = layernorm.rms_norm_backward(dy.T.copy(), x.T.copy(), ns, rstd.T.copy(), weight, axis=0)
    return (got[0].T,) + tuple(got[1:])


@pytest.mark.parametrize("route", ["rows", "axis"])
@pytest.mark.parametrize("row_len", ROW_LENGTHS)
@pytest.mark.parametrize("kind", ["float32-products-overflow", "float64-rstd-squared-overflows",
                                  "float64-rstd-squared-subnormal", "float32-tiny-values-eps-0"])
def test_an_extreme_row_gets_the_reference_gradients(kind, row_len, route):
    """axis: the rows one lane each of a tile (the strided route), whose float32 path must hand
    such a tile to float64 as the contiguous route hands the row to ln_backward_exact_row."""
    x, dy, eps = _backward_extreme(kind, row_len)
    pdt = np.float64 if x.dtype == np.float64 else np.float32
    weight, bias = np.full(row_len, 0.5, pdt), np.zeros(row_len, pdt)
    _, mean, rstd = layernorm.native_layer_norm(x, (row_len,), weight, bias, eps)
    got = _layer_norm_backward_by(route, dy, x, mean, rstd, weight, bias)
    want = _reference.layer_norm_backward_given_stats(dy, x, (row_len,), mean, rstd, weight)
    # grad_input's terms are rstd * dy * w per row: its tolerance is theirs
    terms = np.asarray(rstd, np.float64) * np.abs(dy * weight.astype(np.float64)).max(axis=-1, keepdims=True)
    tolerances = (1e-5 * terms, 1e-5 * np.abs(want[1]).max(), 1e-5 * np.abs(want[2]).max())
    for name, g, w, tol in zip(("grad_input", "grad_weight", "grad_bias"), got, want, tolerances):
        assert np.isfinite(g).all(), name
        assert_within(g, w, tol, name)


@pytest.mark.parametrize("route", ["rows", "axis"])
@pytest.mark.parametrize("row_len", ROW_LENGTHS)
def test_a_float64_row_whose_centred_values_overflow_gets_the_reference_gradients(row_len, route):
    """x - mean beyond float64 (1.5e308 - (-1.5e308 + 3e308 / row_len)), where the forward is
    right: the gradients are the reference's of the row scaled by 1/4, whose x - mean is in
    range, xhat the same and grad_input 4 times the answer (every route: rows shorter than a
    group, the contiguous route's ln_backward_exact_row, a tile's float64 lanes)."""
    x = np.zeros((2, row_len))
    x[0] = -1.5e308
    x[0, 0] = 1.5e308
    x[1] = np.linspace(-1.0, 1.0, row_len)
    dy = np.tile(np.linspace(1.0, -1.0, row_len), (2, 1))
    weight, bias = np.full(row_len, 0.5), np.zeros(row_len)
    _, mean, rstd = layernorm.native_layer_norm(x, (row_len,), weight, bias)
    got = _layer_norm_backward_by(route, dy, x, mean, rstd, weight, bias)
    scale = 0.25
    want = _reference.layer_norm_backward_given_stats(dy, x * scale, (row_len,), mean * scale, rstd / scale, weight)
    want = (want[0] * scale,) + want[1:]
    # float64 sums of up to 70000 terms round by at most about n * 2**-53 of their magnitudes
    terms = rstd * np.abs(dy * weight).max(axis=-1, keepdims=True)
    tolerances = (1e-10 * terms, 1e-10 * np.abs(want[1]).max(), 1e-10 * np.abs(want[2]).max())
    for name, g, w, tol in zip(("grad_input", "grad_weight", "grad_bias"), got, want, tolerances):
        assert np.isfinite(g).all(), name
        assert_within(g, w, tol, name)


@pytest.mark.parametrize("row_len", [40, 5000, 70000])
def test_float32_rows_of_std_3e19_keep_the_float32_path(row_len):
    """rstd**2 ~ 1e-39 lies below float32's normal range but is formed in float64, and the
    factors it makes are normal: such rows stay on the float32 path, whose arithmetic scales
    exactly with the row (eps 0), as the row scaled down by 2**-70 shows bit for bit."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, row_len)) * 3e19).astype(np.float32)
    dy = (rng.standard_normal((4, row_len)) * 1e4).astype(np.float32)
    weight, bias = rng.uniform(0.5, 2.0, row_len).astype(np.float32), np.zeros(row_len, np.float32)
    grads = []
    for rows in (x, x * np.float32(2.0**-70)):
        _, mean, rstd = layernorm.native_layer_norm(rows, (row_len,), weight, bias, 0.0)
        grads.append(layernorm.layer_norm_backward(dy, rows, (row_len,), mean, rstd, weight, bias))
    np.testing.assert_array_equal(grads[0][0] * np.float32(2.0**70), grads[1][0])
    np.testing.assert_array_equal(grads[0][1], grads[1][1])


def _tiny_weight_huge_dy(case):
    """(x, dy, weight, eps) of 16 rows of 40 elements under w = 1e-20, where g = dy * w and
    g * (x - mean) stay in float32's range but dweight's term dy * (x - mean) * rstd does not:
    dy ~ 1e30 with x ~ 1e10 (dy * (x - mean) ~ 1e40), or dy ~ 2e38 with x ~ 1e-4 and eps 0
    (rstd ~ 1e4, the term ~ 5e38), rows k and k + 8 of the latter with the same x and opposite dy, whose
    terms cancel."""
    rng = np.random.default_rng(3)
    n = 40
    weight = np.full(n, 1e-20, np.float32)
    if case == "dy-1e30":
        x = rng.standard_normal((16, n)) * 1e10
        dy = rng.standard_normal((16, n)) * 1e30
        eps = 1e-5
    else:
        half = rng.standard_normal((8, n)) * 1e-4
        x = np.concatenate([half, half])
        dy = rng.uniform(1e38, 3e38, (8, n)) * rng.choice([-1.0, 1.0], (8, n))
        dy = np.concatenate([dy, -dy])
        eps = 0.0
    return x.astype(np.float32), dy.astype(np.float32), weight, eps


@pytest.mark.parametrize("route", ["rows", "axis"])
@pytest.mark.parametrize("case", ["dy-1e30", "rstd-1e4"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_tiny_weight_under_a_huge_dy_gets_the_reference_grad_weight(norm, case, route):
    x, dy, weight, eps = _tiny_weight_huge_dy(case)
    n = x.shape[-1]
    if norm == "layer":
        bias = np.zeros(n, np.float32)
        _, mean, rstd = layernorm.native_layer_norm(x, (n,), weight, bias, eps)
        got = _layer_norm_backward_by(route, dy, x, mean, rstd, weight, bias)
        want = _reference.layer_norm_backward_given_stats(dy, x, (n,), mean, rstd, weight)
    else:
        _, rstd = layernorm.native_rms_norm(x, (n,), weight, eps)
        mean = 0.0
        got = _rms_norm_backward_by(route, dy, x, rstd, weight)
        want = _reference.rms_norm_backward_given_stats(dy, x, (n,), rstd, weight)
    # grad_weight's terms are dy * xhat per row: its tolerance is theirs, summed
    xhat = (x.astype(np.float64) - mean) * np.asarray(rstd, np.float64)
    terms = np.abs(dy.astype(np.float64) * xhat).sum(axis=0)
    assert np.isfinite(got[1]).all()
    assert_within(got[1], want[1], 1e-5 * terms, "grad_weight")


@pytest.mark.parametrize("route", ["rows", "axis"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dy_top, w", [(2e34, 1e3), (5e16, 4e20)], ids=["dy-2e34", "dy-5e16"])
def test_an_overflowing_inner_term_of_grad_input_gets_the_reference(dy_top, w, norm, route):
    """grad_input = fma(rstd, g, inner), inner = -rstd**2 * gx_mean * xc - rstd * g_mean: rows
    of 10000 elements, one of them an outlier (xhat = 100, rstd = 30) whose g = 2e37 (dy 2e34
    under a weight of 1e3, or dy 5e16 under 4e20, where dy * rstd is small enough for the
    contiguous route's vector test of dweight's term) sits inside float32, as do g * xc,
    rstd**2 * gx_mean and dweight's terms, while inner = -6e38 at the outlier does not;
    rstd * g cancels it, to ~1e31.  Its row goes by float64, where it was -Inf (on the axis
    route, its whole tile)."""
    n = 10000
    rng = np.random.default_rng(5)
    x, dy = rng.standard_normal((2, 4, n)).astype(np.float32)
    x[0], dy[0] = 0.0, 0.0
    x[0, 0], dy[0, 0] = 10 / 3, dy_top
    weight = np.full(n, w, np.float32)
    if norm == "layer":
        bias = np.zeros(n, np.float32)
        _, mean, rstd = layernorm.native_layer_norm(x, (n,), weight, bias, 0.0)
        got = _layer_norm_backward_by(route, dy, x, mean, rstd, weight, bias)[0]
        want = _reference.layer_norm_backward_given_stats(dy, x, (n,), mean, rstd, weight)[0]
    else:
        _, rstd = layernorm.native_rms_norm(x, (n,), weight, 0.0)
        got = _rms_norm_backward_by(route, dy, x, rstd, weight)[0]
        want = _reference.rms_norm_backward_given_stats(dy, x, (n,), rstd, weight)[0]
    assert 20 < float(rstd[0, 0]) < 40
    assert np.isfinite(got).all()
    # the outlier's row, in float64: within an ulp of the reference; the others within a
    # float32 rounding of their terms rstd * |g|
    assert_within(got[0], want[0], np.spacing(np.abs(want[0]).astype(np.float32)), "grad_input, outlier row")
    terms = np.asarray(rstd[1:], np.float64) * np.abs(dy[1:] * weight.astype(np.float64)).max(axis=-1, keepdims=True)
    assert_within(got[1:], want[1:], 2.0 ** -22 * terms, "grad_input")


@pytest.mark.parametrize("rows", [16, 13])
@pytest.mark.parametrize("norm, zeroed", [("layer", "dy-row"), ("layer", "constant-x-row"), ("rms", "dy-row")])
def test_a_zero_factor_row_keeps_its_tiles_float32_bits(norm, zeroed, rows):
    """A row whose dy is all 0.0 (or whose x is constant: x - mean all 0.0) has a zero factor,
    which the contiguous route's float32 arithmetic carries: on the strided route its tile of
    rows (16, or 13 and three lanes of padding) stays in float32 too, so the other rows'
    gradients keep their bits."""
    rng = np.random.default_rng(4)
    n = 40
    x, dy = rng.standard_normal((2, rows, n)).astype(np.float32)
    weight, bias = rng.uniform(0.5, 2.0, (2, n)).astype(np.float32)

    def grad_input(x, dy):
        if norm == "layer":
            _, mean, rstd = layernorm.native_layer_norm(x, (n,), weight, bias, 1e-5)
            return _layer_norm_backward_by("axis", dy, x, mean, rstd, weight, bias)[0]
        _, rstd = layernorm.native_rms_norm(x, (n,), weight, 1e-5)
        return _rms_norm_backward_by("axis", dy, x, rstd, weight)[0]

    before = grad_input(x, dy)
    if zeroed == "dy-row":
        dy = dy.copy()
        dy[5] = 0.0
    else:
        x = x.copy()
        x[5] = 0.25
    after = grad_input(x, dy)
    others = [k for k in range(rows) if k != 5]
    assert after[others].tobytes() == before[others].tobytes()
    assert (after[5] == 0.0).all() if zeroed == "dy-row" else np.isfinite(after[5]).all()


# A negative rstd (statistics of the caller's own) is outside what the row kernels' float32
# arithmetic is checked for, so its rows go by the float64 path and get the reference's
# gradients to within one float32 rounding; the float32 path lost hundreds of ulps there.
@pytest.mark.parametrize("row_len", ROW_LENGTHS)
def test_a_negative_rstd_gets_the_reference_gradients(row_len):
    rng = np.random.default_rng(row_len)
    x, dy = rng.standard_normal((2, 2, row_len)).astype(np.float32)
    weight, bias = rng.standard_normal((2, row_len)).astype(np.float32)
    _, mean, rstd = layernorm.native_layer_norm(x, (row_len,), weight, bias, 1e-5)
    rstd = -rstd
    got = layernorm.layer_norm_backward(dy, x, (row_len,), mean, rstd, weight, bias)[0]
    want = _reference.layer_norm_backward_given_stats(dy, x, (row_len,), mean, rstd, weight)[0]
    assert_within(got, want, np.spacing(np.abs(want).astype(np.float32)), "grad_input")


@pytest.mark.parametrize("row_len", ROW_LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_in_dy_gives_one_quiet_nan(dtype, row_len):
    x = np.linspace(-1.0, 1.0, 2 * row_len).reshape(2, row_len).astype(dtype)
    dy = np.ones_like(x)
    dy[0, row_len // 2] = -np.nan
    pdt = np.float64 if dtype == np.float64 else np.float32
    weight, bias = np.ones(row_len, pdt), np.zeros(row_len, pdt)
    _, mean, rstd = layernorm.native_layer_norm(x, (row_len,), weight, bias, 1e-5)
    dx, dweight, dbias = layernorm.layer_norm_backward(dy, x, (row_len,), mean, rstd, weight, bias)
    canonical, canonical_param = np.array(np.nan, dtype).tobytes(), np.array(np.nan, pdt).tobytes()
    assert all(dx[0, i].tobytes() == canonical for i in (0, row_len // 2, row_len - 1))
    assert np.isfinite(dx[1]).all()
    assert dweight[row_len // 2].tobytes() == dbias[row_len // 2].tobytes() == canonical_param


TINY_PRODUCT_MAGNITUDES = dict(TINY_PRODUCT_MAGNITUDES)
if BF16 is not None:
    TINY_PRODUCT_MAGNITUDES[BF16] = [(1e-30, 1e-20, 0.0), (1e-36, 1e-11, 1e-30)]
BACKWARD_ROUTES = {"rows": 64, "short-rows": 5, "huge-rows": 70000, "transposed": 64, "axis": 64}


@pytest.mark.parametrize("route", list(BACKWARD_ROUTES))
@pytest.mark.parametrize("dtype_magnitudes", [(dtype, m) for dtype, ms in TINY_PRODUCT_MAGNITUDES.items() for m in ms],
                         ids=tiny_product_id)
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_tiny_products_get_the_reference_gradients(norm, dtype_magnitudes, route):
    """Rows whose x and dy are small enough that dy * (x - mean) underflows the compute type,
    with eps 0 or an eps that outweighs their variance: every route gives the reference's
    gradients, as for ordinary rows."""
    dtype, (x_size, dy_size, eps) = dtype_magnitudes
    row_len = BACKWARD_ROUTES[route]
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((4, row_len)) * x_size).astype(dtype)
    dy = (rng.standard_normal((4, row_len)) * dy_size).astype(dtype)
    pdt = np.float64 if dtype == np.float64 else np.float32
    weight = rng.uniform(0.5, 2.0, row_len).astype(pdt)
    ns = (row_len,)
    if norm == "layer":
        _, mean, rstd = layernorm.native_layer_norm(x, ns, weight, None, eps)
        stats, want = (mean, rstd), _reference.layer_norm_backward_given_stats(dy, x, ns, mean, rstd, weight)
    else:
        _, rstd = layernorm.native_rms_norm(x, ns, weight, eps)
        stats, want = (rstd,), _reference.rms_norm_backward_given_stats(dy, x, ns, rstd, weight)
    backward = layernorm.layer_norm_backward if norm == "layer" else layernorm.rms_norm_backward
    params = (weight, np.zeros_like(weight)) if norm == "layer" else (weight,)
    if route == "axis":
        got = backward(dy.T.copy(), x.T.copy(), ns, *(s.T.copy() for s in stats), *params, axis=0)
        got = (got[0].T,) + tuple(got[1:])
    elif route == "transposed":
        got = backward(np.ascontiguousarray(dy.T).T, np.ascontiguousarray(x.T).T, ns, *stats, *params)
    else:
        got = backward(dy, x, ns, *stats, *params)
    is_bf16 = BF16 is not None and np.dtype(dtype) == BF16  # (np.dtype(...) == None holds for float64)
    rel = 2e-3 if np.dtype(dtype) == np.float16 else 4e-3 if is_bf16 else REF_REL_TOL[np.dtype(dtype)]
    # grad_input's terms are rstd * dy * w per row: its tolerance is theirs
    terms = np.asarray(rstd, np.float64) * np.abs(dy.astype(np.float64) * weight).max(axis=-1, keepdims=True)
    for name, g, w, scale in zip(("grad_input", "grad_weight", "grad_bias"), got, want,
                                 (terms, np.abs(want[1]).max(), np.abs(dy.astype(np.float64)).sum(axis=0))):
        finfo = ml_dtypes.finfo(g.dtype) if BF16 is not None and g.dtype == BF16 else np.finfo(g.dtype)
        assert_within(g, w, 4 * rel * scale + float(finfo.smallest_subnormal), name)


def _levels_and_threads():
    """Every SIMD level this machine runs, at 1 and 2 threads."""
    return [(level, threads) for level in layernorm.available_simd_levels() for threads in (1, 2)]


@pytest.mark.parametrize("layout_name", ["rows", "transposed", "axis"])
@pytest.mark.parametrize("row_len", [3, 16, 32, 100, 2048, 3000, 5000, 70000])
@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_a_row_holding_nan_or_inf_has_nan_statistics(value, row_len, layout_name, restore_runtime):
    """mean and rstd of such a row are the one quiet NaN wherever the value is, at every length,
    route, level and thread count (torch's mean is NaN too, but Inf for an Inf at the end of
    some lengths)."""
    canonical = np.array(np.nan, np.float32).tobytes()
    for level, threads in _levels_and_threads():
        layernorm.set_simd_level(level)
        layernorm.set_num_threads(threads)
        for position in (0, row_len // 2, row_len - 1):
            x = np.tile(np.linspace(-1.0, 1.0, row_len, dtype=np.float32), (3, 1))
            x[1, position] = value
            if layout_name == "axis":
                mean, rstd = (s.T for s in layernorm.native_layer_norm(x.T.copy(), (row_len,), axis=0)[1:])
            else:
                source = np.ascontiguousarray(x.T).T if layout_name == "transposed" else x
                mean, rstd = layernorm.native_layer_norm(source, (row_len,))[1:]
            where = f"{level}, {threads} threads, at {position}"
            assert mean[1].tobytes() == rstd[1].tobytes() == canonical, where
            assert np.isfinite(mean[[0, 2]]).all() and np.isfinite(rstd[[0, 2]]).all(), where


@pytest.mark.parametrize("row_len", [3, 40, 5000])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_negative_variance_plus_eps_gives_one_quiet_nan_rstd(norm, dtype, row_len, restore_runtime):
    # sqrt of a negative number is x86's negative default NaN, which the statistics must not keep
    x = np.tile(np.linspace(-1.0, 1.0, row_len), (2, 1)).astype(dtype)
    x[1] = 0.5
    canonical = np.array(np.nan, np.float64 if np.dtype(dtype) == np.float64 else np.float32).tobytes()
    for level, threads in _levels_and_threads():
        layernorm.set_simd_level(level)
        layernorm.set_num_threads(threads)
        if norm == "layer":
            rstd = layernorm.native_layer_norm(x, row_len, None, None, -10.0)[2]
        else:
            rstd = layernorm.native_rms_norm(x, row_len, None, -10.0)[1]
        assert rstd[0].tobytes() == rstd[1].tobytes() == canonical, f"{level}, {threads} threads"


@pytest.mark.parametrize("route", ["rows", "axis", "dask split rows"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_eps_negative_zero_on_a_row_of_no_variance_gives_rstd_plus_inf(norm, dtype, route, restore_runtime):
    # 1 / sqrt(var + eps) with var +0.0: +0.0 + -0.0 is +0.0, so +inf (as torch's), where
    # 1 / sqrt(eps) alone would give -inf
    x = np.tile(np.linspace(-1.0, 1.0, 6), (3, 1)).astype(dtype)
    x[1] = 0.0 if norm == "rms" else 0.5
    call = ((lambda a, **k: layernorm.native_layer_norm(a, 6, None, None, -0.0, **k)[2]) if norm == "layer" else
            (lambda a, **k: layernorm.native_rms_norm(a, 6, None, -0.0, **k)[1]))
    for level, threads in _levels_and_threads():
        layernorm.set_simd_level(level)
        layernorm.set_num_threads(threads)
        if route == "rows":
            rstd = call(x)
        elif route == "axis":
            rstd = call(np.ascontiguousarray(x.T), axis=0).T
        else:
            da = pytest.importorskip("dask.array")
            rstd = call(da.from_array(x, chunks=(1, 4))).compute()
        assert rstd[1, 0] == np.inf and np.isfinite(rstd[[0, 2]]).all(), f"{level}, {threads} threads"


@pytest.mark.parametrize("route", ["short-rows", "rows", "transposed", "axis"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_nan_in_dy_gives_one_quiet_nan_on_every_route(norm, dtype, route, restore_runtime):
    row_len = 5 if route == "short-rows" else 40
    x = np.linspace(-1.0, 1.0, 3 * row_len).reshape(3, row_len).astype(dtype)
    dy = np.ones_like(x)
    dy[1, row_len // 2] = -np.nan
    pdt = np.float64 if dtype == np.float64 else np.float32
    weight = np.ones(row_len, pdt)
    canonical, canonical_param = np.array(np.nan, dtype).tobytes(), np.array(np.nan, pdt).tobytes()
    for level, threads in _levels_and_threads():
        layernorm.set_simd_level(level)
        layernorm.set_num_threads(threads)
        if norm == "layer":
            _, mean, rstd = layernorm.native_layer_norm(x, (row_len,), weight, np.zeros_like(weight))
            stats, backward, params = (mean, rstd), layernorm.layer_norm_backward, (weight, np.zeros_like(weight))
        else:
            _, rstd = layernorm.native_rms_norm(x, (row_len,), weight)
            stats, backward, params = (rstd,), layernorm.rms_norm_backward, (weight,)
        if route == "axis":
            grads = backward(dy.T.copy(), x.T.copy(), (row_len,), *(s.T.copy() for s in stats), *params, axis=0)
            grads = (grads[0].T,) + tuple(grads[1:])
        elif route == "transposed":
            grads = backward(np.ascontiguousarray(dy.T).T, np.ascontiguousarray(x.T).T, (row_len,), *stats, *params)
        else:
            grads = backward(dy, x, (row_len,), *stats, *params)
        where = f"{level}, {threads} threads"
        assert all(v.tobytes() == canonical for v in grads[0][1]), where
        assert np.isfinite(grads[0][[0, 2]]).all(), where
        for param_grad in grads[1:]:
            assert param_grad[row_len // 2].tobytes() == canonical_param, where


@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("row_len", ROW_LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("subnormal_weights", ["one", "all"])
def test_subnormal_weights_get_the_reference_answer(subnormal_weights, dtype, row_len, layout_name):
    """A weight below the normal range (one of them, or all) costs ordinary rows nothing and
    gives every row the reference's answer, rows of large values next to them included."""
    pdt = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    tiny = np.finfo(pdt).smallest_subnormal * 7
    rng = np.random.default_rng(3)
    weight = rng.uniform(0.5, 2.0, row_len).astype(pdt)
    weight[row_len // 2] = tiny
    if subnormal_weights == "all":
        weight[:] = tiny
    x = rng.standard_normal((3, row_len))
    x[2] *= 1e4
    x = x.astype(dtype)
    for norm in ("layer", "rms"):
        y, _ = _run(norm, layout_name, x, weight, 1e-5)
        if norm == "layer":
            want = _reference.layer_norm(x, (row_len,), weight, None, 1e-5)[0]
        else:
            want = _reference.rms_norm(x, (row_len,), weight, 1e-5)[0]
        want = want.astype(dtype).astype(np.float64)
        assert_within(y, want, _tolerance(want, dtype), f"{norm} output")
