/*
 * ln_layout.c -- the plan of ln_layout.h: coalesce the normalized axes into one strided row
 * dimension and the other axes into at most two (blocks, rows), for every array at once.
 */
#include "ln_layout.h"

#include <assert.h>

/* Axes d0 then d1 (d1 varying faster) merge into one when every array steps over d0 exactly
   as far as over all of d1. */
static int ln_axes_merge(int narrays, const ptrdiff_t *const *strides, const ptrdiff_t *shape, int d0, int d1)
{
    for (int a = 0; a < narrays; a++) {
        if (strides[a][d0] != strides[a][d1] * shape[d1]) {
            return 0;
        }
    }
    return 1;
}

ln_layout_status ln_layout_plan(int ndim, const ptrdiff_t *shape, int naxes, const int *axes,
                                int narrays, const ptrdiff_t *const *strides, const ptrdiff_t *itemsize,
                                ln_extent *extent, ln_walk *walks)
{
    assert(ndim >= 0 && ndim <= LN_LAYOUT_MAX_DIMS && naxes >= 0 && naxes <= ndim);
    assert(narrays >= 1 && narrays <= LN_LAYOUT_MAX_ARRAYS);
    int normalized[LN_LAYOUT_MAX_DIMS] = {0};
    ptrdiff_t row_len = 1, batch = 1;
    for (int k = 0; k < naxes; k++) {
        assert(axes[k] >= 0 && axes[k] < ndim && !normalized[axes[k]]);
        normalized[axes[k]] = 1;
        row_len *= shape[axes[k]];
    }
    for (int d = 0; d < ndim; d++) {
        batch *= normalized[d] ? 1 : shape[d];
    }
    if (batch == 0) {
        /* No row to walk: empty arrays' strides need not chain, and zero steps are valid for
           every array, statistics (which never step along a row) included. */
        *extent = (ln_extent){1, 0, row_len};
        for (int a = 0; a < narrays; a++) {
            walks[a] = (ln_walk){0, 0, 0};
        }
        return LN_LAYOUT_OK;
    }

    /* The row: normalized axes in normalized_shape's order, each merging into the one before. */
    int last_elem_axis = -1;
    for (int k = 0; k < naxes; k++) {
        const int d = axes[k];
        if (shape[d] == 1) {
            continue;
        }
        if (last_elem_axis >= 0 && !ln_axes_merge(narrays, strides, shape, last_elem_axis, d)) {
            return LN_LAYOUT_NOT_WALKABLE;
        }
        last_elem_axis = d;
    }

    /* The other axes in C order, merged where they can be; at most two may remain. */
    int kept[2] = {0, 0};
    int nkept = 0;
    for (int d = 0; d < ndim; d++) {
        if (normalized[d] || shape[d] == 1) {
            continue;
        }
        if (nkept > 0 && ln_axes_merge(narrays, strides, shape, kept[nkept - 1], d)) {
            kept[nkept - 1] = d;  /* the merged axis steps like its faster part */
            continue;
        }
        if (nkept == 2) {
            return LN_LAYOUT_NOT_WALKABLE;
        }
        kept[nkept++] = d;
    }

    extent->row_len = row_len;
    extent->blocks = 1;
    extent->rows = batch;
    if (nkept == 2 && batch > 0) {
        /* blocks: the product of every batch axis up to the first kept one's merged run */
        extent->rows = 1;
        for (int d = kept[0] + 1; d < ndim; d++) {
            extent->rows *= normalized[d] ? 1 : shape[d];
        }
        extent->blocks = batch / extent->rows;
    }
    for (int a = 0; a < narrays; a++) {
        walks[a].elem_step = last_elem_axis >= 0 ? strides[a][last_elem_axis] : itemsize[a];
        walks[a].row_step = nkept > 0 ? strides[a][kept[nkept - 1]] : 0;
        walks[a].block_step = nkept == 2 ? strides[a][kept[0]] : 0;
    }
    return LN_LAYOUT_OK;
}
