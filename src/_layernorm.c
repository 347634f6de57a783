/*
 * _layernorm.c -- the CPython/NumPy binding of the LayerNorm kernels.
 *
 * In Python terms, layer_norm(x, normalized_shape, weight, bias, eps) is
 *
 *     axes = tuple(range(-len(normalized_shape), 0))
 *     mean = x.mean(axes, keepdims=True)
 *     rstd = 1 / np.sqrt(x.var(axes, keepdims=True) + eps)     # biased variance
 *     return (x - mean) * rstd * weight + bias
 *
 * computed by ln_kernels.c in float64 statistics.  This file only checks and
 * converts arguments (with torch's error texts), allocates results and releases
 * the GIL around the kernel.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <numpy/arrayobject.h>

#include <stdlib.h>
#include <string.h>

#include "ln_kernels.h"

#define LN_MAX_DIMS 64

/* ------------------------------------------------------------------------ */
/* Argument parsing                                                          */
/* ------------------------------------------------------------------------ */

/* Fills values[] (borrowed references, NULL where absent) from fastcall arguments:
   the first max_positional names may come by position, any of them by keyword.
   Returns 0, or -1 with TypeError set. */
static int
parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
           const char *const names[], int n_names, int max_positional, int n_required,
           PyObject *values[])
{
    if (nargs > max_positional) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional arguments (%zd given)",
                     fname, max_positional, nargs);
        return -1;
    }
    for (int i = 0; i < n_names; i++) {
        values[i] = i < nargs ? args[i] : NULL;
    }
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int found = -1;
        for (int i = 0; i < n_names && found < 0; i++) {
            if (PyUnicode_CompareWithASCIIString(key, names[i]) == 0) {
                found = i;
            }
        }
        if (found < 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fname, key);
            return -1;
        }
        if (values[found]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname,
                         names[found]);
            return -1;
        }
        values[found] = args[nargs + k];
    }
    for (int i = 0; i < n_required; i++) {
        if (!values[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s' (pos %d)", fname,
                         names[i], i + 1);
            return -1;
        }
    }
    return 0;
}

typedef struct {
    int ndim;
    npy_intp dims[LN_MAX_DIMS];
    npy_intp size;  /* product of dims */
} shape_t;

