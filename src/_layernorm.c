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
 * computed by the kernel layer (ln_kernels.h) with float64 statistics.  This file only checks
 * and converts arguments, allocates results and releases the GIL around the kernel.  It takes
 * NumPy arrays and whatever NumPy converts to one (np.asarray); it knows nothing of torch: the
 * Python layer (layernorm/functional.py) converts tensors and words dtype refusals as torch does.
 *
 * Sections: compat shims, module state, helpers (arguments, shapes, arrays), norm kinds with
 * the forward and backward they share, Python-facing functions, module setup.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <numpy/arrayobject.h>

#include <ctype.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ln_kernels.h"

#define LN_MAX_DIMS 64

/* ------------------------------------------------------------------------ */
/* Compat shims                                                              */
/* ------------------------------------------------------------------------ */

#if PY_VERSION_HEX < 0x030A0000
/* Python 3.9: PyModule_AddObject steals the reference only on success. */
static int
PyModule_AddObjectRef(PyObject *module, const char *name, PyObject *value)
{
    Py_XINCREF(value);
    int status = PyModule_AddObject(module, name, value);
    if (status < 0) {
        Py_XDECREF(value);
    }
    return status;
}
#endif

/* ------------------------------------------------------------------------ */
/* Module state                                                              */
/* ------------------------------------------------------------------------ */

/* Every keyword any function takes; their interned names live in the module state. */
typedef enum {
    KW_INPUT,
    KW_NORMALIZED_SHAPE,
    KW_WEIGHT,
    KW_BIAS,
    KW_EPS,
    KW_OUT,
    KW_GRAD_OUTPUT,
    KW_MEAN,
    KW_RSTD,
    KW_STATS,
    KW_OUTPUT_MASK,
    KW_COUNT
} keyword_id;

static const char *const keyword_text[KW_COUNT] = {
    [KW_INPUT] = "input",
    [KW_NORMALIZED_SHAPE] = "normalized_shape",
    [KW_WEIGHT] = "weight",
    [KW_BIAS] = "bias",
    [KW_EPS] = "eps",
    [KW_OUT] = "out",
    [KW_GRAD_OUTPUT] = "grad_output",
    [KW_MEAN] = "mean",
    [KW_RSTD] = "rstd",
    [KW_STATS] = "stats",
    [KW_OUTPUT_MASK] = "output_mask",
};

/* Every Python object the module holds.  There are no others: the kernel layer's state (thread
   pool, SIMD level, scratch buffer) is process-wide C state with its own locking. */
typedef struct {
    PyObject *unsupported_dtype_error;  /* UnsupportedDTypeError, a TypeError subclass */
    PyObject *parameter_changed_error;  /* ParameterChangedError, a RuntimeError subclass */
    PyObject *keywords[KW_COUNT];       /* interned keyword names */
} module_state;

/* Borrowed: the state of this module object. */
static inline module_state *
get_state(PyObject *module)
{
    return (module_state *)PyModule_GetState(module);
}

/* The GC slots: visit the state's references, drop them, and drop them when the module goes. */
static int
module_traverse(PyObject *module, visitproc visit, void *arg)
{
    module_state *state = get_state(module);
    Py_VISIT(state->unsupported_dtype_error);
    Py_VISIT(state->parameter_changed_error);
    for (int k = 0; k < KW_COUNT; k++) {
        Py_VISIT(state->keywords[k]);
    }
    return 0;
}

static int
module_clear(PyObject *module)
{
    module_state *state = get_state(module);
    Py_CLEAR(state->unsupported_dtype_error);
    Py_CLEAR(state->parameter_changed_error);
    for (int k = 0; k < KW_COUNT; k++) {
        Py_CLEAR(state->keywords[k]);
    }
    return 0;
}

static void
module_free(void *module)
{
    module_clear((PyObject *)module);
}

/* ------------------------------------------------------------------------ */
/* Helpers: sizes                                                            */
/* ------------------------------------------------------------------------ */

/* Every size, stride or offset this file multiplies goes through these two, so that an
   overflow is an error, never a wrong size. */

/* Stores a * b into *product.  Returns 0, or -1 when it does not fit in an npy_intp. */
static inline int
checked_mul(npy_intp a, npy_intp b, npy_intp *product)
{
    return __builtin_mul_overflow(a, b, product) ? -1 : 0;
}

/* Stores the product of factors[0 .. n) into *product.  Returns 0, or -1 when it (or a
   partial product) does not fit in an npy_intp. */
static int
checked_product(const npy_intp factors[], int n, npy_intp *product)
{
    npy_intp result = 1;
    for (int i = 0; i < n; i++) {
        if (checked_mul(result, factors[i], &result) < 0) {
            return -1;
        }
    }
    *product = result;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Helpers: arguments                                                        */
/* ------------------------------------------------------------------------ */

/* Fills values[] (borrowed references, NULL where absent) from fastcall arguments: the
   first max_positional of the n keywords may come by position, any of them by keyword.
   Returns 0, or -1 with TypeError set. */
static int
parse_args(module_state *state, const char *fname, PyObject *const *args, Py_ssize_t nargs,
           PyObject *kwnames, const keyword_id keywords[], int n, int max_positional,
           int n_required, PyObject *values[])
{
    if (nargs > max_positional) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional arguments (%zd given)",
                     fname, max_positional, nargs);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        values[i] = i < nargs ? args[i] : NULL;
    }
    const Py_ssize_t n_kw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < n_kw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int found = -1;
        /* the interpreter interns keyword names in calls: identity almost always decides */
        for (int i = 0; i < n && found < 0; i++) {
            if (key == state->keywords[keywords[i]]) {
                found = i;
            }
        }
        for (int i = 0; i < n && found < 0; i++) {
            int equal = PyUnicode_Compare(key, state->keywords[keywords[i]]);
            if (equal == -1 && PyErr_Occurred()) {
                return -1;
            }
            if (equal == 0) {
                found = i;
            }
        }
        if (found < 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fname, key);
            return -1;
        }
        if (values[found]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%U'", fname,
                         state->keywords[keywords[found]]);
            return -1;
        }
        values[found] = args[nargs + k];
    }
    for (int i = 0; i < n_required; i++) {
        if (!values[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%U' (pos %d)", fname,
                         state->keywords[keywords[i]], i + 1);
            return -1;
        }
    }
    return 0;
}

