/*
 * ln_layout.h -- from an array's shape, its arrays' strides and the normalized axes to the
 * three-level walk every kernel is written against:
 *
 *     for block in range(extent.blocks):          # step: walk.block_step
 *         for row in range(extent.rows):          # step: walk.row_step
 *             for j in range(extent.row_len):     # step: walk.elem_step
 *                 element j of that row
 *
 * A C-contiguous array normalized over its trailing axes is one block of rows whose
 * elements are adjacent (elem_step == element size, the fast path).  An NCHW array normalized
 * over C is N blocks of H*W adjacent rows whose elements are H*W elements apart: the kernel
 * reads them in place, with no transposed copy.
 *
 * Every array taking part (input, output, residual, gradients, statistics) is walked with the
 * same extent and its own steps, so the plan is made for all of them at once.
 */
#ifndef LN_LAYOUT_H
#define LN_LAYOUT_H

#include <stddef.h>

#define LN_LAYOUT_MAX_DIMS 64    /* NumPy's NPY_MAXDIMS */
#define LN_LAYOUT_MAX_ARRAYS 10   /* the most a kernel call walks: ln_part_backward_args's */

typedef struct {
    ptrdiff_t blocks;   /* outer loop count */
    ptrdiff_t rows;     /* rows per block */
    ptrdiff_t row_len;  /* elements per row: the product of the normalized axes' sizes */
} ln_extent;

typedef struct {
    ptrdiff_t block_step;  /* bytes from one block's first row to the next block's */
    ptrdiff_t row_step;    /* bytes from one row's first element to the next row's, in a block */
    ptrdiff_t elem_step;   /* bytes from one element of a row to the next */
} ln_walk;

typedef enum {
    LN_LAYOUT_OK = 0,
    /* the normalized axes of some array cannot be walked with one element step, or its other
       axes not with two steps: the caller copies that array into a walkable order first */
    LN_LAYOUT_NOT_WALKABLE = 1,
} ln_layout_status;

/*
 * ndim, shape: the common shape of the arrays (each array's size-1 axes may have any stride);
 * axes[0 .. naxes): the normalized axes in the order of normalized_shape (element j of a row is
 *   their multi-index in that order, C-style, so that weight[j] belongs to it);
 * strides[a][d]: byte stride of array a along axis d, and itemsize[a] its element size, for a
 *   in [0, narrays).
 * On LN_LAYOUT_OK fills *extent and walks[0 .. narrays).  Axes of size 1 are ignored (a row of
 * one element steps by the element size); the other axes are walked in C order whatever the
 * strides, so the order in which rows are visited (and parameter gradients summed) depends on
 * the shape alone.  An empty array plans as zero rows or zero-length rows.
 */
ln_layout_status ln_layout_plan(int ndim, const ptrdiff_t *shape, int naxes, const int *axes,
                                int narrays, const ptrdiff_t *const *strides, const ptrdiff_t *itemsize,
                                ln_extent *extent, ln_walk *walks);

#endif