/* New reference: the dims as a Python list, for messages that print like torch's [2, 3]. */
static PyObject *
dims_as_list(const npy_intp *dims, int ndim)
{
    PyObject *list = PyList_New(ndim);
    for (int i = 0; list && i < ndim; i++) {
        PyObject *item = PyLong_FromSsize_t(dims[i]);
        if (!item) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

/* Parses an int or a sequence of ints.  Returns 0, or -1 with an exception set. */
static int
parse_normalized_shape(PyObject *obj, shape_t *shape)
{
    int scalar = PyLong_Check(obj) || (PyArray_Check(obj) && PyArray_NDIM((PyArrayObject *)obj) == 0) ||
                 (PyIndex_Check(obj) && !PySequence_Check(obj));
    shape->ndim = 0;
    shape->size = 1;
    if (scalar) {
        Py_ssize_t n = PyNumber_AsSsize_t(obj, PyExc_OverflowError);
        if (n == -1 && PyErr_Occurred()) {
            return -1;
        }
        shape->ndim = 1;
        shape->dims[0] = n;
    }
    else if (PySequence_Check(obj) && !PyUnicode_Check(obj) && !PyBytes_Check(obj)) {
        PyObject *seq = PySequence_Fast(obj, "normalized_shape must be an int or a sequence of ints");
        if (!seq) {
            return -1;
        }
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (n > LN_MAX_DIMS) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "normalized_shape has %zd dimensions, at most %d are supported",
                         n, LN_MAX_DIMS);
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
            if (!PyIndex_Check(item) || PyBool_Check(item)) {
                PyErr_Format(PyExc_TypeError,
                             "normalized_shape must be an int or a sequence of ints, but found "
                             "element of type %.200s at pos %zd",
                             Py_TYPE(item)->tp_name, i);
                Py_DECREF(seq);
                return -1;
            }
            Py_ssize_t d = PyNumber_AsSsize_t(item, PyExc_OverflowError);
            if (d == -1 && PyErr_Occurred()) {
                Py_DECREF(seq);
                return -1;
            }
            shape->dims[i] = d;
        }
        shape->ndim = (int)n;
        Py_DECREF(seq);
    }
    else {
        PyErr_Format(PyExc_TypeError, "normalized_shape must be an int or a sequence of ints, got %.200s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    for (int i = 0; i < shape->ndim; i++) {
        if (shape->dims[i] < 0) {
            PyObject *list = dims_as_list(shape->dims, shape->ndim);
            if (list) {
                PyErr_Format(PyExc_ValueError,
                             "normalized_shape must not contain negative sizes, but got "
                             "normalized_shape = %R",
                             list);
                Py_DECREF(list);
            }
            return -1;
        }
        shape->size *= shape->dims[i];
    }
    if (shape->ndim == 0) {
        PyErr_SetString(PyExc_ValueError,
                        "Expected normalized_shape to be at least 1-dimensional, i.e., containing at "
                        "least one element, but got normalized_shape = []");
        return -1;
    }
    return 0;
}

static int
parse_eps(PyObject *obj, double *eps)
{
    if (!obj) {
        *eps = 1e-5;
        return 0;
    }
    if (!PyFloat_Check(obj) && !PyLong_Check(obj) && !PyNumber_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "eps must be a real number, got %.200s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    *eps = PyFloat_AsDouble(obj);
    if (*eps == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Arrays                                                                    */
/* ------------------------------------------------------------------------ */

/* torch's name for a NumPy dtype it refuses, or NULL when torch has none. */
static const char *
torch_type_name(PyArray_Descr *descr)
{
    static const char *const ints[] = {"Char", "Short", "Int", "Long"};
    static const char *const uints[] = {"Byte", "UInt16", "UInt32", "UInt64"};
    const int size = (int)PyDataType_ELSIZE(descr);
    const int index = size == 1 ? 0 : size == 2 ? 1 : size == 4 ? 2 : size == 8 ? 3 : -1;
    switch (descr->kind) {
    case 'b':
        return "Bool";
    case 'i':
        return index >= 0 ? ints[index] : NULL;
    case 'u':
        return index >= 0 ? uints[index] : NULL;
    case 'c':
        return size == 8 ? "ComplexFloat" : size == 16 ? "ComplexDouble" : NULL;
    default:
        return NULL;
    }
}

/* New reference: obj as an ndarray (itself when it is one), or NULL. */
static PyArrayObject *
as_array(PyObject *obj)
{
    if (PyArray_Check(obj)) {
        Py_INCREF(obj);
        return (PyArrayObject *)obj;
    }
    PyArrayObject *arr = (PyArrayObject *)PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
    if (arr) {
        return arr;
    }
    /* A torch tensor that requires grad refuses to become an array with a RuntimeError; its
       values, detached from the autograd graph, are what we compute on (torch itself is never
       imported). Any other error, KeyboardInterrupt and MemoryError included, stands. */
    PyObject *exc_type, *exc_value, *exc_tb, *detached = NULL;
    if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) {
        return NULL;
    }
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    if (PyObject_HasAttrString(obj, "requires_grad") && PyObject_HasAttrString(obj, "detach")) {
        detached = PyObject_CallMethod(obj, "detach", NULL);
        arr = detached ? (PyArrayObject *)PyArray_FromAny(detached, NULL, 0, 0, 0, NULL) : NULL;
        Py_XDECREF(detached);
    }
    if (arr) {
        Py_XDECREF(exc_type);
        Py_XDECREF(exc_value);
        Py_XDECREF(exc_tb);
    }
    else {
        PyErr_Clear();
        PyErr_Restore(exc_type, exc_value, exc_tb);
    }
    return arr;
}

/* The kernel dtype of a float16/32/64 array; -1 with TypeError set otherwise. */
static int
kernel_dtype(PyArrayObject *arr, const char *kernel, const char *what)
{
    switch (PyArray_TYPE(arr)) {
    case NPY_HALF:
        return LN_F16;
    case NPY_FLOAT:
        return LN_F32;
    case NPY_DOUBLE:
        return LN_F64;
    }
    PyArray_Descr *descr = PyArray_DESCR(arr);
    const char *torch_name = torch_type_name(descr);
    if (torch_name) {
        PyErr_Format(PyExc_TypeError,
                     "\"%s\" not implemented for '%s': %s takes float16, float32 or "
                     "float64 arrays, got dtype %S; convert it first, e.g. x.astype(np.float32)",
                     kernel, torch_name, what, (PyObject *)descr);
    }
    else {
        PyErr_Format(PyExc_TypeError,
                     "%s takes float16, float32 or float64 arrays, got dtype %S; convert it first, "
                     "e.g. x.astype(np.float32)",
                     what, (PyObject *)descr);
    }
    return -1;
}

static const int param_type_num[] = {NPY_FLOAT, NPY_FLOAT, NPY_DOUBLE};
static const npy_intp param_size[] = {4, 4, 8};
static const int elem_type_num[] = {NPY_HALF, NPY_FLOAT, NPY_DOUBLE};

/* Checks that arr's trailing dims equal the normalized shape (torch's message). */
static int
check_trailing_shape(PyArrayObject *arr, const shape_t *ns)
{
    const int ndim = PyArray_NDIM(arr);
    int ok = ndim >= ns->ndim;
    for (int i = 0; ok && i < ns->ndim; i++) {
        ok = PyArray_DIM(arr, ndim - ns->ndim + i) == ns->dims[i];
    }
    if (ok) {
        return 0;
    }
    PyObject *ns_list = dims_as_list(ns->dims, ns->ndim);
    PyObject *size_list = dims_as_list(PyArray_DIMS(arr), ndim);
    PyObject *star = ns_list ? PyUnicode_FromFormat("%R", ns_list) : NULL;
    if (ns_list && size_list && star) {
        /* "[*, 2, 2]" from "[2, 2]" */
        PyObject *tail = PyUnicode_Substring(star, 1, PyUnicode_GET_LENGTH(star));
        if (tail) {
            PyErr_Format(PyExc_ValueError,
                         "Given normalized_shape=%R, expected input with shape [*, %U, but got input "
                         "of size%R",
                         ns_list, tail, size_list);
            Py_DECREF(tail);
        }
    }
    Py_XDECREF(star);
    Py_XDECREF(ns_list);
    Py_XDECREF(size_list);
    return -1;
}

/* Stores into *out a new reference to the parameter `obj` as a C-contiguous array of
   the param type, or NULL for None.  Returns 0, or -1 with an exception set. */
static int
param_array(PyObject *obj, const char *name, const shape_t *ns, int type_num, PyArrayObject **out)
{
    *out = NULL;
    if (!obj || obj == Py_None) {
        return 0;
    }
    PyArrayObject *arr = as_array(obj);
    if (!arr) {
        return -1;
    }
    int ok = PyArray_NDIM(arr) == ns->ndim;
    for (int i = 0; ok && i < ns->ndim; i++) {
        ok = PyArray_DIM(arr, i) == ns->dims[i];
    }
    if (!ok) {
        PyObject *got = dims_as_list(PyArray_DIMS(arr), PyArray_NDIM(arr));
        PyObject *want = dims_as_list(ns->dims, ns->ndim);
        if (got && want) {
            PyErr_Format(PyExc_ValueError,
                         "Expected %s to be of same shape as normalized_shape, but got %s of shape %R "
                         "and normalized_shape = %R",
                         name, name, got, want);
        }
        Py_XDECREF(got);
        Py_XDECREF(want);
        Py_DECREF(arr);
        return -1;
    }
    if (PyArray_DESCR(arr)->kind != 'f') {
        PyErr_Format(PyExc_TypeError, "%s must have a floating-point dtype, got dtype %S", name,
                     (PyObject *)PyArray_DESCR(arr));
        Py_DECREF(arr);
        return -1;
    }
    *out = (PyArrayObject *)PyArray_FromArray(arr, PyArray_DescrFromType(type_num),
                                              NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    Py_DECREF(arr);
    return *out ? 0 : -1;
}

/* If the last `inner_ndim` dims of arr form one contiguous block and its leading dims
   collapse to a single stride, stores that stride in elements and returns 1. */
static int
rows_view(PyArrayObject *arr, int inner_ndim, npy_intp *row_step)
{
    const int ndim = PyArray_NDIM(arr);
    const npy_intp itemsize = PyArray_ITEMSIZE(arr);
    const npy_intp *dims = PyArray_DIMS(arr), *strides = PyArray_STRIDES(arr);
    if (!PyArray_ISALIGNED(arr) || !PyArray_ISNOTSWAPPED(arr)) {
        return 0;
    }
    npy_intp expected = itemsize;
    for (int k = ndim - 1; k >= ndim - inner_ndim; k--) {
        if (dims[k] != 1 && strides[k] != expected) {
            return 0;
        }
        expected *= dims[k];
    }
    npy_intp inner_size = expected / itemsize;
    *row_step = inner_size;
    npy_intp next_stride = 0, next_dim = 0;
    int seen = 0;
    for (int k = ndim - inner_ndim - 1; k >= 0; k--) {
        if (dims[k] == 1) {
            continue;
        }
        if (!seen) {
            if (strides[k] % itemsize != 0) {
                return 0;
            }
            *row_step = strides[k] / itemsize;
            seen = 1;
        }
        else if (strides[k] != next_stride * next_dim) {
            return 0;
        }
        next_stride = strides[k];
        next_dim = dims[k];
    }
    return 1;
}

/* New reference: arr itself when the kernel can read its rows in place (setting
   *row_step), else a C-contiguous native copy (row_step = row_len). */
static PyArrayObject *
readable_rows(PyArrayObject *arr, int inner_ndim, npy_intp row_len, npy_intp *row_step)
{
    if (rows_view(arr, inner_ndim, row_step)) {
        Py_INCREF(arr);
        return arr;
    }
    *row_step = row_len;
    return (PyArrayObject *)PyArray_FromArray(arr, PyArray_DescrFromType(PyArray_TYPE(arr)),
                                              NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED |
                                                  NPY_ARRAY_ENSURECOPY | NPY_ARRAY_FORCECAST);
}

/* The bytes [lo, hi) an array's elements span (lo == hi when empty). */
static void
memory_extent(PyArrayObject *arr, char **lo, char **hi)
{
    char *start = PyArray_BYTES(arr), *end = PyArray_BYTES(arr);
    for (int k = 0; k < PyArray_NDIM(arr); k++) {
        npy_intp dim = PyArray_DIM(arr, k), stride = PyArray_STRIDE(arr, k);
        if (dim == 0) {
            *lo = *hi = start;
            return;
        }
        if (stride > 0) {
            end += stride * (dim - 1);
        }
        else {
            start += stride * (dim - 1);
        }
    }
    *lo = start;
    *hi = end + PyArray_ITEMSIZE(arr);
}

static int
arrays_overlap(PyArrayObject *a, PyArrayObject *b)
{
    char *a_lo, *a_hi, *b_lo, *b_hi;
    memory_extent(a, &a_lo, &a_hi);
    memory_extent(b, &b_lo, &b_hi);
    return a_lo < a_hi && b_lo < b_hi && a_lo < b_hi && b_lo < a_hi;
}

/* Replaces *arr (owned) with a private copy when it overlaps out. */
static int
detach_from_output(PyArrayObject **arr, PyArrayObject *out)
{
    if (!*arr || !arrays_overlap(*arr, out)) {
        return 0;
    }
    PyArrayObject *copy = (PyArrayObject *)PyArray_NewCopy(*arr, NPY_CORDER);
    Py_SETREF(*arr, copy);
    return copy ? 0 : -1;
}

/* Checks a caller's out= array; returns a new reference to it, or NULL. */
static PyArrayObject *
check_out(PyObject *obj, PyArrayObject *like, int type_num)
{
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "out must be a numpy.ndarray, got %.200s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyArrayObject *out = (PyArrayObject *)obj;
    if (PyArray_TYPE(out) != type_num || !PyArray_ISNOTSWAPPED(out)) {
        PyErr_Format(PyExc_TypeError, "out has dtype %S, but the result has dtype %S",
                     (PyObject *)PyArray_DESCR(out), (PyObject *)PyArray_DESCR(like));
        return NULL;
    }
    if (!PyArray_SAMESHAPE(out, like)) {
        PyObject *got = dims_as_list(PyArray_DIMS(out), PyArray_NDIM(out));
        PyObject *want = dims_as_list(PyArray_DIMS(like), PyArray_NDIM(like));
        if (got && want) {
            PyErr_Format(PyExc_ValueError, "out has shape %R, but the result has shape %R", got, want);
        }
        Py_XDECREF(got);
        Py_XDECREF(want);
        return NULL;
    }
    if (!PyArray_IS_C_CONTIGUOUS(out) || !PyArray_ISALIGNED(out)) {
        PyErr_SetString(PyExc_ValueError, "out must be a C-contiguous, aligned array");
        return NULL;
    }
    if (!PyArray_ISWRITEABLE(out)) {
        PyErr_SetString(PyExc_ValueError, "out is read-only");
        return NULL;
    }
    Py_INCREF(out);
    return out;
}

/* The number of rows: the product of the dims before the normalized ones. */
static npy_intp
batch_size(PyArrayObject *arr, int ns_ndim)
{
    npy_intp rows = 1;
    for (int k = 0; k < PyArray_NDIM(arr) - ns_ndim; k++) {
        rows *= PyArray_DIM(arr, k);
    }
    return rows;
}

/* New reference: an uninitialised array of the input's batch dims + (1,) * ns_ndim. */
static PyArrayObject *
stats_array(PyArrayObject *input, int ns_ndim, int type_num)
{
    npy_intp dims[LN_MAX_DIMS + LN_MAX_DIMS];
    const int ndim = PyArray_NDIM(input);
    for (int k = 0; k < ndim; k++) {
        dims[k] = k < ndim - ns_ndim ? PyArray_DIM(input, k) : 1;
    }
    return (PyArrayObject *)PyArray_SimpleNew(ndim, dims, type_num);
}

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */
/* ------------------------------------------------------------------------ */

/* What forward() returns besides the output. */
typedef enum {
    RETURN_OUTPUT,          /* output */
    RETURN_STATS,           /* (output, mean, rstd) */
    RETURN_SAVED_FOR_GRAD,  /* (output, (input, stats)): input a private C-contiguous array,
                               stats a bytes object holding mean then rstd (see saved_backward) */
} forward_returns;

/* New reference: input's data in an array nobody else holds (for backward to read after the
   caller may have changed its own), C-contiguous and native: `rows` itself when it is a
   copy made here, else a new copy. */
static PyArrayObject *
private_input(PyArrayObject *input, PyArrayObject *rows)
{
    /* Only a copy made here is known to be private: an array that came out of the caller's
       object, even one owning its data, may be that object's own buffer (an __array__ that
       returns a kept array). */
    if (rows != input && PyArray_IS_C_CONTIGUOUS(rows)) {
        Py_INCREF(rows);
        return rows;
    }
    if (PyArray_IS_C_CONTIGUOUS(rows) && PyArray_ISNOTSWAPPED(rows)) {
        /* the common case, without NumPy's general copy machinery (a third of a small
           call's time) */
        PyArrayObject *copy = (PyArrayObject *)PyArray_SimpleNew(
            PyArray_NDIM(rows), PyArray_DIMS(rows), PyArray_TYPE(rows));
        if (copy) {
            memcpy(PyArray_DATA(copy), PyArray_DATA(rows), (size_t)PyArray_NBYTES(rows));
        }
        return copy;
    }
    return (PyArrayObject *)PyArray_NewCopy(rows, NPY_CORDER);
}

/* New reference: what `returns` says, or NULL with an exception set. */
static PyObject *
forward(const char *fname, PyObject *input_obj, PyObject *ns_obj, PyObject *weight_obj,
        PyObject *bias_obj, PyObject *eps_obj, PyObject *out_obj, forward_returns returns)
{
    PyObject *result = NULL;
    PyArrayObject *input = NULL, *rows = NULL, *weight = NULL, *bias = NULL;
    PyArrayObject *output = NULL, *mean = NULL, *rstd = NULL, *saved_input = NULL;
    PyObject *saved_stats = NULL;
    shape_t ns;
    double eps;
    npy_intp row_step;

    if (parse_normalized_shape(ns_obj, &ns) < 0 || parse_eps(eps_obj, &eps) < 0) {
        goto done;
    }
    input = as_array(input_obj);
    if (!input) {
        goto done;
    }
    const int dtype = kernel_dtype(input, "LayerNormKernelImpl", fname);
    if (dtype < 0 || param_array(weight_obj, "weight", &ns, param_type_num[dtype], &weight) < 0 ||
        param_array(bias_obj, "bias", &ns, param_type_num[dtype], &bias) < 0 ||
        check_trailing_shape(input, &ns) < 0) {
        goto done;
    }
    rows = readable_rows(input, ns.ndim, ns.size, &row_step);
    if (!rows) {
        goto done;
    }
    if (out_obj && out_obj != Py_None) {
        output = check_out(out_obj, input, elem_type_num[dtype]);
        if (!output) {
            goto done;
        }
        /* Writing over the rows being read is safe only row onto the same row. */
        const int in_place = PyArray_DATA(rows) == PyArray_DATA(output) && row_step == ns.size;
        PyArrayObject *rows_before = rows;
        if ((!in_place && detach_from_output(&rows, output) < 0) ||
            detach_from_output(&weight, output) < 0 || detach_from_output(&bias, output) < 0) {
            goto done;
        }
        if (rows != rows_before) {
            row_step = ns.size;  /* now a C-contiguous copy */
        }
    }
    else {
        output = (PyArrayObject *)PyArray_SimpleNew(PyArray_NDIM(input), PyArray_DIMS(input),
                                                    elem_type_num[dtype]);
        if (!output) {
            goto done;
        }
    }
    const npy_intp batch = batch_size(input, ns.ndim);
    char *stats_data = NULL;   /* mean (batch values) then rstd (batch values) */
    if (returns == RETURN_STATS) {
        mean = stats_array(input, ns.ndim, param_type_num[dtype]);
        rstd = mean ? stats_array(input, ns.ndim, param_type_num[dtype]) : NULL;
        if (!rstd) {
            goto done;
        }
    }
    if (returns == RETURN_SAVED_FOR_GRAD) {
        /* One bytes object instead of two arrays: a third of a small training-mode call
           went into making the mean and rstd arrays, which only saved_backward reads. */
        saved_stats = PyBytes_FromStringAndSize(NULL, 2 * batch * param_size[dtype]);
        saved_input = saved_stats ? private_input(input, rows) : NULL;
        if (!saved_input) {
            goto done;
        }
        stats_data = PyBytes_AS_STRING(saved_stats);
    }

    const ln_forward_args args = {
        .dtype = (ln_dtype)dtype,
        .rows = batch,
        .row_len = ns.size,
        .input = PyArray_DATA(rows),
        .input_row_step = row_step,
        .output = PyArray_DATA(output),
        .weight = weight ? PyArray_DATA(weight) : NULL,
        .bias = bias ? PyArray_DATA(bias) : NULL,
        .eps = eps,
        .mean = mean ? PyArray_DATA(mean) : stats_data,
        .rstd = rstd ? PyArray_DATA(rstd) : stats_data ? stats_data + batch * param_size[dtype] : NULL,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = ln_forward(&args);
    Py_END_ALLOW_THREADS
    if (status < 0) {
        PyErr_NoMemory();
        goto done;
    }
    switch (returns) {
    case RETURN_OUTPUT:
        result = (PyObject *)output;
        Py_INCREF(result);
        break;
    case RETURN_STATS:
        result = PyTuple_Pack(3, (PyObject *)output, (PyObject *)mean, (PyObject *)rstd);
        break;
    case RETURN_SAVED_FOR_GRAD: {
        PyObject *saved = PyTuple_Pack(2, (PyObject *)saved_input, saved_stats);
        result = saved ? PyTuple_Pack(2, (PyObject *)output, saved) : NULL;
        Py_XDECREF(saved);
        break;
    }
    }
done:
    Py_XDECREF(saved_input);
    Py_XDECREF(saved_stats);
    Py_XDECREF(input);
    Py_XDECREF(rows);
    Py_XDECREF(weight);
    Py_XDECREF(bias);
    Py_XDECREF(output);
    Py_XDECREF(mean);
    Py_XDECREF(rstd);
    return result;
}

PyDoc_STRVAR(layer_norm_doc,
"layer_norm($module, input, normalized_shape, weight=None, bias=None, eps=1e-05, *, out=None)\n"
"--\n"
"\n"
"Layer normalization over the last len(normalized_shape) dimensions, as\n"
"torch.nn.functional.layer_norm.\n"
"\n"
"Parameters\n"
"----------\n"
"input : array_like of float16, float32 or float64\n"
"normalized_shape : int or sequence of int\n"
"    The trailing shape to normalize over.\n"
"weight, bias : array_like of shape normalized_shape, optional\n"
"    Elementwise scale (default ones) and shift (default zeros).\n"
"eps : float\n"
"    Added to the (biased) variance inside the square root.\n"
"out : ndarray, optional\n"
"    C-contiguous array of the input's shape and dtype to write into; may be the\n"
"    input itself.\n"
"\n"
"Returns\n"
"-------\n"
"ndarray\n"
"    (input - mean) / sqrt(var + eps) * weight + bias, of the input's dtype.\n");

static PyObject *
layer_norm(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"input", "normalized_shape", "weight", "bias", "eps", "out"};
    PyObject *v[6];
    if (parse_args("layer_norm", args, nargs, kwnames, names, 6, 5, 2, v) < 0) {
        return NULL;
    }
    return forward("layer_norm", v[0], v[1], v[2], v[3], v[4], v[5], RETURN_OUTPUT);
}

PyDoc_STRVAR(native_layer_norm_doc,
"native_layer_norm($module, input, normalized_shape, weight=None, bias=None, eps=1e-05)\n"
"--\n"
"\n"
"Layer normalization that also returns its statistics, as torch.native_layer_norm.\n"
"\n"
"Returns\n"
"-------\n"
"(output, mean, rstd)\n"
"    mean and rstd = 1 / sqrt(var + eps) have shape\n"
"    input.shape[:-D] + (1,) * D, D = len(normalized_shape), and dtype float32\n"
"    (float64 for float64 input).\n");

static PyObject *
native_layer_norm(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"input", "normalized_shape", "weight", "bias", "eps"};
    PyObject *v[5];
    if (parse_args("native_layer_norm", args, nargs, kwnames, names, 5, 5, 2, v) < 0) {
        return NULL;
    }
    return forward("native_layer_norm", v[0], v[1], v[2], v[3], v[4], NULL, RETURN_STATS);
}

PyDoc_STRVAR(training_forward_doc,
"training_forward($module, input, normalized_shape, weight=None, bias=None, eps=1e-05)\n"
"--\n"
"\n"
"native_layer_norm that also returns what saved_backward needs to read later:\n"
"(output, (input, stats)), where input holds the input's values in a C-contiguous\n"
"array that nothing else refers to (the array made from a list or a strided view\n"
"when there is one, else a copy), so that changing the caller's array afterwards\n"
"cannot change the gradients, and stats is a bytes object holding the mean and then\n"
"the rstd of every row.  Used by LayerNorm in training mode.\n");

static PyObject *
training_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"input", "normalized_shape", "weight", "bias", "eps"};
    PyObject *v[5];
    if (parse_args("training_forward", args, nargs, kwnames, names, 5, 5, 2, v) < 0) {
        return NULL;
    }
    return forward("LayerNorm", v[0], v[1], v[2], v[3], v[4], NULL, RETURN_SAVED_FOR_GRAD);
}

/* ------------------------------------------------------------------------ */
/* Backward                                                                  */
/* ------------------------------------------------------------------------ */

/* New reference: a statistics array (mean or rstd) as contiguous params, checked
   to hold one value per row. */
static PyArrayObject *
stats_input(PyObject *obj, const char *name, npy_intp rows, int type_num)
{
    PyArrayObject *arr = as_array(obj);
    if (!arr) {
        return NULL;
    }
    if (PyArray_DESCR(arr)->kind != 'f') {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a float array, as native_layer_norm returns it; got %R of dtype %S",
                     name, obj == Py_None ? Py_None : (PyObject *)Py_TYPE(obj),
                     (PyObject *)PyArray_DESCR(arr));
        Py_DECREF(arr);
        return NULL;
    }
    if (PyArray_SIZE(arr) != rows) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be a float array with one value per normalized row (%zd), as "
                     "native_layer_norm returns it; got dtype %S and %zd values",
                     name, (Py_ssize_t)rows, (PyObject *)PyArray_DESCR(arr), (Py_ssize_t)PyArray_SIZE(arr));
        Py_DECREF(arr);
        return NULL;
    }
    PyArrayObject *converted = (PyArrayObject *)PyArray_FromArray(
        arr, PyArray_DescrFromType(type_num), NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    Py_DECREF(arr);
    return converted;
}