typedef struct {
    int ndim;
    npy_intp dims[LN_MAX_DIMS];
    npy_intp size;  /* product of dims, set once an input has been checked against them */
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

/* 1 when obj is a bool of Python or NumPy (which are ints to PyIndex_Check), else 0. */
static int
is_bool(PyObject *obj)
{
    return PyBool_Check(obj) || PyArray_IsScalar(obj, Bool) ||
           (PyArray_Check(obj) && PyArray_NDIM((PyArrayObject *)obj) == 0 &&
            PyArray_TYPE((PyArrayObject *)obj) == NPY_BOOL);
}

/* Fills *shape from an int or a sequence of ints (not bools: torch refuses True for 1).
   Returns 0, or -1 with an exception set. */
static int
parse_normalized_shape(PyObject *obj, shape_t *shape)
{
    int status = -1;
    PyObject *seq = NULL, *list = NULL;
    if (is_bool(obj)) {
        PyErr_SetString(PyExc_TypeError, "normalized_shape must be an int or a sequence of ints, not bool");
        return -1;
    }
    const int scalar = PyLong_Check(obj) ||
                       (PyArray_Check(obj) && PyArray_NDIM((PyArrayObject *)obj) == 0) ||
                       (PyIndex_Check(obj) && !PySequence_Check(obj));
    shape->ndim = 0;
    if (scalar) {
        Py_ssize_t n = PyNumber_AsSsize_t(obj, PyExc_OverflowError);
        if (n == -1 && PyErr_Occurred()) {
            goto done;
        }
        shape->ndim = 1;
        shape->dims[0] = n;
    }
    else if (PySequence_Check(obj) && !PyUnicode_Check(obj) && !PyBytes_Check(obj)) {
        seq = PySequence_Fast(obj, "normalized_shape must be an int or a sequence of ints");
        if (!seq) {
            goto done;
        }
        const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (n > LN_MAX_DIMS) {
            PyErr_Format(PyExc_ValueError, "normalized_shape has %zd dimensions, at most %d are supported",
                         n, LN_MAX_DIMS);
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
            if (!PyIndex_Check(item) || is_bool(item)) {
                PyErr_Format(PyExc_TypeError,
                             "normalized_shape must be an int or a sequence of ints, but found "
                             "element of type %.200s at pos %zd",
                             Py_TYPE(item)->tp_name, i);
                goto done;
            }
            Py_ssize_t d = PyNumber_AsSsize_t(item, PyExc_OverflowError);
            if (d == -1 && PyErr_Occurred()) {
                goto done;
            }
            shape->dims[i] = d;
        }
        shape->ndim = (int)n;
    }
    else {
        PyErr_Format(PyExc_TypeError, "normalized_shape must be an int or a sequence of ints, got %.200s",
                     Py_TYPE(obj)->tp_name);
        goto done;
    }
    for (int i = 0; i < shape->ndim; i++) {
        if (shape->dims[i] < 0) {
            list = dims_as_list(shape->dims, shape->ndim);
            if (list) {
                PyErr_Format(PyExc_ValueError,
                             "normalized_shape must not contain negative sizes, but got "
                             "normalized_shape = %R",
                             list);
            }
            goto done;
        }
    }
    if (shape->ndim == 0) {
        PyErr_SetString(PyExc_ValueError,
                        "Expected normalized_shape to be at least 1-dimensional, i.e., containing at "
                        "least one element, but got normalized_shape = []");
        goto done;
    }
    status = 0;
done:
    Py_XDECREF(seq);
    Py_XDECREF(list);
    return status;
}

/* Stores eps (default 1e-5) into *eps.  Returns 0, or -1 with an exception set. */
static int
parse_eps(PyObject *obj, double *eps)
{
    if (!obj) {
        *eps = 1e-5;
        return 0;
    }
    /* a complex eps would lose its imaginary part (NumPy's only warns), an array of one
       element would pass for a number */
    const int complex_number = PyComplex_Check(obj) || PyArray_IsScalar(obj, ComplexFloating) ||
                               (PyArray_Check(obj) && PyArray_ISCOMPLEX((PyArrayObject *)obj));
    const int not_0_d = PyArray_Check(obj) && PyArray_NDIM((PyArrayObject *)obj) != 0;
    if (complex_number || not_0_d || (!PyFloat_Check(obj) && !PyLong_Check(obj) && !PyNumber_Check(obj))) {
        PyErr_Format(PyExc_TypeError, "eps must be a real number, got %.200s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    *eps = PyFloat_AsDouble(obj);
    return *eps == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* The output_mask message for each mask length a kind has (1 + its parameters). */
static const char *const output_mask_message[] = {
    [2] = "output_mask must be a sequence of two bools",
    [3] = "output_mask must be a sequence of three bools",
};

/* Fills mask[0 .. n) from a sequence of n bools (all true when obj is NULL).
   Returns 0, or -1 with an exception set. */
static int
parse_output_mask(PyObject *obj, int n, int mask[])
{
    int status = -1;
    PyObject *seq = NULL;
    const char *message = output_mask_message[n];
    for (int i = 0; i < n; i++) {
        mask[i] = 1;
    }
    if (!obj) {
        return 0;
    }
    seq = PySequence_Fast(obj, message);
    if (!seq) {
        goto done;
    }
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_SetString(PyExc_ValueError, message);
        goto done;
    }
    for (int i = 0; i < n; i++) {
        /* bools and integers only: "False" or None taken by truth value would silently
           compute gradients the caller did not ask for */
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBool_Check(item) && !PyLong_Check(item) && !PyArray_IsScalar(item, Bool) &&
            !PyArray_IsScalar(item, Integer)) {
            PyErr_Format(PyExc_TypeError, "%s, got %R", message, obj);
            goto done;
        }
        mask[i] = PyObject_IsTrue(item);
        if (mask[i] < 0) {
            goto done;
        }
    }
    status = 0;
done:
    Py_XDECREF(seq);
    return status;
}

/* ------------------------------------------------------------------------ */
/* Helpers: arrays                                                           */
/* ------------------------------------------------------------------------ */

/* After a failed allocation in `fname` of `what`, a type_num array of shape dims[0 .. ndim):
   replaces a MemoryError (NumPy's says how big, not what for; a bare one says neither) with
   one that says both.  Other exceptions stay (NumPy's ValueError for a size no address space
   holds).  Returns -1. */
static int
allocation_failed(const char *fname, const char *what, int ndim, const npy_intp *dims, int type_num)
{
    if (!PyErr_ExceptionMatches(PyExc_MemoryError)) {
        return -1;
    }
    PyErr_Clear();
    PyArray_Descr *descr = PyArray_DescrFromType(type_num);
    PyObject *shape = dims_as_list(dims, ndim);
    npy_intp count, bytes;
    if (descr && shape) {
        if (checked_product(dims, ndim, &count) == 0 && checked_mul(count, PyDataType_ELSIZE(descr), &bytes) == 0) {
            PyErr_Format(PyExc_MemoryError, "%s: could not allocate %s, a %S array of shape %R: %zd bytes",
                         fname, what, (PyObject *)descr, shape, (Py_ssize_t)bytes);
        }
        else {
            PyErr_Format(PyExc_MemoryError, "%s: could not allocate %s, a %S array of shape %R", fname,
                         what, (PyObject *)descr, shape);
        }
    }
    Py_XDECREF(descr);
    Py_XDECREF(shape);
    return -1;
}

/* New reference: obj itself when it is an ndarray, else NumPy's conversion of it (as
   np.asarray), or NULL with an exception set. */
static PyArrayObject *
as_array(PyObject *obj)
{
    if (PyArray_Check(obj)) {
        Py_INCREF(obj);
        return (PyArrayObject *)obj;
    }
    return (PyArrayObject *)PyArray_FromAny(obj, NULL, 0, 0, 0, NULL);
}

/* Sets an exception of class `type` with `message` (stolen, may be NULL after a failure)
   and the attribute `attribute` = value, for the Python layer to word it.  Returns -1. */
static int
raise_with_attribute(PyObject *type, PyObject *message, const char *attribute, PyObject *value)
{
    PyObject *error = message ? PyObject_CallOneArg(type, message) : NULL;
    if (error && PyObject_SetAttrString(error, attribute, value) == 0) {
        PyErr_SetObject(type, error);
    }
    Py_XDECREF(message);
    Py_XDECREF(error);
    return -1;
}

/* The kernel dtype of a float16/32/64 array; -1 with UnsupportedDTypeError set otherwise
   (its `dtype` attribute is the array's dtype, for the Python layer to name it as torch does). */
static int
kernel_dtype(module_state *state, PyArrayObject *arr, const char *what)
{
    switch (PyArray_TYPE(arr)) {
    case NPY_HALF:
        return LN_F16;
    case NPY_FLOAT:
        return LN_F32;
    case NPY_DOUBLE:
        return LN_F64;
    }
    PyObject *descr = (PyObject *)PyArray_DESCR(arr);
    return raise_with_attribute(state->unsupported_dtype_error,
                                PyUnicode_FromFormat("%s takes float16, float32 or float64 arrays, "
                                                     "got dtype %S; convert it first, e.g. "
                                                     "x.astype(np.float32)",
                                                     what, descr),
                                "dtype", descr);
}

/* New reference: arr itself when it is C-contiguous, aligned and native of type type_num,
   else NumPy's conversion of it to such an array; NULL with an exception set. */
static PyArrayObject *
contiguous_of_type(PyArrayObject *arr, int type_num)
{
    if (PyArray_TYPE(arr) == type_num && PyArray_ISCARRAY_RO(arr)) {
        /* the common case, without NumPy's conversion call (a tenth of a small call's time) */
        Py_INCREF(arr);
        return arr;
    }
    return (PyArrayObject *)PyArray_FromArray(arr, PyArray_DescrFromType(type_num),
                                              NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
}

static const int param_type_num[] = {NPY_FLOAT, NPY_FLOAT, NPY_DOUBLE};
static const npy_intp param_size[] = {4, 4, 8};
static const int elem_type_num[] = {NPY_HALF, NPY_FLOAT, NPY_DOUBLE};

/* Checks that arr's trailing dims equal the normalized shape, then stores their product in
   ns->size: only an array's dims are known to multiply without overflow, not any sizes a
   caller writes.  Returns 0, or -1 with torch's ValueError text set. */
static int
check_trailing_shape(PyArrayObject *arr, shape_t *ns)
{
    const int ndim = PyArray_NDIM(arr);
    int ok = ndim >= ns->ndim;
    for (int i = 0; ok && i < ns->ndim; i++) {
        ok = PyArray_DIM(arr, ndim - ns->ndim + i) == ns->dims[i];
    }
    PyObject *ns_list = NULL, *size_list = NULL, *ns_text = NULL, *tail = NULL;
    if (ok) {
        if (checked_product(ns->dims, ns->ndim, &ns->size) == 0) {
            return 0;
        }
        ns_list = dims_as_list(ns->dims, ns->ndim);
        if (ns_list) {
            PyErr_Format(PyExc_ValueError, "normalized_shape = %R has more elements than an array can hold",
                         ns_list);
        }
        goto done;
    }
    ns_list = dims_as_list(ns->dims, ns->ndim);
    size_list = dims_as_list(PyArray_DIMS(arr), ndim);
    ns_text = ns_list ? PyObject_Repr(ns_list) : NULL;
    if (!size_list || !ns_text) {
        goto done;
    }
    /* "[*, 2, 2]" from "[2, 2]" */
    tail = PyUnicode_Substring(ns_text, 1, PyUnicode_GET_LENGTH(ns_text));
    if (tail) {
        PyErr_Format(PyExc_ValueError,
                     "Given normalized_shape=%R, expected input with shape [*, %U, but got input "
                     "of size%R",
                     ns_list, tail, size_list);
    }
done:
    Py_XDECREF(ns_list);
    Py_XDECREF(size_list);
    Py_XDECREF(ns_text);
    Py_XDECREF(tail);
    return -1;
}

/* Stores into *out a new reference to the parameter `obj` as a C-contiguous array of the
   param type, or NULL for None.  Returns 0, or -1 with an exception set. */
static int
param_array(const char *fname, PyObject *obj, const char *name, const shape_t *ns, int type_num,
            PyArrayObject **out)
{
    int status = -1;
    PyArrayObject *arr = NULL;
    PyObject *got = NULL, *want = NULL;
    *out = NULL;
    if (!obj || obj == Py_None) {
        return 0;
    }
    if (PyUnicode_Check(obj) || PyBytes_Check(obj) || PyByteArray_Check(obj)) {
        /* NumPy makes a 0-d text array of it: a shape error would hide the real mistake */
        PyErr_Format(PyExc_TypeError, "%s must be an array of floats or None, got %.200s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    arr = as_array(obj);
    if (!arr) {
        goto done;
    }
    int same_shape = PyArray_NDIM(arr) == ns->ndim;
    for (int i = 0; same_shape && i < ns->ndim; i++) {
        same_shape = PyArray_DIM(arr, i) == ns->dims[i];
    }
    if (!same_shape) {
        got = dims_as_list(PyArray_DIMS(arr), PyArray_NDIM(arr));
        want = got ? dims_as_list(ns->dims, ns->ndim) : NULL;
        if (want) {
            PyErr_Format(PyExc_ValueError,
                         "Expected %s to be of same shape as normalized_shape, but got %s of shape %R "
                         "and normalized_shape = %R",
                         name, name, got, want);
        }
        goto done;
    }
    if (PyArray_DESCR(arr)->kind != 'f') {
        PyErr_Format(PyExc_TypeError, "%s must have a floating-point dtype, got dtype %S", name,
                     (PyObject *)PyArray_DESCR(arr));
        goto done;
    }
    *out = contiguous_of_type(arr, type_num);
    status = *out ? 0 : allocation_failed(fname, name, ns->ndim, ns->dims, type_num);
done:
    Py_XDECREF(arr);
    Py_XDECREF(got);
    Py_XDECREF(want);
    return status;
}

/* 1 when the last `inner_ndim` dims of arr form one contiguous block and its leading dims
   collapse to a single stride, which it stores in *row_step (in elements); else 0. */
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
        if ((dims[k] != 1 && strides[k] != expected) || checked_mul(expected, dims[k], &expected) < 0) {
            return 0;
        }
    }
    *row_step = expected / itemsize;
    npy_intp next_stride = 0, next_dim = 0, collapsed;
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
        else if (checked_mul(next_stride, next_dim, &collapsed) < 0 || strides[k] != collapsed) {
            return 0;
        }
        next_stride = strides[k];
        next_dim = dims[k];
    }
    return 1;
}

/* New reference: arr itself when the kernel can read its rows in place (setting *row_step),
   else a C-contiguous native copy (row_step = row_len); NULL with an exception set. */
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

/* Stores the addresses [lo, hi) an array's elements span (lo == hi when empty).  Returns 0,
   or -1 when its strides reach past any address space (a view made with as_strided). */
static int
memory_extent(PyArrayObject *arr, uintptr_t *lo, uintptr_t *hi)
{
    npy_intp low = 0, high = PyArray_ITEMSIZE(arr), reach;  /* offsets from the first element */
    for (int k = 0; k < PyArray_NDIM(arr); k++) {
        const npy_intp dim = PyArray_DIM(arr, k);
        if (dim == 0) {
            high = low;
            break;
        }
        if (checked_mul(PyArray_STRIDE(arr, k), dim - 1, &reach) < 0 ||
            __builtin_add_overflow(reach > 0 ? high : low, reach, reach > 0 ? &high : &low)) {
            return -1;
        }
    }
    *lo = (uintptr_t)PyArray_BYTES(arr) + (uintptr_t)low;
    *hi = (uintptr_t)PyArray_BYTES(arr) + (uintptr_t)high;
    return 0;
}

/* 1 when the memory of a and b may overlap, else 0. */
static int
arrays_overlap(PyArrayObject *a, PyArrayObject *b)
{
    uintptr_t a_lo, a_hi, b_lo, b_hi;
    if (memory_extent(a, &a_lo, &a_hi) < 0 || memory_extent(b, &b_lo, &b_hi) < 0) {
        return 1;
    }
    return a_lo < a_hi && b_lo < b_hi && a_lo < b_hi && b_lo < a_hi;
}

/* Replaces *arr (owned, may be NULL) with a private copy when it overlaps out.
   Returns 0, or -1 with an exception set (then *arr is NULL). */
static int
detach_from_output(PyArrayObject **arr, PyArrayObject *out)
{
    if (!*arr || !arrays_overlap(*arr, out)) {
        return 0;
    }
    Py_SETREF(*arr, (PyArrayObject *)PyArray_NewCopy(*arr, NPY_CORDER));
    return *arr ? 0 : -1;
}

/* New reference: the caller's out= array after checking it can take a result shaped like
   `like` of type type_num; NULL with an exception set. */
static PyArrayObject *
check_out(PyObject *obj, PyArrayObject *like, int type_num)
{
    PyArrayObject *result = NULL;
    PyObject *got = NULL, *want = NULL;
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "out must be a numpy.ndarray, got %.200s", Py_TYPE(obj)->tp_name);
        goto done;
    }
    PyArrayObject *out = (PyArrayObject *)obj;
    if (PyArray_TYPE(out) != type_num || !PyArray_ISNOTSWAPPED(out)) {
        PyErr_Format(PyExc_TypeError, "out has dtype %S, but the result has dtype %S",
                     (PyObject *)PyArray_DESCR(out), (PyObject *)PyArray_DESCR(like));
        goto done;
    }
    if (!PyArray_SAMESHAPE(out, like)) {
        got = dims_as_list(PyArray_DIMS(out), PyArray_NDIM(out));
        want = got ? dims_as_list(PyArray_DIMS(like), PyArray_NDIM(like)) : NULL;
        if (want) {
            PyErr_Format(PyExc_ValueError, "out has shape %R, but the result has shape %R", got, want);
        }
        goto done;
    }
    if (!PyArray_IS_C_CONTIGUOUS(out) || !PyArray_ISALIGNED(out)) {
        PyErr_SetString(PyExc_ValueError, "out must be a C-contiguous, aligned array");
        goto done;
    }
    if (!PyArray_ISWRITEABLE(out)) {
        PyErr_SetString(PyExc_ValueError, "out is read-only");
        goto done;
    }
    Py_INCREF(out);
    result = out;
done:
    Py_XDECREF(got);
    Py_XDECREF(want);
    return result;
}

