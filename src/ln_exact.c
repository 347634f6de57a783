/*
 * ln_exact.c -- forward for the rare rows whose statistics the row kernels cannot carry:
 * float64 rows whose squared deviations overflow, float16/float32 rows whose rstd (or
 * rstd * weight) leaves float32's normal range, and rows holding NaN or Inf.  Plain C,
 * compiled once, so a row gets the same bits at every SIMD level.  The float64 reference's
 * arithmetic (layernorm/_reference.py), per row of N elements:
 *
 *     s = 2**(e - 1), e the binary exponent of max|x|     (x / s is exact and below 2)
 *     mean_s = mean(x / s), then mean_s += mean(x / s - mean_s)   (0 for RMSNorm)
 *     var_s = mean((x / s - mean_s)**2),  root_s = sqrt(var_s + eps / s**2)
 *     mean = mean_s * s,  rstd = 1 / root_s / s
 *     y = (x / s - mean_s) / root_s * w + b, in float64, rounded once to the element type
 *
 * (where var_s is 0 or eps / s**2 overflows, eps is all there is: rstd = 1 / sqrt(0 + eps) and
 * xhat = (x - mean) * rstd).  A row holding NaN or Inf has NaN mean, rstd and output: torch's
 * mean is NaN too, but Inf for an Inf at the end of some lengths (16, 32, 2048), so one rule here.
 * Every NaN written here is the one quiet NaN, and a call whose weight or bias holds NaN or
 * Inf sends all its rows here, so the forward writes no other NaN.
 *
 * Backward, for a row whose float32 products or float64 rstd**2 overflow, or which holds NaN
 * or Inf (ln_grad_row_needs_exact), in float64 with rstd applied last, so that no product
 * holds more than one large factor:
 *
 *     xhat = (x - mean) * rstd,  g = dy * w,  g_mean = mean(g),  gx_mean = mean(g * xhat)
 *     dx = ((g - g_mean) - xhat * gx_mean) * rstd,  dweight += dy * xhat
 */
#include "ln_internal.h"

/* Element i of a row whose elements are `step` bytes apart, as float64. */
static double ln_element(ln_dtype dtype, const char *row, ptrdiff_t step, ptrdiff_t i)
{
    return ln_load1_as_f64(dtype, row + i * step, 0);
}

void ln_forward_exact_row(const ln_forward_args *a, const ln_array *source, ptrdiff_t r)
{
    const ln_dtype dtype = a->dtype;
    const ptrdiff_t n = a->extent.row_len;
    const ptrdiff_t x_step = source->walk.elem_step, y_step = a->output.walk.elem_step;
    const char *x = ln_row_address(source, &a->extent, r);
    char *y = ln_row_address(&a->output, &a->extent, r);
    const int centred = a->kind == LN_NORM_LAYER;
    const void *bias = centred ? a->bias : NULL;
    assert(n >= 1);

    double largest = 0.0;
    int finite = 1;
    for (ptrdiff_t i = 0; i < n; i++) {
        const double v = fabs(ln_element(dtype, x, x_step, i));
        finite &= isfinite(v);
        largest = v > largest ? v : largest;
    }
    if (!finite) {
        ln_store_stats(a, r, NAN, NAN);
        for (ptrdiff_t i = 0; i < n; i++) {
            ln_store1_from_f64(dtype, y + i * y_step, 0, NAN);
        }
        return;
    }
    int exponent;
    frexp(largest > 0.0 ? largest : 1.0, &exponent);
    const double s = ldexp(1.0, exponent - 1);
    double mean_s = 0.0;
    if (centred) {
        double sum = 0.0, correction = 0.0;
        for (ptrdiff_t i = 0; i < n; i++) {
            sum += ln_element(dtype, x, x_step, i) / s;
        }
        mean_s = sum / (double)n;
        for (ptrdiff_t i = 0; i < n; i++) {
            correction += ln_element(dtype, x, x_step, i) / s - mean_s;
        }
        mean_s += correction / (double)n;
    }
    double squares = 0.0;
    for (ptrdiff_t i = 0; i < n; i++) {
        const double d = ln_element(dtype, x, x_step, i) / s - mean_s;
        squares += d * d;
    }
    const double var_s = squares / (double)n;
    const double eps_s = a->eps == 0.0 ? 0.0 : a->eps / (s * s);
    const int scaled = isfinite(eps_s) && var_s > 0.0;
    const double root_s = sqrt(var_s + (scaled ? eps_s : 0.0));
    /* unscaled: var + eps with var 0 (or negligible), the sum kept, so that eps -0.0 gives
       sqrt(+0.0) and rstd +inf, as the formula and torch do */
    const double rstd = scaled ? 1.0 / root_s / s : 1.0 / sqrt(0.0 + a->eps);
    ln_store_stats(a, r, mean_s * s, rstd);
    for (ptrdiff_t i = 0; i < n; i++) {
        const double v = ln_element(dtype, x, x_step, i);
        const double xhat = scaled ? (v / s - mean_s) / root_s : (v - mean_s * s) * rstd;
        const double w = a->weight ? ln_load1_param_as_f64(dtype, a->weight, i) : 1.0;
        const double out = xhat * w + (bias ? ln_load1_param_as_f64(dtype, bias, i) : ln_absent_bias(a->kind));
        ln_store1_from_f64(dtype, y + i * y_step, 0, isnan(out) ? NAN : out);
    }
}

void ln_backward_exact_row(const ln_backward_args *a, ptrdiff_t r, double *dweight)
{
    const ln_dtype dtype = a->dtype;
    const ptrdiff_t n = a->extent.row_len;
    const ptrdiff_t dy_step = a->grad_output.walk.elem_step, x_step = a->input.walk.elem_step;
    const char *dy = ln_row_address(&a->grad_output, &a->extent, r);
    const char *x = ln_row_address(&a->input, &a->extent, r);
    const double mean = a->kind == LN_NORM_LAYER ? ln_load_stat(dtype, &a->mean, &a->extent, r) : 0.0;
    const double rstd = ln_load_stat(dtype, &a->rstd, &a->extent, r);
    assert(n >= 1);

    double g_sum = 0.0, gx_sum = 0.0;
    for (ptrdiff_t i = 0; i < n; i++) {
        const double xhat = ln_xhat_of(ln_element(dtype, x, x_step, i), mean, rstd);
        const double w = a->weight ? ln_load1_param_as_f64(dtype, a->weight, i) : 1.0;
        const double g = ln_element(dtype, dy, dy_step, i) * w;
        g_sum += g;
        gx_sum += g * xhat;
        if (dweight) {
            dweight[i] += ln_element(dtype, dy, dy_step, i) * xhat;
        }
    }
    if (!a->grad_input.data) {
        return;
    }
    const double g_mean = a->kind == LN_NORM_LAYER ? g_sum / (double)n : 0.0, gx_mean = gx_sum / (double)n;
    const ptrdiff_t dx_step = a->grad_input.walk.elem_step;
    char *dx = ln_row_address(&a->grad_input, &a->extent, r);
    for (ptrdiff_t i = 0; i < n; i++) {
        const double xhat = ln_xhat_of(ln_element(dtype, x, x_step, i), mean, rstd);
        const double w = a->weight ? ln_load1_param_as_f64(dtype, a->weight, i) : 1.0;
        const double g = ln_element(dtype, dy, dy_step, i) * w;
        const double value = ((g - g_mean) - xhat * gx_mean) * rstd;
        ln_store1_from_f64(dtype, dx + i * dx_step, 0, isnan(value) ? NAN : value);
    }
}