static int
parse_output_mask(PyObject *obj, int mask[3])
{
    mask[0] = mask[1] = mask[2] = 1;
    if (!obj) {
        return 0;
    }
    PyObject *seq = PySequence_Fast(obj, "output_mask must be a sequence of three bools");
    if (!seq) {
        return -1;
    }
    int status = 0;
    if (PySequence_Fast_GET_SIZE(seq) != 3) {
        PyErr_SetString(PyExc_ValueError, "output_mask must be a sequence of three bools");
        status = -1;
    }
    for (int i = 0; status == 0 && i < 3; i++) {
        /* bools and integers only: "False" or None taken by truth value would silently
           compute gradients the caller did not ask for */
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBool_Check(item) && !PyLong_Check(item) && !PyArray_IsScalar(item, Bool) &&
            !PyArray_IsScalar(item, Integer)) {
            PyErr_Format(PyExc_TypeError, "output_mask must be a sequence of three bools, got %R", obj);
            status = -1;
            break;
        }
        mask[i] = PyObject_IsTrue(item);
        if (mask[i] < 0) {
            status = -1;
        }
    }
    Py_DECREF(seq);
    return status;
}

PyDoc_STRVAR(layer_norm_backward_doc,
"layer_norm_backward($module, grad_output, input, normalized_shape, mean, rstd, weight=None,\n"
"                    bias=None, output_mask=(True, True, True))\n"
"--\n"
"\n"
"Gradients of layer_norm, as torch.ops.aten.native_layer_norm_backward.\n"
"\n"
"mean and rstd are the statistics native_layer_norm returned for this input.\n"
"\n"
"Returns\n"
"-------\n"
"(grad_input, grad_weight, grad_bias)\n"
"    Each is None where its output_mask entry is False; grad_weight is None\n"
"    without a weight and grad_bias None without a bias.  grad_weight and\n"
"    grad_bias have shape normalized_shape.\n");