/* Stores the number of rows, the product of the dims before the normalized ones, into
   *rows.  Returns 0, or -1 with ValueError set when it overflows (NumPy makes no such array). */
static int
batch_size(PyArrayObject *arr, int ns_ndim, npy_intp *rows)
{
    if (checked_product(PyArray_DIMS(arr), PyArray_NDIM(arr) - ns_ndim, rows) < 0) {
        PyErr_SetString(PyExc_ValueError, "the input has more rows than an npy_intp can count");
        return -1;
    }
    return 0;
}

/* New reference: an uninitialised array of the input's batch dims + (1,) * ns_ndim for the
   statistic `name`, or NULL with an exception set. */
static PyArrayObject *
stats_array(const char *fname, const char *name, PyArrayObject *input, int ns_ndim, int type_num)
{
    npy_intp dims[LN_MAX_DIMS + LN_MAX_DIMS];
    const int ndim = PyArray_NDIM(input);
    for (int k = 0; k < ndim; k++) {
        dims[k] = k < ndim - ns_ndim ? PyArray_DIM(input, k) : 1;
    }
    PyArrayObject *stats = (PyArrayObject *)PyArray_SimpleNew(ndim, dims, type_num);
    if (!stats) {
        allocation_failed(fname, name, ndim, dims, type_num);
    }
    return stats;
}

/* New reference: input's data in an array nobody else holds (for backward to read after the
   caller may have changed its own), C-contiguous and native: `rows` itself when it is a copy
   made here, else a new copy; NULL with an exception set. */
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

/* ------------------------------------------------------------------------ */
/* Norm kinds: the forward and backward they share                           */
/* ------------------------------------------------------------------------ */

/* What the binding needs to know about one kind of normalization.  Its parameters are the
   first n_params of (weight, bias); its statistics are the last n_stats of (mean, rstd): a
   kind with centred statistics returns both, an uncentred one (RMSNorm) rstd alone. */
typedef struct {
    const char *module_name;    /* the module class, named in its dtype refusals */
    const char *stats_source;   /* the function whose statistics backward takes */
    int n_params;               /* 2: weight and bias; 1: weight */
    int n_stats;                /* 2: mean and rstd; 1: rstd */
} norm_kind;

static const char *const param_names[] = {"weight", "bias"};
static const char *const grad_param_names[] = {"grad_weight", "grad_bias"};
static const char *const stat_names[] = {"mean", "rstd"};

static const norm_kind layer_norm_kind = {
    .module_name = "LayerNorm",
    .stats_source = "native_layer_norm",
    .n_params = 2,
    .n_stats = 2,
};

/* What forward() returns besides the output. */
typedef enum {
    RETURN_OUTPUT,          /* output */
    RETURN_STATS,           /* (output, *stats) */
    RETURN_SAVED_FOR_GRAD,  /* (output, (input, saved)): input a private C-contiguous array,
                               saved the bytes of saved_layout */
} forward_returns;

/* The bytes training_forward saves for saved_backward, all of the param type: each statistic
   of every row in turn, then each parameter given (as the kernel read it), so that backward
   can tell a parameter changed since from one it may use. */
typedef struct {
    npy_intp stat_bytes;   /* one statistic of every row */
    npy_intp param_bytes;  /* one parameter */
    npy_intp total;
} saved_layout;

/* Fills *layout for `rows` rows of row_len elements and n_given parameters.  Returns 0, or
   -1 when the size overflows. */
static int
saved_layout_of(const norm_kind *kind, int dtype, npy_intp rows, npy_intp row_len, int n_given,
                saved_layout *layout)
{
    npy_intp stats_total, params_total;
    if (checked_mul(rows, param_size[dtype], &layout->stat_bytes) < 0 ||
        checked_mul(row_len, param_size[dtype], &layout->param_bytes) < 0 ||
        checked_mul(kind->n_stats, layout->stat_bytes, &stats_total) < 0 ||
        checked_mul(n_given, layout->param_bytes, &params_total) < 0) {
        return -1;
    }
    return __builtin_add_overflow(stats_total, params_total, &layout->total) ? -1 : 0;
}

/* The number of the kind's parameters given (not NULL). */
static int
count_given(const norm_kind *kind, PyArrayObject *const params[])
{
    int given = 0;
    for (int p = 0; p < kind->n_params; p++) {
        given += params[p] != NULL;
    }
    return given;
}

/* New reference: what `returns` says, or NULL with an exception set.  param_objs holds the
   kind's n_params parameters (NULL or None where absent); `what` names the caller in the
   dtype refusal. */