/* New reference: (grad_input, grad_weight, grad_bias), or NULL with an exception set.
   The statistics come either as the mean and rstd objects of layer_norm_backward or, with
   mean_obj NULL, as the bytes that training_forward saved. */
static PyObject *
backward(PyObject *grad_output_obj, PyObject *input_obj, const shape_t *ns_arg, PyObject *mean_obj,
         PyObject *rstd_obj, PyObject *saved_stats, PyObject *weight_obj, PyObject *bias_obj,
         const int mask[3])
{
    PyObject *result = NULL;
    PyArrayObject *input = NULL, *grad_out = NULL, *input_rows = NULL, *grad_rows = NULL;
    PyArrayObject *mean = NULL, *rstd = NULL, *weight = NULL, *bias = NULL;
    PyArrayObject *grad_input = NULL, *grad_weight = NULL, *grad_bias = NULL;
    const shape_t ns = *ns_arg;
    npy_intp input_step, grad_step;
    const char *mean_data, *rstd_data;

    input = as_array(input_obj);
    if (!input) {
        goto done;
    }
    const int dtype = kernel_dtype(input, "LayerNormBackwardKernelImpl", "layer_norm_backward");
    if (dtype < 0 || param_array(weight_obj, "weight", &ns, param_type_num[dtype], &weight) < 0 ||
        param_array(bias_obj, "bias", &ns, param_type_num[dtype], &bias) < 0 ||
        check_trailing_shape(input, &ns) < 0) {
        goto done;
    }
    grad_out = as_array(grad_output_obj);
    if (!grad_out) {
        goto done;
    }
    if (PyArray_DESCR(grad_out)->kind != 'f') {
        PyErr_Format(PyExc_TypeError, "grad_output must have a floating-point dtype, got dtype %S",
                     (PyObject *)PyArray_DESCR(grad_out));
        goto done;
    }
    if (!PyArray_SAMESHAPE(grad_out, input)) {
        PyObject *got = dims_as_list(PyArray_DIMS(grad_out), PyArray_NDIM(grad_out));
        PyObject *want = dims_as_list(PyArray_DIMS(input), PyArray_NDIM(input));
        if (got && want) {
            PyErr_Format(PyExc_ValueError,
                         "grad_output of shape %R does not match input of size%R", got, want);
        }
        Py_XDECREF(got);
        Py_XDECREF(want);
        goto done;
    }
    if (PyArray_TYPE(grad_out) != PyArray_TYPE(input)) {
        Py_SETREF(grad_out, (PyArrayObject *)PyArray_FromArray(
                                grad_out, PyArray_DescrFromType(PyArray_TYPE(input)),
                                NPY_ARRAY_CARRAY_RO | NPY_ARRAY_FORCECAST));
        if (!grad_out) {
            goto done;
        }
    }
    const npy_intp rows = batch_size(input, ns.ndim);
    if (mean_obj) {
        mean = stats_input(mean_obj, "mean", rows, param_type_num[dtype]);
        rstd = mean ? stats_input(rstd_obj, "rstd", rows, param_type_num[dtype]) : NULL;
        if (!rstd) {
            goto done;
        }
        mean_data = PyArray_DATA(mean);
        rstd_data = PyArray_DATA(rstd);
    }
    else {
        if (!PyBytes_Check(saved_stats) || PyBytes_GET_SIZE(saved_stats) != 2 * rows * param_size[dtype]) {
            PyErr_SetString(PyExc_ValueError,
                            "stats must be the bytes that training_forward returned with this input");
            goto done;
        }
        mean_data = PyBytes_AS_STRING(saved_stats);
        rstd_data = mean_data + rows * param_size[dtype];
    }
    input_rows = readable_rows(input, ns.ndim, ns.size, &input_step);
    grad_rows = input_rows ? readable_rows(grad_out, ns.ndim, ns.size, &grad_step) : NULL;
    if (!grad_rows) {
        goto done;
    }
    if (mask[0]) {
        grad_input = (PyArrayObject *)PyArray_SimpleNew(PyArray_NDIM(input), PyArray_DIMS(input),
                                                        elem_type_num[dtype]);
        if (!grad_input) {
            goto done;
        }
    }
    if (mask[1] && weight) {
        grad_weight = (PyArrayObject *)PyArray_SimpleNew(ns.ndim, ns.dims, param_type_num[dtype]);
        if (!grad_weight) {
            goto done;
        }
    }
    if (mask[2] && bias) {
        grad_bias = (PyArrayObject *)PyArray_SimpleNew(ns.ndim, ns.dims, param_type_num[dtype]);
        if (!grad_bias) {
            goto done;
        }
    }
    const ln_backward_args bargs = {
        .dtype = (ln_dtype)dtype,
        .rows = rows,
        .row_len = ns.size,
        .grad_output = PyArray_DATA(grad_rows),
        .grad_output_row_step = grad_step,
        .input = PyArray_DATA(input_rows),
        .input_row_step = input_step,
        .mean = mean_data,
        .rstd = rstd_data,
        .weight = weight ? PyArray_DATA(weight) : NULL,
        .grad_input = grad_input ? PyArray_DATA(grad_input) : NULL,
        .grad_weight = grad_weight ? PyArray_DATA(grad_weight) : NULL,
        .grad_bias = grad_bias ? PyArray_DATA(grad_bias) : NULL,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = ln_backward(&bargs);
    Py_END_ALLOW_THREADS
    if (status < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyTuple_Pack(3, grad_input ? (PyObject *)grad_input : Py_None,
                          grad_weight ? (PyObject *)grad_weight : Py_None,
                          grad_bias ? (PyObject *)grad_bias : Py_None);
done:
    Py_XDECREF(input);
    Py_XDECREF(grad_out);
    Py_XDECREF(input_rows);
    Py_XDECREF(grad_rows);
    Py_XDECREF(mean);
    Py_XDECREF(rstd);
    Py_XDECREF(weight);
    Py_XDECREF(bias);
    Py_XDECREF(grad_input);
    Py_XDECREF(grad_weight);
    Py_XDECREF(grad_bias);
    return result;
}

static PyObject *
layer_norm_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"grad_output", "input", "normalized_shape", "mean",
                                        "rstd", "weight", "bias", "output_mask"};
    PyObject *v[8];
    shape_t ns;
    int mask[3];
    if (parse_args("layer_norm_backward", args, nargs, kwnames, names, 8, 8, 5, v) < 0 ||
        parse_normalized_shape(v[2], &ns) < 0 || parse_output_mask(v[7], mask) < 0) {
        return NULL;
    }
    return backward(v[0], v[1], &ns, v[3], v[4], NULL, v[5], v[6], mask);
}