static PyObject *
forward(module_state *state, const norm_kind *kind, const char *what, PyObject *input_obj,
        PyObject *ns_obj, PyObject *const param_objs[], PyObject *eps_obj, PyObject *out_obj,
        forward_returns returns)
{
    PyObject *result = NULL, *saved_stats = NULL, *saved = NULL;
    PyArrayObject *input = NULL, *rows = NULL, *output = NULL, *saved_input = NULL;
    PyArrayObject *params[2] = {NULL, NULL}, *stats[2] = {NULL, NULL};
    char *stats_data[2] = {NULL, NULL};  /* where the kernel writes each statistic */
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
    const int dtype = kernel_dtype(state, input, what);
    if (dtype < 0) {
        goto done;
    }
    for (int p = 0; p < kind->n_params; p++) {
        if (param_array(what, param_objs[p], param_names[p], &ns, param_type_num[dtype], &params[p]) < 0) {
            goto done;
        }
    }
    npy_intp batch;
    if (check_trailing_shape(input, &ns) < 0 || batch_size(input, ns.ndim, &batch) < 0) {
        goto done;
    }
    /* The results first, then any copies of the arguments: a call that cannot have its
       results fails before it has spent memory on copies. */
    const int given_out = out_obj && out_obj != Py_None;
    output = given_out ? check_out(out_obj, input, elem_type_num[dtype])
                       : (PyArrayObject *)PyArray_SimpleNew(PyArray_NDIM(input), PyArray_DIMS(input),
                                                            elem_type_num[dtype]);
    if (!output) {
        if (!given_out) {
            allocation_failed(what, "the output", PyArray_NDIM(input), PyArray_DIMS(input),
                              elem_type_num[dtype]);
        }
        goto done;
    }
    const int first_stat = 2 - kind->n_stats;  /* index into (mean, rstd) */
    if (returns == RETURN_STATS) {
        for (int s = first_stat; s < 2; s++) {
            stats[s] = stats_array(what, stat_names[s], input, ns.ndim, param_type_num[dtype]);
            if (!stats[s]) {
                goto done;
            }
            stats_data[s] = PyArray_DATA(stats[s]);
        }
    }
    saved_layout layout = {0};
    if (returns == RETURN_SAVED_FOR_GRAD) {
        /* One bytes object instead of arrays: a third of a small training-mode call went
           into making the statistics' arrays, which only saved_backward reads. */
        const int n_given = count_given(kind, params);
        if (saved_layout_of(kind, dtype, batch, ns.size, n_given, &layout) < 0) {
            PyErr_Format(PyExc_MemoryError,
                         "%s: cannot allocate the values saved for backward, %d statistics of %zd "
                         "rows and %d parameters of %zd elements, %zd bytes each: more than an "
                         "address space holds",
                         what, kind->n_stats, (Py_ssize_t)batch, n_given, (Py_ssize_t)ns.size,
                         (Py_ssize_t)param_size[dtype]);
            goto done;
        }
        saved_stats = PyBytes_FromStringAndSize(NULL, layout.total);
        if (!saved_stats) {
            if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_MemoryError, "%s: could not allocate the values saved for backward: %zd bytes",
                             what, (Py_ssize_t)layout.total);
            }
            goto done;
        }
        for (int s = first_stat; s < 2; s++) {
            stats_data[s] = PyBytes_AS_STRING(saved_stats) + (s - first_stat) * layout.stat_bytes;
        }
    }
    rows = readable_rows(input, ns.ndim, ns.size, &row_step);
    if (!rows) {
        allocation_failed(what, "a C-contiguous copy of the input", PyArray_NDIM(input), PyArray_DIMS(input),
                          PyArray_TYPE(input));
        goto done;
    }
    if (given_out) {
        /* Writing over the rows being read is safe only row onto the same row. */
        const int in_place = PyArray_DATA(rows) == PyArray_DATA(output) && row_step == ns.size;
        PyArrayObject *rows_before = rows;
        if (!in_place && detach_from_output(&rows, output) < 0) {
            allocation_failed(what, "a copy of the input, which out overlaps", PyArray_NDIM(input),
                              PyArray_DIMS(input), PyArray_TYPE(input));
            goto done;
        }
        for (int p = 0; p < kind->n_params; p++) {
            if (detach_from_output(&params[p], output) < 0) {
                allocation_failed(what, param_names[p], ns.ndim, ns.dims, param_type_num[dtype]);
                goto done;
            }
        }
        if (rows != rows_before) {
            row_step = ns.size;  /* now a C-contiguous copy */
        }
    }
    if (returns == RETURN_SAVED_FOR_GRAD) {
        saved_input = private_input(input, rows);
        if (!saved_input) {
            allocation_failed(what, "the copy of the input saved for backward", PyArray_NDIM(input),
                              PyArray_DIMS(input), PyArray_TYPE(input));
            goto done;
        }
        char *saved_param = PyBytes_AS_STRING(saved_stats) + kind->n_stats * layout.stat_bytes;
        for (int p = 0; p < kind->n_params; p++) {
            if (params[p]) {
                memcpy(saved_param, PyArray_DATA(params[p]), (size_t)layout.param_bytes);
                saved_param += layout.param_bytes;
            }
        }
    }

    const ln_forward_args args = {
        .dtype = (ln_dtype)dtype,
        .rows = batch,
        .row_len = ns.size,
        .input = PyArray_DATA(rows),
        .input_row_step = row_step,
        .output = PyArray_DATA(output),
        .weight = params[0] ? PyArray_DATA(params[0]) : NULL,
        .bias = params[1] ? PyArray_DATA(params[1]) : NULL,
        .eps = eps,
        .mean = stats_data[0],
        .rstd = stats_data[1],
    };
    /* Nothing to write, nothing to compute: the kernel would still walk every empty row. */
    const int produces = PyArray_SIZE(output) > 0 || (returns != RETURN_OUTPUT && batch > 0);
    int status = 0;
    if (produces) {
        Py_BEGIN_ALLOW_THREADS
        status = ln_forward(&args);
        Py_END_ALLOW_THREADS
    }
    if (status < 0) {
        PyErr_Format(PyExc_MemoryError, "%s: the kernel could not allocate its scratch memory for %zd "
                     "rows of %zd elements",
                     what, (Py_ssize_t)batch, (Py_ssize_t)ns.size);
        goto done;
    }
    switch (returns) {
    case RETURN_OUTPUT:
        Py_INCREF(output);
        result = (PyObject *)output;
        break;
    case RETURN_STATS:
        result = PyTuple_New(1 + kind->n_stats);
        if (result) {
            Py_INCREF(output);
            PyTuple_SET_ITEM(result, 0, (PyObject *)output);
            for (int s = first_stat; s < 2; s++) {
                Py_INCREF(stats[s]);
                PyTuple_SET_ITEM(result, 1 + s - first_stat, (PyObject *)stats[s]);
            }
        }
        break;
    case RETURN_SAVED_FOR_GRAD:
        saved = PyTuple_Pack(2, (PyObject *)saved_input, saved_stats);
        result = saved ? PyTuple_Pack(2, (PyObject *)output, saved) : NULL;
        break;
    }
done:
    Py_XDECREF(input);
    Py_XDECREF(rows);
    Py_XDECREF(output);
    Py_XDECREF(saved_input);
    Py_XDECREF(saved_stats);
    Py_XDECREF(saved);
    for (int i = 0; i < 2; i++) {
        Py_XDECREF(params[i]);
        Py_XDECREF(stats[i]);
    }
    return result;
}

/* New reference: a statistic (mean or rstd) handed to backward as an array, checked to hold
   one float per row (still to be made contiguous params); NULL with an exception set. */
static PyArrayObject *
stats_input(PyObject *obj, const norm_kind *kind, const char *name, npy_intp rows)
{
    PyArrayObject *result = NULL, *arr = NULL;
    arr = as_array(obj);
    if (!arr) {
        goto done;
    }
    if (PyArray_DESCR(arr)->kind != 'f') {
        PyErr_Format(PyExc_TypeError, "%s must be a float array, as %s returns it; got %R of dtype %S",
                     name, kind->stats_source, obj == Py_None ? Py_None : (PyObject *)Py_TYPE(obj),
                     (PyObject *)PyArray_DESCR(arr));
        goto done;
    }
    if (PyArray_SIZE(arr) != rows) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be a float array with one value per normalized row (%zd), as "
                     "%s returns it; got dtype %S and %zd values",
                     name, (Py_ssize_t)rows, kind->stats_source, (PyObject *)PyArray_DESCR(arr),
                     (Py_ssize_t)PyArray_SIZE(arr));
        goto done;
    }
    Py_INCREF(arr);
    result = arr;
done:
    Py_XDECREF(arr);
    return result;
}

/* New reference: (grad_input, *grad_params), or NULL with an exception set.  The kind's
   statistics come either as the objects in stat_objs or, with stat_objs NULL, as the bytes
   that training_forward saved; param_objs holds its parameters, mask its 1 + n_params
   output_mask entries. */
static PyObject *
backward(module_state *state, const norm_kind *kind, const char *what, PyObject *grad_output_obj,
         PyObject *input_obj, const shape_t *ns_arg, PyObject *const stat_objs[],
         PyObject *saved_stats, PyObject *const param_objs[], const int mask[])
{
    PyObject *result = NULL, *got = NULL, *want = NULL;
    PyArrayObject *input = NULL, *grad_out = NULL, *input_rows = NULL, *grad_rows = NULL;
    PyArrayObject *grad_input = NULL;
    PyArrayObject *params[2] = {NULL, NULL}, *stats[2] = {NULL, NULL}, *grad_params[2] = {NULL, NULL};
    const char *stats_data[2] = {NULL, NULL};
    shape_t ns = *ns_arg;
    npy_intp input_step, grad_step;

    input = as_array(input_obj);
    if (!input) {
        goto done;
    }
    const int dtype = kernel_dtype(state, input, what);
    if (dtype < 0) {
        goto done;
    }
    for (int p = 0; p < kind->n_params; p++) {
        if (param_array(what, param_objs[p], param_names[p], &ns, param_type_num[dtype], &params[p]) < 0) {
            goto done;
        }
    }
    if (check_trailing_shape(input, &ns) < 0) {
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
        got = dims_as_list(PyArray_DIMS(grad_out), PyArray_NDIM(grad_out));
        want = got ? dims_as_list(PyArray_DIMS(input), PyArray_NDIM(input)) : NULL;
        if (want) {
            PyErr_Format(PyExc_ValueError, "grad_output of shape %R does not match input of size%R",
                         got, want);
        }
        goto done;
    }
    npy_intp rows;
    if (batch_size(input, ns.ndim, &rows) < 0) {
        goto done;
    }
    const int first_stat = 2 - kind->n_stats;  /* index into (mean, rstd) */
    if (stat_objs) {
        for (int s = first_stat; s < 2; s++) {
            stats[s] = stats_input(stat_objs[s - first_stat], kind, stat_names[s], rows);
            if (!stats[s]) {
                goto done;
            }
        }
    }
    else {
        saved_layout layout;
        if (!PyBytes_Check(saved_stats) ||
            saved_layout_of(kind, dtype, rows, ns.size, count_given(kind, params), &layout) < 0 ||
            PyBytes_GET_SIZE(saved_stats) != layout.total) {
            PyErr_SetString(PyExc_ValueError,
                            "stats must be the bytes that training_forward returned with this input "
                            "and these parameters");
            goto done;
        }
        for (int s = first_stat; s < 2; s++) {
            stats_data[s] = PyBytes_AS_STRING(saved_stats) + (s - first_stat) * layout.stat_bytes;
        }
        const char *saved_param = PyBytes_AS_STRING(saved_stats) + kind->n_stats * layout.stat_bytes;
        for (int p = 0; p < kind->n_params; p++) {
            if (!params[p]) {
                continue;
            }
            if (memcmp(PyArray_DATA(params[p]), saved_param, (size_t)layout.param_bytes) != 0) {
                PyObject *name = PyUnicode_FromString(param_names[p]);
                if (name) {
                    raise_with_attribute(state->parameter_changed_error,
                                         PyUnicode_FromFormat("%s differs from the %s training_forward "
                                                              "saved",
                                                              param_names[p], param_names[p]),
                                         "name", name);
                    Py_DECREF(name);
                }
                goto done;
            }
            saved_param += layout.param_bytes;
        }
    }
    /* The results first, then any copies of the arguments: a call that cannot have its
       results fails before it has spent memory on copies (broadcast statistics of 2**30
       rows were 8 GiB of copies before grad_input's MemoryError). */
    if (mask[0]) {
        grad_input = (PyArrayObject *)PyArray_SimpleNew(PyArray_NDIM(input), PyArray_DIMS(input),
                                                        elem_type_num[dtype]);
        if (!grad_input) {
            allocation_failed(what, "grad_input", PyArray_NDIM(input), PyArray_DIMS(input), elem_type_num[dtype]);
            goto done;
        }
    }
    for (int p = 0; p < kind->n_params; p++) {
        if (mask[1 + p] && params[p]) {
            grad_params[p] = (PyArrayObject *)PyArray_SimpleNew(ns.ndim, ns.dims, param_type_num[dtype]);
            if (!grad_params[p]) {
                allocation_failed(what, grad_param_names[p], ns.ndim, ns.dims, param_type_num[dtype]);
                goto done;
            }
        }
    }
    /* Nothing to write, nothing to compute: the kernel would still walk every empty row,
       and the arguments need no copies for it. */
    const int produces = (grad_input && PyArray_SIZE(grad_input) > 0) ||
                         ((grad_params[0] || grad_params[1]) && ns.size > 0);
    int status = 0;
    if (produces) {
        for (int s = first_stat; stat_objs && s < 2; s++) {
            Py_SETREF(stats[s], contiguous_of_type(stats[s], param_type_num[dtype]));
            if (!stats[s]) {
                allocation_failed(what, stat_names[s], 1, &rows, param_type_num[dtype]);
                goto done;
            }
            stats_data[s] = PyArray_DATA(stats[s]);
        }
        if (PyArray_TYPE(grad_out) != PyArray_TYPE(input)) {
            Py_SETREF(grad_out, (PyArrayObject *)PyArray_FromArray(
                                    grad_out, PyArray_DescrFromType(PyArray_TYPE(input)),
                                    NPY_ARRAY_CARRAY_RO | NPY_ARRAY_FORCECAST));
            if (!grad_out) {
                allocation_failed(what, "grad_output in the input's dtype", PyArray_NDIM(input),
                                  PyArray_DIMS(input), PyArray_TYPE(input));
                goto done;
            }
        }
        input_rows = readable_rows(input, ns.ndim, ns.size, &input_step);
        if (!input_rows) {
            allocation_failed(what, "a C-contiguous copy of the input", PyArray_NDIM(input),
                              PyArray_DIMS(input), PyArray_TYPE(input));
            goto done;
        }
        grad_rows = readable_rows(grad_out, ns.ndim, ns.size, &grad_step);
        if (!grad_rows) {
            allocation_failed(what, "a C-contiguous copy of grad_output", PyArray_NDIM(input),
                              PyArray_DIMS(input), PyArray_TYPE(input));
            goto done;
        }
        const ln_backward_args args = {
            .dtype = (ln_dtype)dtype,
            .rows = rows,
            .row_len = ns.size,
            .grad_output = PyArray_DATA(grad_rows),
            .grad_output_row_step = grad_step,
            .input = PyArray_DATA(input_rows),
            .input_row_step = input_step,
            .mean = stats_data[0],
            .rstd = stats_data[1],
            .weight = params[0] ? PyArray_DATA(params[0]) : NULL,
            .grad_input = grad_input ? PyArray_DATA(grad_input) : NULL,
            .grad_weight = grad_params[0] ? PyArray_DATA(grad_params[0]) : NULL,
            .grad_bias = grad_params[1] ? PyArray_DATA(grad_params[1]) : NULL,
        };
        Py_BEGIN_ALLOW_THREADS
        status = ln_backward(&args);
        Py_END_ALLOW_THREADS
    }
    if (status < 0) {
        PyErr_Format(PyExc_MemoryError, "%s: the kernel could not allocate its scratch memory for %zd "
                     "rows of %zd elements",
                     what, (Py_ssize_t)rows, (Py_ssize_t)ns.size);
        goto done;
    }
    result = PyTuple_New(1 + kind->n_params);
    if (!result) {
        goto done;
    }
    for (int i = 0; i <= kind->n_params; i++) {
        PyObject *item = i == 0 ? (PyObject *)grad_input : (PyObject *)grad_params[i - 1];
        item = item ? item : Py_None;
        Py_INCREF(item);
        PyTuple_SET_ITEM(result, i, item);
    }
done:
    Py_XDECREF(got);
    Py_XDECREF(want);
    Py_XDECREF(input);
    Py_XDECREF(grad_out);
    Py_XDECREF(input_rows);
    Py_XDECREF(grad_rows);
    Py_XDECREF(grad_input);
    for (int i = 0; i < 2; i++) {
        Py_XDECREF(params[i]);
        Py_XDECREF(stats[i]);
        Py_XDECREF(grad_params[i]);
    }
    return result;
}