PyDoc_STRVAR(saved_backward_doc,
"saved_backward($module, grad_output, input, stats, normalized_shape, weight=None, bias=None,\n"
"               output_mask=(True, True, True))\n"
"--\n"
"\n"
"layer_norm_backward from what training_forward saved: (input, stats), stats the bytes\n"
"holding the mean and then the rstd of every row.  Used by LayerNorm.backward.\n");

static PyObject *
saved_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"grad_output", "input", "stats", "normalized_shape",
                                        "weight", "bias", "output_mask"};
    PyObject *v[7];
    shape_t ns;
    int mask[3];
    if (parse_args("saved_backward", args, nargs, kwnames, names, 7, 7, 4, v) < 0 ||
        parse_normalized_shape(v[3], &ns) < 0 || parse_output_mask(v[6], mask) < 0) {
        return NULL;
    }
    return backward(v[0], v[1], &ns, NULL, NULL, v[2], v[4], v[5], mask);
}

/* ------------------------------------------------------------------------ */
/* Threads and SIMD level                                                    */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(set_num_threads_doc,
"set_num_threads($module, n, /)\n--\n\n"
"Use at most n threads (n >= 1) per call.  Results do not depend on n.");

static PyObject *
set_num_threads(PyObject *module, PyObject *arg)
{
    if (!PyIndex_Check(arg) || PyBool_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "set_num_threads() takes an int, got %.200s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n < 1) {
        PyErr_Format(PyExc_ValueError, "set_num_threads() needs n >= 1, got %zd", n);
        return NULL;
    }
    ln_threads_set(n > 256 ? 256 : (int)n);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(get_num_threads_doc,
"get_num_threads($module, /)\n--\n\nThe most threads one call may use.");

static PyObject *
get_num_threads(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLong(ln_threads_get());
}

PyDoc_STRVAR(simd_level_doc,
"simd_level($module, /)\n--\n\nThe kernel variant in use, one of available_simd_levels().");

static PyObject *
simd_level(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    return PyUnicode_FromString(ln_simd_name(ln_simd_get()));
}

PyDoc_STRVAR(available_simd_levels_doc,
"available_simd_levels($module, /)\n--\n\nThe kernel variants this CPU can run, 'scalar' first.");

static PyObject *
available_simd_levels(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    const int best = (int)ln_simd_best();
    Py_ssize_t count = 0;
    for (int level = 0; level <= best; level++) {
        count += ln_simd_name((ln_simd_level)level) != NULL;
    }
    PyObject *levels = PyTuple_New(count);
    for (int level = 0, i = 0; levels && level <= best; level++) {
        const char *name = ln_simd_name((ln_simd_level)level);
        if (!name) {
            continue;  /* a level this build lacks */
        }
        PyObject *item = PyUnicode_FromString(name);
        if (!item) {
            Py_CLEAR(levels);
            break;
        }
        PyTuple_SET_ITEM(levels, i++, item);
    }
    return levels;
}

static int
simd_level_from_name(const char *name)
{
    for (int level = 0; level < LN_SIMD_LEVELS; level++) {
        const char *level_name = ln_simd_name((ln_simd_level)level);
        if (level_name && strcmp(name, level_name) == 0) {
            return level;
        }
    }
    return -1;
}

PyDoc_STRVAR(set_simd_level_doc,
"set_simd_level($module, name, /)\n--\n\n"
"Force a kernel variant, one of available_simd_levels().  Results are identical\n"
"at every level; this exists for testing and benchmarking.");

static PyObject *
set_simd_level(PyObject *module, PyObject *arg)
{
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "set_simd_level() takes a str, got %.200s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) {
        return NULL;
    }
    int level = simd_level_from_name(name);
    if (level < 0 || ln_simd_set((ln_simd_level)level) < 0) {
        PyObject *levels = available_simd_levels(module, NULL);
        if (levels) {
            PyErr_Format(PyExc_ValueError, "unknown or unsupported SIMD level %R; this CPU runs %R", arg, levels);
            Py_DECREF(levels);
        }
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------ */
/* Module setup                                                              */
/* ------------------------------------------------------------------------ */

static PyMethodDef layernorm_methods[] = {
    {"layer_norm", (PyCFunction)(void (*)(void))layer_norm, METH_FASTCALL | METH_KEYWORDS, layer_norm_doc},
    {"training_forward", (PyCFunction)(void (*)(void))training_forward, METH_FASTCALL | METH_KEYWORDS,
     training_forward_doc},
    {"native_layer_norm", (PyCFunction)(void (*)(void))native_layer_norm, METH_FASTCALL | METH_KEYWORDS,
     native_layer_norm_doc},
    {"layer_norm_backward", (PyCFunction)(void (*)(void))layer_norm_backward,
     METH_FASTCALL | METH_KEYWORDS, layer_norm_backward_doc},
    {"saved_backward", (PyCFunction)(void (*)(void))saved_backward, METH_FASTCALL | METH_KEYWORDS,
     saved_backward_doc},
    {"set_num_threads", set_num_threads, METH_O, set_num_threads_doc},
    {"get_num_threads", get_num_threads, METH_NOARGS, get_num_threads_doc},
    {"simd_level", simd_level, METH_NOARGS, simd_level_doc},
    {"available_simd_levels", available_simd_levels, METH_NOARGS, available_simd_levels_doc},
    {"set_simd_level", set_simd_level, METH_O, set_simd_level_doc},
    {NULL, NULL, 0, NULL},
};

/* LAYERNORM_NUM_THREADS and LAYERNORM_SIMD, read once at import. */
static int
apply_environment(void)
{
    const char *threads = getenv("LAYERNORM_NUM_THREADS");
    if (threads && *threads) {
        char *end;
        long n = strtol(threads, &end, 10);
        if (*end != '\0' || n < 1) {
            PyErr_Format(PyExc_ValueError, "LAYERNORM_NUM_THREADS must be an integer >= 1, got '%s'",
                         threads);
            return -1;
        }
        ln_threads_set(n > 256 ? 256 : (int)n);
    }
    const char *simd = getenv("LAYERNORM_SIMD");
    if (simd && *simd) {
        int level = simd_level_from_name(simd);
        if (level < 0) {
            PyErr_Format(PyExc_ValueError, "LAYERNORM_SIMD must name a SIMD level of this build, got '%s'", simd);
            return -1;
        }
        /* a level above what the CPU runs falls back to the best it does run */
        if (ln_simd_set((ln_simd_level)level) < 0) {
            ln_simd_set(ln_simd_best());
        }
    }
    return 0;
}

static int
layernorm_exec(PyObject *module)
{
    if (PyArray_ImportNumPyAPI() < 0) {
        return -1;
    }
    return apply_environment();
}

static PyModuleDef_Slot layernorm_slots[] = {
    {Py_mod_exec, layernorm_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef layernorm_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "layernorm._layernorm",
    .m_doc = "LayerNorm kernels on NumPy arrays (the compiled core of the layernorm package).",
    .m_size = 0,
    .m_methods = layernorm_methods,
    .m_slots = layernorm_slots,
};

PyMODINIT_FUNC
PyInit__layernorm(void)
{
    return PyModuleDef_Init(&layernorm_module);
}