/* ------------------------------------------------------------------------ */
/* Python-facing functions: LayerNorm                                        */
/* ------------------------------------------------------------------------ */

/* Each function takes its parameters as consecutive arguments (weight, bias), so &values[..]
   is the param_objs array forward() and backward() want. */

PyDoc_STRVAR(layer_norm_doc,
"layer_norm($module, input, normalized_shape, weight=None, bias=None, eps=1e-05, *, out=None)\n"
"--\n"
"\n"
"Layer normalization over the last len(normalized_shape) dimensions, as\n"
"torch.nn.functional.layer_norm (the core of layernorm.layer_norm).\n"
"\n"
"Returns\n"
"-------\n"
"ndarray\n"
"    (input - mean) / sqrt(var + eps) * weight + bias, of the input's dtype, written\n"
"    into out when given.\n");

static PyObject *
layer_norm(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { INPUT, NORMALIZED_SHAPE, WEIGHT, BIAS, EPS, OUT, N };
    static const keyword_id keywords[N] = {KW_INPUT, KW_NORMALIZED_SHAPE, KW_WEIGHT, KW_BIAS, KW_EPS, KW_OUT};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "layer_norm", args, nargs, kwnames, keywords, N, EPS + 1, 2, v) < 0) {
        return NULL;
    }
    return forward(state, &layer_norm_kind, "layer_norm", v[INPUT], v[NORMALIZED_SHAPE], &v[WEIGHT],
                   v[EPS], v[OUT], RETURN_OUTPUT);
}

PyDoc_STRVAR(native_layer_norm_doc,
"native_layer_norm($module, input, normalized_shape, weight=None, bias=None, eps=1e-05)\n"
"--\n"
"\n"
"Layer normalization that also returns its statistics, as torch.native_layer_norm\n"
"(the core of layernorm.native_layer_norm).\n"
"\n"
"Returns\n"
"-------\n"
"(output, mean, rstd)\n"
"    mean and rstd have shape input.shape[:-D] + (1,) * D, D = len(normalized_shape),\n"
"    and dtype float32 (float64 for float64 input).\n");

static PyObject *
native_layer_norm(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { INPUT, NORMALIZED_SHAPE, WEIGHT, BIAS, EPS, N };
    static const keyword_id keywords[N] = {KW_INPUT, KW_NORMALIZED_SHAPE, KW_WEIGHT, KW_BIAS, KW_EPS};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "native_layer_norm", args, nargs, kwnames, keywords, N, N, 2, v) < 0) {
        return NULL;
    }
    return forward(state, &layer_norm_kind, "native_layer_norm", v[INPUT], v[NORMALIZED_SHAPE],
                   &v[WEIGHT], v[EPS], NULL, RETURN_STATS);
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
"the rstd of every row, then the weight and the bias as the kernel read them.  Used by\n"
"LayerNorm in training mode.\n");

static PyObject *
training_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { INPUT, NORMALIZED_SHAPE, WEIGHT, BIAS, EPS, N };
    static const keyword_id keywords[N] = {KW_INPUT, KW_NORMALIZED_SHAPE, KW_WEIGHT, KW_BIAS, KW_EPS};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "training_forward", args, nargs, kwnames, keywords, N, N, 2, v) < 0) {
        return NULL;
    }
    return forward(state, &layer_norm_kind, layer_norm_kind.module_name, v[INPUT],
                   v[NORMALIZED_SHAPE], &v[WEIGHT], v[EPS], NULL, RETURN_SAVED_FOR_GRAD);
}

PyDoc_STRVAR(layer_norm_backward_doc,
"layer_norm_backward($module, grad_output, input, normalized_shape, mean, rstd, weight=None,\n"
"                    bias=None, output_mask=(True, True, True))\n"
"--\n"
"\n"
"Gradients of layer_norm, as torch.ops.aten.native_layer_norm_backward (the core of\n"
"layernorm.layer_norm_backward).\n"
"\n"
"Returns\n"
"-------\n"
"(grad_input, grad_weight, grad_bias)\n"
"    Each is None where its output_mask entry is False or its parameter is None.\n");

static PyObject *
layer_norm_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { GRAD_OUTPUT, INPUT, NORMALIZED_SHAPE, MEAN, RSTD, WEIGHT, BIAS, OUTPUT_MASK, N };
    static const keyword_id keywords[N] = {KW_GRAD_OUTPUT, KW_INPUT, KW_NORMALIZED_SHAPE, KW_MEAN,
                                           KW_RSTD, KW_WEIGHT, KW_BIAS, KW_OUTPUT_MASK};
    module_state *state = get_state(module);
    PyObject *v[N];
    shape_t ns;
    int mask[3];
    if (parse_args(state, "layer_norm_backward", args, nargs, kwnames, keywords, N, N, RSTD + 1, v) < 0 ||
        parse_normalized_shape(v[NORMALIZED_SHAPE], &ns) < 0 ||
        parse_output_mask(v[OUTPUT_MASK], 1 + layer_norm_kind.n_params, mask) < 0) {
        return NULL;
    }
    return backward(state, &layer_norm_kind, "layer_norm_backward", v[GRAD_OUTPUT], v[INPUT], &ns,
                    &v[MEAN], NULL, &v[WEIGHT], mask);
}

PyDoc_STRVAR(saved_backward_doc,
"saved_backward($module, grad_output, input, stats, normalized_shape, weight=None, bias=None,\n"
"               output_mask=(True, True, True))\n"
"--\n"
"\n"
"layer_norm_backward from what training_forward saved: (input, stats), stats its bytes.\n"
"weight and bias must be given as they were to training_forward: a parameter whose values\n"
"differ from the saved ones raises ParameterChangedError.  Used by LayerNorm.backward.\n");

static PyObject *
saved_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { GRAD_OUTPUT, INPUT, STATS, NORMALIZED_SHAPE, WEIGHT, BIAS, OUTPUT_MASK, N };
    static const keyword_id keywords[N] = {KW_GRAD_OUTPUT, KW_INPUT, KW_STATS, KW_NORMALIZED_SHAPE,
                                           KW_WEIGHT, KW_BIAS, KW_OUTPUT_MASK};
    module_state *state = get_state(module);
    PyObject *v[N];
    shape_t ns;
    int mask[3];
    if (parse_args(state, "saved_backward", args, nargs, kwnames, keywords, N, N,
                   NORMALIZED_SHAPE + 1, v) < 0 ||
        parse_normalized_shape(v[NORMALIZED_SHAPE], &ns) < 0 ||
        parse_output_mask(v[OUTPUT_MASK], 1 + layer_norm_kind.n_params, mask) < 0) {
        return NULL;
    }
    return backward(state, &layer_norm_kind, layer_norm_kind.module_name, v[GRAD_OUTPUT], v[INPUT],
                    &ns, NULL, v[STATS], &v[WEIGHT], mask);
}

/* ------------------------------------------------------------------------ */
/* Python-facing functions: threads and SIMD level                           */
/* ------------------------------------------------------------------------ */

/* The most threads the kernel layer runs (its thread pool's cap, LN_MAX_THREADS). */
#define MAX_THREADS 256

/* n >= 1 threads asked for, as the count the kernels run: at most MAX_THREADS. */
static int
threads_allowed(Py_ssize_t n)
{
    return n > MAX_THREADS ? MAX_THREADS : (int)n;
}

PyDoc_STRVAR(set_num_threads_doc,
"set_num_threads($module, n, /)\n--\n\n"
"Use at most n threads (n >= 1) per call.  Results do not depend on n.\n"
"\n"
"n above the number of CPUs is used as it is: a call large enough to be split n ways\n"
"starts n - 1 worker threads, which take turns on the CPUs, so it runs slower, not\n"
"faster.  Workers, once started, stay for the life of the process, asleep while unused;\n"
"a call wakes only those it uses.\n"
"\n"
"n above 256, the most threads the kernels run, counts as 256 (get_num_threads() then\n"
"returns 256).  Like torch.set_num_threads, any positive int is taken: code that asks\n"
"for os.cpu_count() threads runs on a machine of any size, and the kernels, bound by\n"
"memory, gain nothing from more threads.");

static PyObject *
set_num_threads(PyObject *module, PyObject *arg)
{
    if (!PyIndex_Check(arg) || PyBool_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "set_num_threads() takes an int, got %.200s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    /* clipped to the Py_ssize_t range: 10**30 threads are as many as the kernels run */
    Py_ssize_t n = PyNumber_AsSsize_t(arg, NULL);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n < 1) {
        PyErr_Format(PyExc_ValueError, "set_num_threads() needs n >= 1, got %R", arg);
        return NULL;
    }
    ln_threads_set(threads_allowed(n));
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

/* The level called name[0 .. length) (which may hold NULs), or -1 when there is none. */
static int
simd_level_from_name(const char *name, size_t length)
{
    for (int level = 0; level < LN_SIMD_LEVELS; level++) {
        const char *known = ln_simd_name((ln_simd_level)level);  /* NULL: not in this build */
        if (known && strlen(known) == length && memcmp(name, known, length) == 0) {
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
    Py_ssize_t length;
    const char *name = PyUnicode_AsUTF8AndSize(arg, &length);
    if (!name) {
        return NULL;
    }
    int level = simd_level_from_name(name, (size_t)length);
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
    {"native_layer_norm", (PyCFunction)(void (*)(void))native_layer_norm, METH_FASTCALL | METH_KEYWORDS,
     native_layer_norm_doc},
    {"training_forward", (PyCFunction)(void (*)(void))training_forward, METH_FASTCALL | METH_KEYWORDS,
     training_forward_doc},
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

/* Stores into *start and *length the value of the environment variable `name` without the
   whitespace around it (" 4" and "4 " are both 4).  Returns 0 when it is unset or blank (then
   the default holds), else 1. */
static int
environment_value(const char *name, const char **start, size_t *length)
{
    const char *value = getenv(name);
    if (!value) {
        return 0;
    }
    while (isspace((unsigned char)*value)) {
        value++;
    }
    size_t n = strlen(value);
    while (n > 0 && isspace((unsigned char)value[n - 1])) {
        n--;
    }
    *start = value;
    *length = n;
    return n > 0;
}

/* Applies LAYERNORM_NUM_THREADS and LAYERNORM_SIMD.  Returns 0, or -1 with ValueError set. */
static int
apply_environment(void)
{
    const char *value;
    size_t length;
    if (environment_value("LAYERNORM_NUM_THREADS", &value, &length)) {
        char *end;
        long n = strtol(value, &end, 10);
        if (end != value + length || n < 1) {
            PyErr_Format(PyExc_ValueError, "LAYERNORM_NUM_THREADS must be an integer >= 1, got '%s'",
                         getenv("LAYERNORM_NUM_THREADS"));
            return -1;
        }
        /* beyond LONG_MAX strtol gives LONG_MAX: as many threads as the kernels run */
        ln_threads_set(threads_allowed(n));
    }
    if (environment_value("LAYERNORM_SIMD", &value, &length)) {
        int level = simd_level_from_name(value, length);
        if (level < 0) {
            PyErr_Format(PyExc_ValueError, "LAYERNORM_SIMD must name a SIMD level of this build, got '%s'",
                         getenv("LAYERNORM_SIMD"));
            return -1;
        }
        /* a level above what the CPU runs falls back to the best it does run */
        if (ln_simd_set((ln_simd_level)level) < 0) {
            ln_simd_set(ln_simd_best());
        }
    }
    return 0;
}

PyDoc_STRVAR(unsupported_dtype_error_doc,
"An input dtype the kernels do not take; its `dtype` attribute is that dtype.");

PyDoc_STRVAR(parameter_changed_error_doc,
"A parameter given to saved_backward differs from the one training_forward saved;\n"
"its `name` attribute names it (\"weight\", \"bias\").");

/* Fills the module state and applies the environment.  Returns 0, or -1 with an exception
   set (the module's state is then released by module_clear). */
static int
layernorm_exec(PyObject *module)
{
    module_state *state = get_state(module);
    if (PyArray_ImportNumPyAPI() < 0) {
        return -1;
    }
    for (int k = 0; k < KW_COUNT; k++) {
        state->keywords[k] = PyUnicode_InternFromString(keyword_text[k]);
        if (!state->keywords[k]) {
            return -1;
        }
    }
    state->unsupported_dtype_error = PyErr_NewExceptionWithDoc(
        "layernorm._layernorm.UnsupportedDTypeError", unsupported_dtype_error_doc, PyExc_TypeError, NULL);
    if (!state->unsupported_dtype_error ||
        PyModule_AddObjectRef(module, "UnsupportedDTypeError", state->unsupported_dtype_error) < 0) {
        return -1;
    }
    state->parameter_changed_error = PyErr_NewExceptionWithDoc(
        "layernorm._layernorm.ParameterChangedError", parameter_changed_error_doc, PyExc_RuntimeError, NULL);
    if (!state->parameter_changed_error ||
        PyModule_AddObjectRef(module, "ParameterChangedError", state->parameter_changed_error) < 0) {
        return -1;
    }
    return apply_environment();
}

static PyModuleDef_Slot layernorm_slots[] = {
    {Py_mod_exec, layernorm_exec},
#if PY_VERSION_HEX >= 0x030C0000
    /* Every Python object this module holds is in its module state, and the kernel layer's
       process-wide state is plain C with its own locking: each interpreter may have its own. */
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_mod_gil
    /* The module state is read-only once exec has run, and the kernel layer locks its own
       state: nothing here relies on the GIL. */
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef layernorm_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "layernorm._layernorm",
    .m_doc = "LayerNorm kernels on NumPy arrays (the compiled core of the layernorm package).",
    .m_size = sizeof(module_state),
    .m_methods = layernorm_methods,
    .m_slots = layernorm_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__layernorm(void)
{
    return PyModuleDef_Init(&layernorm_module);
}
