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
#include <float.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ln_kernels.h"
#include "ln_tuning.h"

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
    KW_AXIS,
    KW_RESIDUAL,
    KW_RESIDUAL_OUT,
    KW_G_MEAN,
    KW_G_XHAT_MEAN,
    KW_G_LARGEST,
    KW_DY_LARGEST,
    KW_XC_LARGEST,
    KW_SCALE,
    KW_ROW_LEN,
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
    [KW_AXIS] = "axis",
    [KW_RESIDUAL] = "residual",
    [KW_RESIDUAL_OUT] = "residual_out",
    [KW_G_MEAN] = "g_mean",
    [KW_G_XHAT_MEAN] = "g_xhat_mean",
    [KW_G_LARGEST] = "g_largest",
    [KW_DY_LARGEST] = "dy_largest",
    [KW_XC_LARGEST] = "xc_largest",
    [KW_SCALE] = "scale",
    [KW_ROW_LEN] = "row_len",
};

/* Every Python object the module holds.  There are no others: the kernel layer's state (thread
   pool, SIMD level, scratch buffer) is process-wide C state with its own locking. */
typedef struct {
    PyObject *unsupported_dtype_error;  /* UnsupportedDTypeError, a TypeError subclass */
    PyObject *parameter_changed_error;  /* ParameterChangedError, a RuntimeError subclass */
    PyObject *axis_error;               /* NumPy's AxisError, raised as NumPy raises it */
    PyObject *shares_memory;            /* np.shares_memory, NumPy's exact overlap test */
    PyObject *too_hard_error;           /* NumPy's TooHardError, when that test gives up */
    PyObject *keywords[KW_COUNT];       /* interned keyword names */
    PyObject *result_memory;            /* NumPy memory handler (a capsule) over ln_buffers.c */
    int bfloat16_type_num;              /* ml_dtypes' bfloat16 once an array of it is seen, else -1 */
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
    Py_VISIT(state->axis_error);
    Py_VISIT(state->shares_memory);
    Py_VISIT(state->too_hard_error);
    Py_VISIT(state->result_memory);
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
    Py_CLEAR(state->axis_error);
    Py_CLEAR(state->shares_memory);
    Py_CLEAR(state->too_hard_error);
    Py_CLEAR(state->result_memory);
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

/* Whether an optional argument was given a value: not left out (NULL) and not None. */
static inline int
is_given(PyObject *obj)
{
    return obj && obj != Py_None;
}

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

/* New reference: obj's items as a tuple that holds its own references, or NULL with a
   TypeError(message) set where obj is not iterable.  PySequence_Fast hands a list back as it
   is, and an item's __index__ or __bool__ that empties the list would leave its items
   freed under the loop reading them. */
static PyObject *
items_of(PyObject *obj, const char *message)
{
    PyObject *seq = PySequence_Fast(obj, message);
    if (!seq) {
        return NULL;
    }
    PyObject *items = PySequence_Tuple(seq);
    Py_DECREF(seq);
    return items;
}

/* 1 when obj is a bool of Python or NumPy (which are ints to PyIndex_Check), else 0. */
static int
is_bool(PyObject *obj)
{
    return PyBool_Check(obj) || PyArray_IsScalar(obj, Bool) ||
           (PyArray_Check(obj) && PyArray_NDIM((PyArrayObject *)obj) == 0 &&
            PyArray_TYPE((PyArrayObject *)obj) == NPY_BOOL);
}

/* One size of normalized_shape from an integer object; -1 with an exception set, a
   ValueError where it does not fit in an index. */
static Py_ssize_t
normalized_size(PyObject *obj)
{
    const Py_ssize_t size = PyNumber_AsSsize_t(obj, PyExc_OverflowError);
    if (size == -1 && PyErr_ExceptionMatches(PyExc_OverflowError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "normalized_shape sizes must fit in an index (%zd at most), got %R",
                     PY_SSIZE_T_MAX, obj);
    }
    return size;
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
        const Py_ssize_t n = normalized_size(obj);
        if (n == -1 && PyErr_Occurred()) {
            goto done;
        }
        shape->ndim = 1;
        shape->dims[0] = n;
    }
    else if (PySequence_Check(obj) && !PyUnicode_Check(obj) && !PyBytes_Check(obj)) {
        seq = items_of(obj, "normalized_shape must be an int or a sequence of ints");
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
            const Py_ssize_t d = normalized_size(item);
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
    seq = items_of(obj, message);
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

/* Whether arr is of ml_dtypes' bfloat16, a user-registered NumPy dtype with no fixed type
   number: known by its name and size (ml_dtypes itself is never imported), and its type
   number remembered in state from the first such array on.  -1 with an exception set when
   the name cannot be read. */
static int
is_bfloat16(module_state *state, PyArrayObject *arr)
{
    const int type_num = PyArray_TYPE(arr);
    if (type_num == state->bfloat16_type_num) {
        return 1;
    }
    if (type_num < NPY_USERDEF || PyArray_ITEMSIZE(arr) != 2) {
        return 0;
    }
    PyObject *name = PyObject_GetAttrString((PyObject *)PyArray_DESCR(arr), "name");
    if (!name) {
        return -1;
    }
    const int matches = PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "bfloat16") == 0;
    Py_DECREF(name);
    if (matches) {
        state->bfloat16_type_num = type_num;
    }
    return matches;
}

/* Whether arr holds floats: a NumPy float dtype, or bfloat16; -1 with an exception set. */
static int
is_float_array(module_state *state, PyArrayObject *arr)
{
    return PyArray_DESCR(arr)->kind == 'f' ? 1 : is_bfloat16(state, arr);
}

/* The kernel dtype of a float16/bfloat16/float32/float64 array; -1 with UnsupportedDTypeError
   set otherwise (its `dtype` attribute is the array's dtype, for the Python layer to name it
   as torch does). */
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
    const int bfloat16 = is_bfloat16(state, arr);
    if (bfloat16 != 0) {
        return bfloat16 > 0 ? LN_BF16 : -1;
    }
    PyObject *descr = (PyObject *)PyArray_DESCR(arr);
    return raise_with_attribute(state->unsupported_dtype_error,
                                PyUnicode_FromFormat("%s takes float16, bfloat16, float32 or float64 arrays, "
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

/* New reference: contiguous_of_type's array for a parameter, but a float16 or bfloat16 one
   (C-contiguous, aligned, native) going to float32 is widened by the kernel layer's vector
   conversion rather than NumPy's cast, which converts float16 an element at a time (a weight
   of 4096 elements took 11.6 us, a 1x4096 float16 forward with float32 parameters 2.9 us).
   The same values: both conversions are exact.  NULL with an exception set. */
static PyArrayObject *
param_of_type(const module_state *state, PyArrayObject *arr, int type_num)
{
    const int from = PyArray_TYPE(arr);
    const int dtype = from == NPY_HALF ? LN_F16 : from == state->bfloat16_type_num ? LN_BF16 : -1;
    if (type_num != NPY_FLOAT || dtype < 0 || !PyArray_ISCARRAY_RO(arr)) {
        return contiguous_of_type(arr, type_num);
    }
    PyArrayObject *widened = (PyArrayObject *)PyArray_SimpleNew(PyArray_NDIM(arr), PyArray_DIMS(arr), NPY_FLOAT);
    if (widened) {
        ln_widen_to_f32((ln_dtype)dtype, PyArray_DATA(arr), PyArray_DATA(widened), PyArray_SIZE(arr));
    }
    return widened;
}

static const int param_type_num[] = {NPY_FLOAT, NPY_FLOAT, NPY_DOUBLE, NPY_FLOAT};
static const npy_intp param_size[] = {4, 4, 8, 4};

/* The NumPy type number of the kernel dtype's elements (bfloat16's is the one state saw). */
static int
element_type_num(const module_state *state, int dtype)
{
    static const int builtin[] = {NPY_HALF, NPY_FLOAT, NPY_DOUBLE};
    return dtype == LN_BF16 ? state->bfloat16_type_num : builtin[dtype];
}

/* Stores into *out a new reference to the parameter `obj` as an array (np.asarray's), or NULL
   for None: its conversion, which may run the caller's code (__array__); param_checked
   checks it once no more of that code is to run.  Returns 0, or -1 with an exception set. */
static int
param_object_array(PyObject *obj, const char *name, PyArrayObject **out)
{
    *out = NULL;
    if (!is_given(obj)) {
        return 0;
    }
    if (PyUnicode_Check(obj) || PyBytes_Check(obj) || PyByteArray_Check(obj)) {
        /* NumPy makes a 0-d text array of it: a shape error would hide the real mistake */
        PyErr_Format(PyExc_TypeError, "%s must be an array of floats or None, got %.200s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = as_array(obj);
    return *out ? 0 : -1;
}

/* Replaces *param, param_object_array's array or NULL, by a new reference to it as a
   C-contiguous array of the param type, once its shape (normalized_shape's) and dtype are
   checked; where the call reads no parameter (`values_read` 0: an input without elements), it
   is only checked (a broadcast weight of 10**8 elements was copied, 0.4 GB, for an empty
   result).  Returns 0, or -1 with an exception set (*param left for the caller to release). */
static int
param_checked(module_state *state, const char *fname, const char *name, const shape_t *ns, int type_num,
              int values_read, PyArrayObject **param)
{
    int status = -1;
    PyArrayObject *arr = *param;
    PyObject *got = NULL, *want = NULL;
    if (!arr) {
        return 0;
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
    const int is_float = is_float_array(state, arr);
    if (is_float < 0) {
        goto done;
    }
    if (!is_float) {
        PyErr_Format(PyExc_TypeError, "%s must have a floating-point dtype, got dtype %S", name,
                     (PyObject *)PyArray_DESCR(arr));
        goto done;
    }
    if (values_read) {
        PyArrayObject *converted = param_of_type(state, arr, type_num);
        if (!converted) {
            allocation_failed(fname, name, ns->ndim, ns->dims, type_num);
            goto done;
        }
        *param = converted;
        Py_DECREF(arr);
    }
    status = 0;
done:
    Py_XDECREF(got);
    Py_XDECREF(want);
    return status;
}

/* ------------------------------------------------------------------------ */
/* Helpers: the normalized axes                                              */
/* ------------------------------------------------------------------------ */

/* The axes of the input a call normalizes over, in normalized_shape's order: element j of
   a row is their multi-index in that order, C-style, so weight[j] belongs to it. */
typedef struct {
    int naxes;
    int axes[LN_MAX_DIMS];
    int given;  /* axis= was given: results keep the input's memory order */
} norm_axes;

/* Stores into *value the axis obj names, as an index.  Returns 0, or -1 with an exception set. */
static int
parse_one_axis(PyObject *obj, Py_ssize_t *value)
{
    if (!PyIndex_Check(obj) || is_bool(obj)) {
        PyErr_Format(PyExc_TypeError, "axis must be an int or a tuple of ints, but found an element of type %.200s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    *value = PyNumber_AsSsize_t(obj, PyExc_OverflowError);
    return *value == -1 && PyErr_Occurred() ? -1 : 0;
}

/* axis= as the caller gave it, its elements read (their __index__ run) before any array's
   dims are looked at. */
typedef struct {
    int given;
    npy_intp values[LN_MAX_DIMS];  /* normalized_shape's number of them, as given */
} axis_arg;

/* Fills *arg from axis= (an int or a tuple of normalized_shape's length).  Returns 0, or -1
   with an exception set. */
static int
parse_axis(PyObject *axis_obj, const shape_t *ns, axis_arg *arg)
{
    int status = -1;
    PyObject *seq = NULL, *ns_list = NULL;
    arg->given = is_given(axis_obj);
    if (!arg->given) {
        return 0;
    }
    /* one axis: an int, NumPy's integer scalars and 0-d integer arrays (as np.sum takes) */
    const int zero_d = PyArray_Check(axis_obj) && PyArray_NDIM((PyArrayObject *)axis_obj) == 0;
    const int one = PyIndex_Check(axis_obj) && !is_bool(axis_obj) && (zero_d || !PySequence_Check(axis_obj));
    if (!one && !PyTuple_Check(axis_obj)) {
        PyErr_Format(PyExc_TypeError, "axis must be an int or a tuple of ints, got %.200s",
                     Py_TYPE(axis_obj)->tp_name);
        goto done;
    }
    if (one) {
        seq = PyTuple_Pack(1, axis_obj);
    }
    else {
        Py_INCREF(axis_obj);
        seq = axis_obj;
    }
    if (!seq) {
        goto done;
    }
    if (PyTuple_GET_SIZE(seq) != ns->ndim) {
        ns_list = dims_as_list(ns->dims, ns->ndim);
        if (ns_list) {
            PyErr_Format(PyExc_ValueError, "normalized_shape=%R and axis=%R differ in length", ns_list, seq);
        }
        goto done;
    }
    for (int i = 0; i < ns->ndim; i++) {
        Py_ssize_t value;
        if (parse_one_axis(PyTuple_GET_ITEM(seq, i), &value) < 0) {
            goto done;
        }
        arg->values[i] = value;
    }
    status = 0;
done:
    Py_XDECREF(seq);
    Py_XDECREF(ns_list);
    return status;
}

/* New reference: axes as a Python tuple, for messages that print them as given, (1, -1). */
static PyObject *
axes_as_tuple(const npy_intp *axes, int naxes)
{
    PyObject *list = dims_as_list(axes, naxes);
    PyObject *tuple = list ? PyList_AsTuple(list) : NULL;
    Py_XDECREF(list);
    return tuple;
}

/* Fills *ax from parse_axis's *arg (without axis=: the last ns->ndim axes, as torch), checks
   the input's sizes along them against normalized_shape (a mismatch in torch's words for the
   norm `kind`), then stores their product in ns->size: only an array's dims are known to
   multiply without overflow, not any sizes a caller writes.  Returns 0, or -1 with an
   exception set. */
static int
resolve_axes(module_state *state, ln_norm_kind kind, const axis_arg *arg, PyArrayObject *input, shape_t *ns,
             norm_axes *ax)
{
    int status = -1;
    PyObject *ns_list = NULL, *size_list = NULL, *axis_tuple = NULL, *ns_text = NULL, *tail = NULL;
    ax->given = arg->given;
    ax->naxes = ns->ndim;
    const int ndim = PyArray_NDIM(input);
    int sizes_match = 1;
    if (!ax->given) {
        sizes_match = ndim >= ns->ndim;
        for (int i = 0; sizes_match && i < ns->ndim; i++) {
            ax->axes[i] = ndim - ns->ndim + i;
        }
    }
    else {
        int seen[LN_MAX_DIMS] = {0};
        for (int i = 0; i < ns->ndim; i++) {
            if (arg->values[i] < -ndim || arg->values[i] >= ndim) {  /* NumPy's AxisError */
                PyObject *error = PyObject_CallFunction(state->axis_error, "ni", (Py_ssize_t)arg->values[i], ndim);
                if (error) {
                    PyErr_SetObject(state->axis_error, error);
                    Py_DECREF(error);
                }
                goto done;
            }
            ax->axes[i] = (int)(arg->values[i] < 0 ? arg->values[i] + ndim : arg->values[i]);
            if (seen[ax->axes[i]]++) {
                axis_tuple = axes_as_tuple(arg->values, ns->ndim);
                if (axis_tuple) {
                    PyErr_Format(PyExc_ValueError, "repeated axis in axis=%R", axis_tuple);
                }
                goto done;
            }
        }
    }
    for (int i = 0; sizes_match && i < ns->ndim; i++) {
        sizes_match = PyArray_DIM(input, ax->axes[i]) == ns->dims[i];
    }
    if (sizes_match && checked_product(ns->dims, ns->ndim, &ns->size) == 0) {
        status = 0;
        goto done;
    }
    ns_list = dims_as_list(ns->dims, ns->ndim);  /* for the messages, from here on */
    if (!ns_list) {
        goto done;
    }
    if (sizes_match) {
        PyErr_Format(PyExc_ValueError, "normalized_shape = %R has more elements than an array can hold", ns_list);
        goto done;
    }
    size_list = dims_as_list(PyArray_DIMS(input), ndim);
    if (!size_list) {
        goto done;
    }
    if (kind == LN_NORM_RMS && !ax->given && ndim < ns->ndim) {  /* F.rms_norm's own check, before the kernel's */
        PyErr_Format(PyExc_ValueError,
                     "Input tensor must have at least %d dimensions, but got %d (normalized_shape=%R, input of "
                     "size%R)", ns->ndim, ndim, ns_list, size_list);
        goto done;
    }
    if (ax->given) {
        npy_intp axes[LN_MAX_DIMS];
        for (int i = 0; i < ns->ndim; i++) {
            axes[i] = ax->axes[i];
        }
        axis_tuple = axes_as_tuple(axes, ns->ndim);
        if (axis_tuple) {
            PyErr_Format(PyExc_ValueError,
                         "Given normalized_shape=%R and axis=%R, expected input with sizes %R along those "
                         "axes, but got input of size%R",
                         ns_list, axis_tuple, ns_list, size_list);
        }
        goto done;
    }
    /* torch's text: "[*, 2, 2]" from "[2, 2]" (F.layer_norm's), "[*2, 2]" (F.rms_norm's) */
    ns_text = PyObject_Repr(ns_list);
    tail = ns_text ? PyUnicode_Substring(ns_text, 1, PyUnicode_GET_LENGTH(ns_text)) : NULL;
    if (tail) {
        PyErr_Format(PyExc_ValueError,
                     "Given normalized_shape=%R, expected input with shape [*%s%U, but got input of size%R", ns_list,
                     kind == LN_NORM_LAYER ? ", " : "", tail, size_list);
    }
done:
    Py_XDECREF(ns_list);
    Py_XDECREF(size_list);
    Py_XDECREF(axis_tuple);
    Py_XDECREF(ns_text);
    Py_XDECREF(tail);
    return status;
}

/* Stores the number of rows, the product of the input's other dims, into *rows.  Returns 0,
   or -1 with ValueError set when it overflows (NumPy makes no such array). */
static int
batch_size(PyArrayObject *input, const norm_axes *ax, npy_intp *rows)
{
    npy_intp dims[LN_MAX_DIMS];
    int n = 0, normalized[LN_MAX_DIMS] = {0};
    for (int i = 0; i < ax->naxes; i++) {
        normalized[ax->axes[i]] = 1;
    }
    for (int d = 0; d < PyArray_NDIM(input); d++) {
        if (!normalized[d]) {
            dims[n++] = PyArray_DIM(input, d);
        }
    }
    if (checked_product(dims, n, rows) < 0) {
        PyErr_SetString(PyExc_ValueError, "the input has more rows than an npy_intp can count");
        return -1;
    }
    return 0;
}

/* The shape of a statistic, one value per row: the input's, with 1 on the normalized axes. */
static void
stats_dims(PyArrayObject *input, const norm_axes *ax, npy_intp dims[])
{
    for (int d = 0; d < PyArray_NDIM(input); d++) {
        dims[d] = PyArray_DIM(input, d);
    }
    for (int i = 0; i < ax->naxes; i++) {
        dims[ax->axes[i]] = 1;
    }
}

/* ------------------------------------------------------------------------ */
/* Helpers: results and overlaps                                             */
/* ------------------------------------------------------------------------ */

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

/* The work np.shares_memory may do on one pair of arrays before it gives up: this many
   steps of its search per element of the arrays, so the test costs in proportion to the
   results it guards (strides found to need more are contrived, not made by slicing). */
#define SHARES_MEMORY_WORK_PER_ELEMENT 256
#define SHARES_MEMORY_MIN_WORK 100000

/* 1 when an element of a and one of b share memory, 0 when none does, 2 when NumPy's exact
   test gave up within its budget, or -1 with an exception set.  Where their extents overlap,
   the exact test decides (interleaved halves of one buffer share nothing).  It is given
   base-class views, so that no subclass's __array_function__ (the caller's code) runs after
   the checks. */
static int
arrays_share_memory(module_state *state, PyArrayObject *a, PyArrayObject *b)
{
    if (!arrays_overlap(a, b)) {
        return 0;
    }
    const npy_intp elements = PyArray_SIZE(a) > PyArray_SIZE(b) ? PyArray_SIZE(a) : PyArray_SIZE(b);
    npy_intp max_work = SHARES_MEMORY_MIN_WORK;
    if (elements > max_work / SHARES_MEMORY_WORK_PER_ELEMENT) {
        max_work = elements > NPY_MAX_INTP / SHARES_MEMORY_WORK_PER_ELEMENT ? NPY_MAX_INTP
                                                                          : elements * SHARES_MEMORY_WORK_PER_ELEMENT;
    }
    int share = -1;
    PyObject *shares = NULL;
    PyObject *a_view = PyArray_View(a, NULL, &PyArray_Type);
    PyObject *b_view = a_view ? PyArray_View(b, NULL, &PyArray_Type) : NULL;
    if (b_view) {
        shares = PyObject_CallFunction(state->shares_memory, "OOn", a_view, b_view, (Py_ssize_t)max_work);
    }
    if (shares) {
        share = PyObject_IsTrue(shares);
    }
    else if (b_view && PyErr_ExceptionMatches(state->too_hard_error)) {
        PyErr_Clear();
        share = 2;
    }
    Py_XDECREF(a_view);
    Py_XDECREF(b_view);
    Py_XDECREF(shares);
    return share;
}

/* 1 when two elements of `a` may share memory (a zero stride, or axes whose steps interleave),
   else 0.  The test is sufficient, not necessary: taken by increasing step, each axis of more
   than one element must step past all that the axes before it span. */
static int
may_overlap_itself(PyArrayObject *a)
{
    npy_intp steps[NPY_MAXDIMS], counts[NPY_MAXDIMS];
    int axes = 0;
    if (PyArray_SIZE(a) == 0) {
        return 0;
    }
    for (int d = 0; d < PyArray_NDIM(a); d++) {
        if (PyArray_DIM(a, d) > 1) {
            const npy_intp step = PyArray_STRIDE(a, d) < 0 ? -PyArray_STRIDE(a, d) : PyArray_STRIDE(a, d);
            int k = axes++;
            for (; k > 0 && steps[k - 1] > step; k--) {
                steps[k] = steps[k - 1];
                counts[k] = counts[k - 1];
            }
            steps[k] = step;
            counts[k] = PyArray_DIM(a, d);
        }
    }
    npy_intp spanned = PyArray_ITEMSIZE(a);
    for (int k = 0; k < axes; k++) {
        if (steps[k] < spanned) {
            return 1;
        }
        spanned += steps[k] * (counts[k] - 1);
    }
    return 0;
}

/* 1 when a and b (of one shape) are the same elements in the same places, and no two of them
   share memory, else 0: a result may be written over such an input, element onto element. */
static int
same_elements(PyArrayObject *a, PyArrayObject *b)
{
    if (PyArray_DATA(a) != PyArray_DATA(b) || PyArray_ITEMSIZE(a) != PyArray_ITEMSIZE(b)) {
        return 0;
    }
    for (int d = 0; d < PyArray_NDIM(a); d++) {
        if (PyArray_DIM(a, d) > 1 && PyArray_STRIDE(a, d) != PyArray_STRIDE(b, d)) {
            return 0;
        }
    }
    return !may_overlap_itself(a);
}

/* Replaces *arr (owned, may be NULL) with a private copy when it overlaps `result`, unless
   `in_place` allows it to be the very same elements.  Returns 0, or -1 with an exception set
   (then *arr is NULL). */
static int
detach_from_result(PyArrayObject **arr, PyArrayObject *result, int in_place)
{
    if (!*arr || !arrays_overlap(*arr, result) || (in_place && same_elements(*arr, result))) {
        return 0;
    }
    Py_SETREF(*arr, (PyArrayObject *)PyArray_NewCopy(*arr, NPY_KEEPORDER));
    return *arr ? 0 : -1;
}

/* New reference: the caller's array `name` (out=, residual_out=) after checking it can take
   a result shaped like `like` of type type_num; NULL with an exception set. */
static PyArrayObject *
check_result_array(PyObject *obj, const char *name, PyArrayObject *like, int type_num)
{
    PyArrayObject *result = NULL;
    PyObject *got = NULL, *want = NULL;
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy.ndarray, got %.200s", name, Py_TYPE(obj)->tp_name);
        goto done;
    }
    PyArrayObject *arr = (PyArrayObject *)obj;
    if (PyArray_TYPE(arr) != type_num || !PyArray_ISNOTSWAPPED(arr)) {
        /* the result's dtype in native byte order (`like`, the input, may be byte-swapped) */
        want = (PyObject *)PyArray_DescrFromType(type_num);
        if (want) {
            PyErr_Format(PyExc_TypeError, "%s has dtype %S, but the result has dtype %S", name,
                         (PyObject *)PyArray_DESCR(arr), want);
        }
        goto done;
    }
    if (!PyArray_SAMESHAPE(arr, like)) {
        got = dims_as_list(PyArray_DIMS(arr), PyArray_NDIM(arr));
        want = got ? dims_as_list(PyArray_DIMS(like), PyArray_NDIM(like)) : NULL;
        if (want) {
            PyErr_Format(PyExc_ValueError, "%s has shape %R, but the result has shape %R", name, got, want);
        }
        goto done;
    }
    if (!PyArray_ISWRITEABLE(arr)) {
        PyErr_Format(PyExc_ValueError, "%s is read-only", name);
        goto done;
    }
    Py_INCREF(arr);
    result = arr;
done:
    Py_XDECREF(got);
    Py_XDECREF(want);
    return result;
}

/* ------------------------------------------------------------------------ */
/* Memory for large results                                                  */
/* ------------------------------------------------------------------------ */

/* Results as large as LN_BUFFER_MIN_BYTES are allocated through this NumPy memory handler
   (NEP 49): ln_buffers.c keeps their memory when they are freed, for the next result of
   their size, so a loop of calls on large arrays does not have the OS map and zero new pages
   for every result.  They are ordinary arrays that own their data; NumPy frees it through
   the handler each array keeps, and counts it for tracemalloc as any array's. */

static void *
result_memory_malloc(void *ctx, size_t size)
{
    return ln_buffer_alloc(size, 0);
}

static void *
result_memory_calloc(void *ctx, size_t count, size_t size)
{
    size_t bytes;
    return __builtin_mul_overflow(count, size, &bytes) ? NULL : ln_buffer_alloc(bytes, 1);
}

static void *
result_memory_realloc(void *ctx, void *data, size_t size)
{
    return ln_buffer_realloc(data, size);
}

static void
result_memory_free(void *ctx, void *data, size_t size)
{
    ln_buffer_free(data);
}

static PyDataMem_Handler result_memory_handler = {
    .name = "layernorm_result_memory",
    .version = 1,
    .allocator = {
        .ctx = NULL,
        .malloc = result_memory_malloc,
        .calloc = result_memory_calloc,
        .realloc = result_memory_realloc,
        .free = result_memory_free,
    },
};

/* Backward's 16-byte non-temporal stores of dx fill whole cache lines only from a 64-byte
   aligned start (Xeon, 512x4096 float32 backward, one thread, x and dy at page offsets
   0..224: slowest/fastest 1.71-1.91 -> 1.08-1.09): every result they are used for is large
   enough to come from ln_buffers.c, whose blocks are so aligned. */
_Static_assert(LN_BUFFER_MIN_BYTES <= (size_t)LN_BACKWARD_STREAM_MIN_BYTES,
               "every result backward streams into is a block of ln_buffers.c");

/* Makes NumPy allocate what follows through result_memory_handler, when a result as large as
   `input` gains from it, until result_memory_end; the memory is placed so as not to alias
   input's, nor that of `other` (a second input of the same size, or NULL) (ln_buffers_place).
   Returns the handler to restore then (a new reference; None when nothing changed), or NULL
   with an exception set. */
static PyObject *
result_memory_begin(module_state *state, PyArrayObject *input, PyArrayObject *other)
{
    if (PyArray_NBYTES(input) < (npy_intp)LN_BUFFER_MIN_BYTES) {
        Py_RETURN_NONE;
    }
    const void *const inputs[2] = {PyArray_DATA(input), other ? PyArray_DATA(other) : NULL};
    ln_buffers_place(inputs, other ? 2 : 1);
    return PyDataMem_SetHandler(state->result_memory);
}

/* Restores `previous` (stolen), from result_memory_begin.  Returns `made` (stolen), what was
   allocated since, or NULL with an exception set when that could not be done. */
static PyArrayObject *
result_memory_end(PyObject *previous, PyArrayObject *made)
{
    if (previous != Py_None) {
        PyObject *ours = PyDataMem_SetHandler(previous);
        if (ours) {
            Py_DECREF(ours);
        }
        else {
            Py_CLEAR(made);
        }
    }
    Py_DECREF(previous);
    return made;
}

/* New reference: an uninitialised array for a result of the input's shape and type type_num,
   in the input's memory order when axis= was given (an NCHW input normalized over C gives an
   NCHW result), else C-contiguous as torch's; NULL with an exception set.  `other` is the
   call's other input of that shape (residual, grad_output), or NULL. */
static PyArrayObject *
new_result(module_state *state, const char *fname, const char *name, PyArrayObject *input, PyArrayObject *other,
           const norm_axes *ax, int type_num)
{
    PyArrayObject *result = NULL;
    PyObject *previous = result_memory_begin(state, input, other);
    if (previous) {
        if (ax->given) {
            result = (PyArrayObject *)PyArray_NewLikeArray(input, NPY_KEEPORDER, PyArray_DescrFromType(type_num), 0);
        }
        else {
            result = (PyArrayObject *)PyArray_SimpleNew(PyArray_NDIM(input), PyArray_DIMS(input), type_num);
        }
        result = result_memory_end(previous, result);
    }
    if (!result) {
        allocation_failed(fname, name, PyArray_NDIM(input), PyArray_DIMS(input), type_num);
    }
    return result;
}

/* New reference: the caller's array obj, the keyword `keyword`, when given (checked), else a new
   result array, `name` in messages. */
static PyArrayObject *
result_array(module_state *state, const char *fname, PyObject *obj, const char *keyword, const char *name,
             PyArrayObject *input, PyArrayObject *other, const norm_axes *ax, int type_num)
{
    if (is_given(obj)) {
        return check_result_array(obj, keyword, input, type_num);
    }
    return new_result(state, fname, name, input, other, ax, type_num);
}

/* New reference: an uninitialised C-contiguous array for the statistic `name`, one value per
   row, or NULL with an exception set. */
static PyArrayObject *
stats_array(const char *fname, const char *name, PyArrayObject *input, const norm_axes *ax, int type_num)
{
    npy_intp dims[LN_MAX_DIMS];
    stats_dims(input, ax, dims);
    PyArrayObject *stats = (PyArrayObject *)PyArray_SimpleNew(PyArray_NDIM(input), dims, type_num);
    if (!stats) {
        allocation_failed(fname, name, PyArray_NDIM(input), dims, type_num);
    }
    return stats;
}

/* New reference: a C-contiguous array of the statistics' shape and type type_num over the
   bytes at `data`, which belong to `owner` (a bytes object made here); NULL with an exception
   set. */
static PyArrayObject *
stats_over_bytes(PyObject *owner, char *data, PyArrayObject *input, const norm_axes *ax, int type_num)
{
    npy_intp dims[LN_MAX_DIMS];
    stats_dims(input, ax, dims);
    PyArrayObject *view = (PyArrayObject *)PyArray_NewFromDescr(
        &PyArray_Type, PyArray_DescrFromType(type_num), PyArray_NDIM(input), dims, NULL, data,
        NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_WRITEABLE, NULL);
    if (view) {
        Py_INCREF(owner);
        if (PyArray_SetBaseObject(view, owner) < 0) {
            Py_CLEAR(view);
        }
    }
    return view;
}

/* New reference: an array for input's data that nobody else holds (for backward to read after
   the caller may have changed its own), contiguous in the input's memory order and native, so
   that forward and backward take the routes they take on the input itself: the array NumPy
   made here from a list or tuple input_obj, else a copy; NULL with an exception set.
   *kernel_fills is set when the data is not there yet: the forward kernel copies each row as
   it reads it. */
static PyArrayObject *
private_input(module_state *state, PyObject *input_obj, PyArrayObject *input, int *kernel_fills)
{
    *kernel_fills = 0;
    /* Only an array made here is known to be private: an array that came out of the caller's
       object, even one owning its data, may be that object's own buffer (an __array__ that
       returns a kept array). */
    if ((PyList_Check(input_obj) || PyTuple_Check(input_obj)) && PyArray_ISCARRAY_RO(input) &&
        PyArray_ISNOTSWAPPED(input)) {
        Py_INCREF(input);
        return input;
    }
    PyObject *previous = result_memory_begin(state, input, NULL);
    if (!previous) {
        return NULL;
    }
    PyArrayObject *copy;
    if (PyArray_ISCARRAY_RO(input) && PyArray_ISNOTSWAPPED(input)) {
        /* the common case: no second pass over the input, nor NumPy's general copy machinery
           (a third of a small call's time) */
        *kernel_fills = 1;
        copy = (PyArrayObject *)PyArray_SimpleNew(PyArray_NDIM(input), PyArray_DIMS(input), PyArray_TYPE(input));
    }
    else {
        copy = (PyArrayObject *)PyArray_NewLikeArray(input, NPY_KEEPORDER, PyArray_DescrFromType(PyArray_TYPE(input)),
                                                     0);
        if (copy && PyArray_CopyInto(copy, input) < 0) {
            Py_CLEAR(copy);
        }
    }
    return result_memory_end(previous, copy);
}

/* ------------------------------------------------------------------------ */
/* Layouts: the arrays of one kernel call and how the kernel walks them      */
/* ------------------------------------------------------------------------ */

#define MAX_CALL_ARRAYS LN_LAYOUT_MAX_ARRAYS

_Static_assert(sizeof(npy_intp) == sizeof(ptrdiff_t), "strides are handed to the kernel layer as they are");

/* One array the kernel reads or writes. */
typedef struct {
    PyArrayObject *arr;     /* owned; NULL: absent */
    PyArrayObject *result;  /* owned: where arr's values go after the kernel, when arr stands in
                               for a result the kernel cannot walk; else NULL */
    int writes;
    int per_row;            /* a statistic: one value per row, size 1 on the normalized axes */
    const char *name;       /* what it is, for messages: "the input", "grad_output", ... */
} call_array;

/* The arrays of one kernel call (all of the input's shape, statistics aside), their common
   shape and normalized axes, and, once planned, the kernel's extent and walks.  Not zeroed
   (1.4 KiB, on every call): call_init, call_add and call_plan set what is read. */
typedef struct {
    int n;
    call_array arrays[MAX_CALL_ARRAYS];
    int ndim;
    npy_intp dims[LN_MAX_DIMS];
    norm_axes axes;
    int reference;          /* the array normalized (the input, or the sum of a fused add): its
                               layout alone decides the kernel's route, and so the bits */
    int reference_planned;  /* reference_extent holds the reference's own plan */
    ln_extent reference_extent;
    ln_extent extent;
    ln_walk walks[MAX_CALL_ARRAYS];
} kernel_call;

static void
call_init(kernel_call *call, PyArrayObject *input, const norm_axes *ax)
{
    call->n = 0;
    call->ndim = PyArray_NDIM(input);
    memcpy(call->dims, PyArray_DIMS(input), (size_t)call->ndim * sizeof(npy_intp));
    call->axes.naxes = ax->naxes;
    call->axes.given = ax->given;
    memcpy(call->axes.axes, ax->axes, (size_t)ax->naxes * sizeof ax->axes[0]);
}

/* Adds arr (borrowed, may be NULL), called `name`, to the call; returns its index there. */
static int
call_add(kernel_call *call, PyArrayObject *arr, const char *name, int writes, int per_row)
{
    assert(call->n < MAX_CALL_ARRAYS);
    call_array *slot = &call->arrays[call->n];
    Py_XINCREF(arr);
    slot->arr = arr;
    slot->result = NULL;
    slot->name = name;
    slot->writes = writes;
    slot->per_row = per_row;
    return call->n++;
}

static ln_array
call_array_at(const kernel_call *call, int index)
{
    ln_array array = {NULL, {0, 0, 0}};
    if (call->arrays[index].arr) {
        array.data = PyArray_DATA(call->arrays[index].arr);
        array.walk = call->walks[index];
    }
    return array;
}

/* Plans the walks of the call's arrays as they are (or, with `alone` an array's index, plans
   that one array by itself, its extent in call->extent, its walk nowhere).  Returns 1 when the
   kernel can walk them (with `unit_elements`: only rows whose elements are adjacent), else 0.
   The bits follow the route and the extent: the kernels take their contiguous route, whose
   bits can differ from the strided route's, when every array's elements are adjacent, and the
   strided route sums parameter gradients block by block.  So where the reference's elements
   are adjacent every array's must be, and the extent must be the reference's own: the route
   and the sums follow the reference's layout, whatever the others' are. */
static int
call_plan(kernel_call *call, int unit_elements, int alone)
{
    npy_intp strides[MAX_CALL_ARRAYS][LN_MAX_DIMS];
    const ptrdiff_t *stride_lists[MAX_CALL_ARRAYS] = {NULL};
    ptrdiff_t itemsizes[MAX_CALL_ARRAYS] = {0};
    ln_walk walks[MAX_CALL_ARRAYS];
    int present[MAX_CALL_ARRAYS], normalized[LN_MAX_DIMS] = {0}, k = 0;
    for (int i = 0; i < call->axes.naxes; i++) {
        normalized[call->axes.axes[i]] = 1;
    }
    for (int a = 0; a < call->n; a++) {
        const call_array *slot = &call->arrays[a];
        if (!slot->arr || (alone >= 0 && a != alone)) {
            continue;
        }
        if (!PyArray_ISALIGNED(slot->arr) || !PyArray_ISNOTSWAPPED(slot->arr)) {
            return 0;
        }
        for (int d = 0; d < call->ndim; d++) {
            /* a statistic's size-1 normalized axes: the same value for every element */
            strides[k][d] = slot->per_row && normalized[d] ? 0 : PyArray_STRIDE(slot->arr, d);
        }
        stride_lists[k] = strides[k];
        itemsizes[k] = PyArray_ITEMSIZE(slot->arr);
        present[k++] = a;
    }
    if (ln_layout_plan(call->ndim, call->dims, call->axes.naxes, call->axes.axes, k, stride_lists, itemsizes,
                       &call->extent, walks) != LN_LAYOUT_OK) {
        return 0;
    }
    int adjacent_needed = unit_elements;
    for (int i = 0; i < k; i++) {
        if (present[i] == call->reference && walks[i].elem_step == itemsizes[i]) {
            adjacent_needed = 1;
        }
    }
    for (int i = 0; i < k; i++) {
        /* (an empty array has zero strides, and no element to walk) */
        const call_array *slot = &call->arrays[present[i]];
        if (adjacent_needed && !slot->per_row && PyArray_SIZE(slot->arr) > 0 && walks[i].elem_step != itemsizes[i]) {
            return 0;
        }
    }
    if (alone < 0 && call->reference_planned &&
        (call->extent.blocks != call->reference_extent.blocks || call->extent.rows != call->reference_extent.rows)) {
        return 0;
    }
    for (int i = 0; i < k && alone < 0; i++) {
        call->walks[present[i]] = walks[i];
    }
    return 1;
}

/* Plans the reference by itself, for call_plan to hold the call to its extent; returns 1 when
   the kernel can walk it (an unaligned or byte-swapped one it cannot), else 0. */
static int
call_plan_reference(kernel_call *call, int unit_elements)
{
    call->reference_planned = call_plan(call, unit_elements, call->reference);
    call->reference_extent = call->extent;
    return call->reference_planned;
}

/* Makes the call walkable whatever its arrays' layouts.  Every array becomes a view with the
   other axes first and the normalized axes last, in normalized_shape's order; a view that is
   not native C-contiguous is replaced, when read by such a copy of it, when written by a new
   array whose values go to the view once the kernel is done (call_finish).  Returns 0, or -1
   with an exception set. */
static int
call_use_copies(const char *fname, kernel_call *call)
{
    npy_intp order[LN_MAX_DIMS], dims[LN_MAX_DIMS];
    int normalized[LN_MAX_DIMS] = {0}, k = 0;
    for (int i = 0; i < call->axes.naxes; i++) {
        normalized[call->axes.axes[i]] = 1;
    }
    for (int d = 0; d < call->ndim; d++) {
        if (!normalized[d]) {
            order[k++] = d;
        }
    }
    for (int i = 0; i < call->axes.naxes; i++) {
        order[k++] = call->axes.axes[i];
    }
    PyArray_Dims permutation = {order, call->ndim};
    for (int a = 0; a < call->n; a++) {
        call_array *slot = &call->arrays[a];
        if (!slot->arr) {
            continue;
        }
        if (slot->result) {  /* a stand-in already: permute the result itself instead */
            Py_SETREF(slot->arr, slot->result);
            slot->result = NULL;
        }
        PyArrayObject *view = (PyArrayObject *)PyArray_Transpose(slot->arr, &permutation);
        if (!view) {
            return -1;
        }
        /* (NumPy calls every empty array C-contiguous, whatever its strides: a new one has
           the strides the plan expects) */
        if (PyArray_SIZE(view) > 0 && PyArray_IS_C_CONTIGUOUS(view) && PyArray_ISALIGNED(view) &&
            PyArray_ISNOTSWAPPED(view)) {
            Py_SETREF(slot->arr, view);
            continue;
        }
        PyArray_Descr *native = PyArray_DescrFromType(PyArray_TYPE(view));
        PyArrayObject *copy;
        if (slot->writes) {
            copy = (PyArrayObject *)PyArray_NewFromDescr(&PyArray_Type, native, PyArray_NDIM(view),
                                                         PyArray_DIMS(view), NULL, NULL, 0, NULL);
            slot->result = view;
        }
        else {
            copy = (PyArrayObject *)PyArray_FromArray(view, native, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED |
                                                                        NPY_ARRAY_ENSURECOPY | NPY_ARRAY_FORCECAST);
            Py_DECREF(view);
        }
        if (!copy) {
            char what[80];
            snprintf(what, sizeof what, "a copy of %s in rows the kernel can walk", slot->name);
            return allocation_failed(fname, what, PyArray_NDIM(slot->arr), PyArray_DIMS(slot->arr),
                                     PyArray_TYPE(slot->arr));
        }
        Py_SETREF(slot->arr, copy);
    }
    for (int d = 0; d < call->ndim; d++) {
        dims[d] = call->dims[order[d]];
    }
    memcpy(call->dims, dims, (size_t)call->ndim * sizeof(npy_intp));
    for (int i = 0; i < call->axes.naxes; i++) {
        call->axes.axes[i] = call->ndim - call->axes.naxes + i;
    }
    call->reference_planned = 0;  /* (every array in one order: the extent is the reference's) */
    if (!call_plan(call, 1, -1)) {
        PyErr_SetString(PyExc_SystemError, "layernorm: C-contiguous rows did not plan as rows");
        return -1;
    }
    return 0;
}

/* Replaces each array that is unaligned or byte-swapped by a native, aligned one in the same
   memory order: when read, a copy; when written, a new array whose values go to it once the
   kernel is done (call_finish).  The copy is packed: a contiguous array keeps its strides, and
   the route and bits of an aligned array of its layout; a strided one's elements may become
   adjacent, and take the contiguous route.  Returns 0, or -1 with an exception set. */
static int
call_use_native(const char *fname, kernel_call *call)
{
    for (int a = 0; a < call->n; a++) {
        call_array *slot = &call->arrays[a];
        if (!slot->arr || (PyArray_ISALIGNED(slot->arr) && PyArray_ISNOTSWAPPED(slot->arr))) {
            continue;
        }
        PyArray_Descr *native = PyArray_DescrFromType(PyArray_TYPE(slot->arr));
        PyArrayObject *copy;
        if (slot->writes) {
            copy = (PyArrayObject *)PyArray_NewLikeArray(slot->arr, NPY_KEEPORDER, native, 0);
            if (copy) {
                slot->result = slot->arr;
                slot->arr = NULL;
            }
        }
        else {
            copy = (PyArrayObject *)PyArray_FromArray(slot->arr, native, NPY_ARRAY_ALIGNED | NPY_ARRAY_ENSURECOPY |
                                                                             NPY_ARRAY_FORCECAST);
        }
        if (!copy) {
            char what[80];
            snprintf(what, sizeof what, "an aligned copy of %s", slot->name);
            return allocation_failed(fname, what, call->ndim, call->dims, PyArray_TYPE(slot->arr));
        }
        Py_XSETREF(slot->arr, copy);
    }
    return 0;
}

/* Gives every array of the call the reference's layout: an array whose strides differ from
   the reference's is replaced, when read, by a copy in the reference's memory order, when
   written, by a new array in that order whose values go to it once the kernel is done
   (call_finish); statistics read in another order than C's become C-contiguous copies, which
   walk in any plan the reference admits.  The route, and the bits, are then those of the
   reference's layout alone: add_rms_norm's output stays rms_norm of its sum whatever the other
   arrays' layouts.  Returns 0, or -1 with an exception set. */
static int
call_use_reference_layout(const char *fname, kernel_call *call)
{
    PyArrayObject *reference = call->arrays[call->reference].arr;
    for (int a = 0; a < call->n; a++) {
        call_array *slot = &call->arrays[a];
        if (!slot->arr || a == call->reference ||
            (slot->per_row ? slot->writes || PyArray_IS_C_CONTIGUOUS(slot->arr)
                           : PyArray_CompareLists(PyArray_STRIDES(slot->arr), PyArray_STRIDES(reference), call->ndim))) {
            continue;
        }
        PyArray_Descr *native = PyArray_DescrFromType(PyArray_TYPE(slot->arr));
        PyArrayObject *copy = (PyArrayObject *)(slot->per_row ? PyArray_NewLikeArray(slot->arr, NPY_CORDER, native, 0)
                                                              : PyArray_NewLikeArray(reference, NPY_KEEPORDER, native, 0));
        if (!copy) {
            char what[80];
            snprintf(what, sizeof what, "a copy of %s in the layout of %s", slot->name,
                     call->arrays[call->reference].name);
            return allocation_failed(fname, what, PyArray_NDIM(slot->arr), PyArray_DIMS(slot->arr),
                                     PyArray_TYPE(slot->arr));
        }
        if (slot->writes) {
            if (slot->result) {  /* a stand-in already: the new one's values go to the result */
                Py_DECREF(slot->arr);
            }
            else {
                slot->result = slot->arr;
            }
            slot->arr = copy;
            continue;
        }
        if (PyArray_CopyInto(copy, slot->arr) < 0) {
            Py_DECREF(copy);
            return -1;
        }
        Py_SETREF(slot->arr, copy);
    }
    return 0;
}

/* Plans the call, whose array `reference` is the one normalized: in place when the kernel can
   walk the arrays as they are, else with native aligned stand-ins in the same layout
   (call_use_native), else, when the reference can be walked by itself, with every array in
   its layout (call_use_reference_layout), else through call_use_copies.  The route, and the
   bits, follow from the reference's layout alone.  Without axis= only rows of adjacent
   elements are walked in place, so that the results (and their bits) are torch's
   layout-independent ones.  Returns 0, or -1 with an exception set. */
static int
call_prepare(const char *fname, kernel_call *call, int reference)
{
    const int unit_elements = !call->axes.given;
    call->reference = reference;
    call_plan_reference(call, unit_elements);
    if (call_plan(call, unit_elements, -1)) {
        return 0;
    }
    if (call_use_native(fname, call) < 0) {
        return -1;
    }
    if (call_plan(call, unit_elements, -1)) {
        return 0;
    }
    if (call_plan_reference(call, unit_elements)) {
        if (call_use_reference_layout(fname, call) < 0) {
            return -1;
        }
        if (call_plan(call, unit_elements, -1)) {
            return 0;
        }
    }
    return call_use_copies(fname, call);
}

/* Copies the values of stand-in arrays to their results.  Returns 0, or -1 with an exception
   set. */
static int
call_finish(kernel_call *call)
{
    for (int a = 0; a < call->n; a++) {
        if (call->arrays[a].result && PyArray_CopyInto(call->arrays[a].result, call->arrays[a].arr) < 0) {
            return -1;
        }
    }
    return 0;
}

static void
call_release(kernel_call *call)
{
    for (int a = 0; a < call->n; a++) {
        Py_CLEAR(call->arrays[a].arr);
        Py_CLEAR(call->arrays[a].result);
    }
}

/* ------------------------------------------------------------------------ */
/* Norm kinds: the forward and backward they share                           */
/* ------------------------------------------------------------------------ */

/* What the binding needs to know about one kind of normalization.  Its parameters are the
   first n_params of (weight, bias); its statistics are the last n_stats of (mean, rstd): a
   kind with centred statistics returns both, an uncentred one (RMSNorm) rstd alone. */
typedef struct {
    ln_norm_kind kernel;
    const char *module_name;    /* the module class, named in its dtype refusals */
    const char *stats_source;   /* the function whose statistics backward takes */
    int n_params;               /* 2: weight and bias; 1: weight */
    int n_stats;                /* 2: mean and rstd; 1: rstd */
    int eps_default_machine;    /* eps=None means the compute type's machine epsilon (else 1e-5) */
} norm_kind;

static const char *const param_names[] = {"weight", "bias"};
static const char *const grad_param_names[] = {"grad_weight", "grad_bias"};
static const char *const stat_names[] = {"mean", "rstd"};

static const norm_kind layer_norm_kind = {
    .kernel = LN_NORM_LAYER,
    .module_name = "LayerNorm",
    .stats_source = "native_layer_norm",
    .n_params = 2,
    .n_stats = 2,
    .eps_default_machine = 0,
};

static const norm_kind rms_norm_kind = {
    .kernel = LN_NORM_RMS,
    .module_name = "RMSNorm",
    .stats_source = "native_rms_norm",
    .n_params = 1,
    .n_stats = 1,
    .eps_default_machine = 1,
};

/* 1 when obj has an `ndim` other than 0 (an array of another library), else 0; -1 with an
   exception set when reading `ndim` fails otherwise than by its absence. */
static int
has_dimensions(PyObject *obj)
{
    PyObject *ndim = PyObject_GetAttrString(obj, "ndim");
    if (!ndim) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    const int nonzero = PyObject_IsTrue(ndim);
    Py_DECREF(ndim);
    return nonzero;
}

/* The kind's eps for an absent eps (or None, where the default is the machine epsilon of the
   compute type: float32 for float16/bfloat16/float32 input, as torch). */
static double
default_eps(const norm_kind *kind, int dtype)
{
    return !kind->eps_default_machine ? 1e-5 : dtype == LN_F64 ? DBL_EPSILON : (double)FLT_EPSILON;
}

/* Stores eps into *eps, or returns 1 where default_eps applies.  Returns 0 or 1, or -1 with an
   exception set. */
static int
parse_eps(const norm_kind *kind, PyObject *obj, double *eps)
{
    if (!obj || (obj == Py_None && kind->eps_default_machine)) {
        return 1;
    }
    /* a complex eps would lose its imaginary part (NumPy's only warns), an array of one
       element (NumPy's, or another library's: a torch tensor) would pass for a number */
    const int complex_number = PyComplex_Check(obj) || PyArray_IsScalar(obj, ComplexFloating) ||
                               (PyArray_Check(obj) && PyArray_ISCOMPLEX((PyArrayObject *)obj));
    int not_0_d_number = 0;
    if (PyArray_Check(obj)) {
        /* a 0-d array of text or objects: PyFloat_AsDouble would parse the text */
        PyArrayObject *arr = (PyArrayObject *)obj;
        not_0_d_number = PyArray_NDIM(arr) != 0 || !PyTypeNum_ISNUMBER(PyArray_TYPE(arr));
    }
    else if (!PyFloat_Check(obj) && !PyLong_Check(obj) && !PyArray_IsScalar(obj, Generic)) {
        not_0_d_number = has_dimensions(obj);
        if (not_0_d_number < 0) {
            return -1;
        }
    }
    if (complex_number || not_0_d_number ||
        (!PyFloat_Check(obj) && !PyLong_Check(obj) && !PyNumber_Check(obj))) {
        PyErr_Format(PyExc_TypeError, "eps must be a real number, got %.200s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    *eps = PyFloat_AsDouble(obj);
    return *eps == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* What forward() returns besides the output. */
typedef enum {
    RETURN_OUTPUT,          /* output */
    RETURN_STATS,           /* (output, *stats) */
    RETURN_SUM,             /* (output, sum): the fused residual add */
    RETURN_SAVED_FOR_GRAD,  /* (output, (input, saved)): input a private copy (private_input),
                               saved the bytes of saved_layout */
} forward_returns;

/* The bytes training_forward saves for saved_backward, all of the param type: each statistic
   of every row in turn (C order of the statistics' shape), then each parameter given (as the
   kernel read it), so that backward can tell a parameter changed since from one it may use. */
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

/* The arguments of one forward call, as the Python-facing functions received them (NULL or
   None where absent). */
typedef struct {
    PyObject *input, *residual, *normalized_shape, *eps, *axis, *out, *residual_out;
    PyObject *const *params;  /* the kind's n_params parameters */
} forward_objs;

/* New reference: what `returns` says, or NULL with an exception set; `what` names the caller
   in messages. */
static PyObject *
forward(module_state *state, const norm_kind *kind, const char *what, const forward_objs *objs,
        forward_returns returns)
{
    PyObject *result = NULL, *saved_stats = NULL, *saved = NULL;
    PyArrayObject *input = NULL, *residual = NULL, *output = NULL, *sum = NULL, *saved_input = NULL;
    PyArrayObject *copy = NULL;  /* borrowed: saved_input when the kernel fills it */
    PyArrayObject *params[2] = {NULL, NULL}, *stats[2] = {NULL, NULL};
    kernel_call call;
    call.n = 0;  /* for call_release, should the call end before call_init */
    shape_t ns;
    axis_arg axis;
    norm_axes ax;
    double eps;

    /* Every conversion before any look at an array: a conversion may run the caller's code
       (__array__, __float__, __index__), which may reshape or retype an array converted
       already, or resize it under a shape checked already. */
    if (parse_normalized_shape(objs->normalized_shape, &ns) < 0 || !(input = as_array(objs->input))) {
        goto done;
    }
    const int eps_defaults = parse_eps(kind, objs->eps, &eps);
    if (eps_defaults < 0 || (returns == RETURN_SUM && !(residual = as_array(objs->residual)))) {
        goto done;
    }
    for (int p = 0; p < kind->n_params; p++) {
        if (param_object_array(objs->params[p], param_names[p], &params[p]) < 0) {
            goto done;
        }
    }
    if (parse_axis(objs->axis, &ns, &axis) < 0) {
        goto done;
    }
    const int dtype = kernel_dtype(state, input, what);
    if (dtype < 0) {
        goto done;
    }
    eps = eps_defaults ? default_eps(kind, dtype) : eps;
    /* training mode saves the parameters' bytes, which backward compares */
    const int params_read = PyArray_SIZE(input) > 0 || returns == RETURN_SAVED_FOR_GRAD;
    for (int p = 0; p < kind->n_params; p++) {
        if (param_checked(state, what, param_names[p], &ns, param_type_num[dtype], params_read, &params[p]) < 0) {
            goto done;
        }
    }
    npy_intp batch;
    if (resolve_axes(state, kind->kernel, &axis, input, &ns, &ax) < 0 || batch_size(input, &ax, &batch) < 0) {
        goto done;
    }
    if (returns == RETURN_SUM) {
        if (!PyArray_SAMESHAPE(residual, input)) {
            PyObject *got = dims_as_list(PyArray_DIMS(residual), PyArray_NDIM(residual));
            PyObject *want = got ? dims_as_list(PyArray_DIMS(input), PyArray_NDIM(input)) : NULL;
            if (want) {
                PyErr_Format(PyExc_ValueError, "residual has shape %R, but input has shape %R", got, want);
            }
            Py_XDECREF(got);
            Py_XDECREF(want);
            goto done;
        }
        if (PyArray_TYPE(residual) != PyArray_TYPE(input)) {
            PyErr_Format(PyExc_TypeError, "residual has dtype %S, but input has dtype %S",
                         (PyObject *)PyArray_DESCR(residual), (PyObject *)PyArray_DESCR(input));
            goto done;
        }
    }
    /* The results first, then any copies of the arguments: a call that cannot have its
       results fails before it has spent memory on copies. */
    output = result_array(state, what, objs->out, "out", "the output", input, residual, &ax,
                          element_type_num(state, dtype));
    if (!output) {
        goto done;
    }
    if (returns == RETURN_SUM) {
        sum = result_array(state, what, objs->residual_out, "residual_out", "the sum", input, residual, &ax,
                           element_type_num(state, dtype));
        if (!sum) {
            goto done;
        }
        const int share = arrays_share_memory(state, output, sum);
        if (share == 1) {
            PyErr_SetString(PyExc_ValueError, "out and residual_out overlap: the output would overwrite the sum");
        }
        else if (share == 2) {
            PyErr_SetString(PyExc_ValueError,
                            "cannot tell whether out and residual_out overlap: numpy.shares_memory gave up "
                            "on their strides; pass arrays that do not share a buffer");
        }
        if (share != 0) {
            goto done;
        }
    }
    const int first_stat = 2 - kind->n_stats;  /* index into (mean, rstd) */
    if (returns == RETURN_STATS) {
        for (int s = first_stat; s < 2; s++) {
            stats[s] = stats_array(what, stat_names[s], input, &ax, param_type_num[dtype]);
            if (!stats[s]) {
                goto done;
            }
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
            stats[s] = stats_over_bytes(saved_stats,
                                        PyBytes_AS_STRING(saved_stats) + (s - first_stat) * layout.stat_bytes,
                                        input, &ax, param_type_num[dtype]);
            if (!stats[s]) {
                goto done;
            }
        }
        int kernel_fills;
        saved_input = private_input(state, objs->input, input, &kernel_fills);
        if (!saved_input) {
            allocation_failed(what, "the copy of the input saved for backward", PyArray_NDIM(input),
                              PyArray_DIMS(input), PyArray_TYPE(input));
            goto done;
        }
        if (kernel_fills) {
            copy = saved_input;
        }
        else {
            /* the kernel reads the private copy backward will read */
            Py_INCREF(saved_input);
            Py_SETREF(input, saved_input);
        }
        char *saved_param = PyBytes_AS_STRING(saved_stats) + kind->n_stats * layout.stat_bytes;
        for (int p = 0; p < kind->n_params; p++) {
            if (params[p]) {
                memcpy(saved_param, PyArray_DATA(params[p]), (size_t)layout.param_bytes);
                saved_param += layout.param_bytes;
            }
        }
    }
    /* A result may be written over an input element for element (in place), never over part
       of one, nor over a parameter.  Only the caller's (out=, residual_out=) can overlap one. */
    PyArrayObject *written[2] = {is_given(objs->out) ? output : NULL, is_given(objs->residual_out) ? sum : NULL};
    for (int w = 0; w < 2; w++) {
        if (!written[w]) {
            continue;
        }
        if (detach_from_result(&input, written[w], 1) < 0 || detach_from_result(&residual, written[w], 1) < 0) {
            /* the shape from the result: a failed detach has left its input NULL */
            allocation_failed(what, "a copy of an input that a result overlaps", PyArray_NDIM(written[w]),
                              PyArray_DIMS(written[w]), element_type_num(state, dtype));
            goto done;
        }
        for (int p = 0; p < kind->n_params; p++) {
            if (detach_from_result(&params[p], written[w], 0) < 0) {
                allocation_failed(what, param_names[p], ns.ndim, ns.dims, param_type_num[dtype]);
                goto done;
            }
        }
    }

    call_init(&call, input, &ax);
    enum { INPUT, RESIDUAL, SUM, OUTPUT, MEAN, RSTD, COPY };
    call_add(&call, input, "the input", 0, 0);
    call_add(&call, residual, "the residual", 0, 0);
    call_add(&call, sum, "the sum", 1, 0);
    call_add(&call, output, "the output", 1, 0);
    call_add(&call, stats[0], "the mean", 1, 1);
    call_add(&call, stats[1], "the rstd", 1, 1);
    call_add(&call, copy, "the copy of the input saved for backward", 1, 0);
    /* Nothing to write, nothing to compute: the kernel would still walk every empty row. */
    const int produces = PyArray_SIZE(output) > 0 || (returns != RETURN_OUTPUT && batch > 0);
    int status = 0;
    if (produces) {
        if (call_prepare(what, &call, sum ? SUM : INPUT) < 0) {
            goto done;
        }
        const ln_forward_args args = {
            .kind = kind->kernel,
            .dtype = (ln_dtype)dtype,
            .extent = call.extent,
            .input = call_array_at(&call, INPUT),
            .residual = call_array_at(&call, RESIDUAL),
            .sum = call_array_at(&call, SUM),
            .output = call_array_at(&call, OUTPUT),
            .weight = params[0] ? PyArray_DATA(params[0]) : NULL,
            .bias = params[1] ? PyArray_DATA(params[1]) : NULL,
            .eps = eps,
            .mean = call_array_at(&call, MEAN),
            .rstd = call_array_at(&call, RSTD),
            .copy = call_array_at(&call, COPY),
        };
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
    if (call_finish(&call) < 0) {
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
    case RETURN_SUM:
        result = PyTuple_Pack(2, (PyObject *)output, (PyObject *)sum);
        break;
    case RETURN_SAVED_FOR_GRAD:
        saved = PyTuple_Pack(2, (PyObject *)saved_input, saved_stats);
        result = saved ? PyTuple_Pack(2, (PyObject *)output, saved) : NULL;
        break;
    }
done:
    call_release(&call);
    Py_XDECREF(input);
    Py_XDECREF(residual);
    Py_XDECREF(output);
    Py_XDECREF(sum);
    Py_XDECREF(saved_input);
    Py_XDECREF(saved_stats);
    Py_XDECREF(saved);
    for (int i = 0; i < 2; i++) {
        Py_XDECREF(params[i]);
        Py_XDECREF(stats[i]);
    }
    return result;
}

/* 0 if the statistic `arr` (mean or rstd, converted from `obj`) handed to backward holds one
   float per row (bfloat16 too: torch returns them so for bfloat16 parameters), else -1 with an
   exception set.  source: the function that returns it, for the messages, or NULL. */
static int
stats_check(module_state *state, PyArrayObject *arr, PyObject *obj, const char *source, const char *name,
            npy_intp rows)
{
    const int is_float = is_float_array(state, arr);
    if (is_float < 0) {
        return -1;
    }
    const char *as = source ? ", as " : "", *returns = source ? " returns it" : "";
    if (!is_float) {
        PyErr_Format(PyExc_TypeError, "%s must be a float array%s%s%s; got %R of dtype %S", name, as,
                     source ? source : "", returns, obj == Py_None ? Py_None : (PyObject *)Py_TYPE(obj),
                     (PyObject *)PyArray_DESCR(arr));
        return -1;
    }
    if (PyArray_SIZE(arr) != rows) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be a float array with one value per normalized row (%zd)%s%s%s; got "
                     "%zd value%s of dtype %S",
                     name, (Py_ssize_t)rows, as, source ? source : "", returns, (Py_ssize_t)PyArray_SIZE(arr),
                     PyArray_SIZE(arr) == 1 ? "" : "s", (PyObject *)PyArray_DESCR(arr));
        return -1;
    }
    return 0;
}

/* New reference: the statistic `stats` (one value per row, any shape) with the statistics'
   shape and type type_num: a view where one will do, so a broadcast statistic stays
   broadcast, else a copy; NULL with an exception set. */
static PyArrayObject *
stats_shaped(const char *fname, const char *name, PyArrayObject *stats, PyArrayObject *input, const norm_axes *ax,
             int type_num)
{
    npy_intp dims[LN_MAX_DIMS];
    const int ndim = PyArray_NDIM(input);
    stats_dims(input, ax, dims);
    PyArrayObject *shaped;
    if (PyArray_NDIM(stats) == ndim && PyArray_CompareLists(PyArray_DIMS(stats), dims, ndim)) {
        Py_INCREF(stats);
        shaped = stats;
    }
    else {
        PyArray_Dims newshape = {dims, ndim};
        shaped = (PyArrayObject *)PyArray_Newshape(stats, &newshape, NPY_CORDER);
    }
    if (shaped && PyArray_TYPE(shaped) != type_num) {
        Py_SETREF(shaped, (PyArrayObject *)PyArray_FromArray(shaped, PyArray_DescrFromType(type_num),
                                                             NPY_ARRAY_ALIGNED | NPY_ARRAY_FORCECAST));
    }
    if (!shaped) {
        allocation_failed(fname, name, ndim, dims, type_num);
    }
    return shaped;
}

/* The arguments of one backward call, as the Python-facing functions received them: the
   kind's statistics either as objects (stats) or as the bytes training_forward saved. */
typedef struct {
    PyObject *grad_output, *input, *axis;
    PyObject *const *stats;   /* the kind's n_stats statistics, or NULL */
    PyObject *saved_stats;    /* with stats NULL */
    PyObject *const *params;  /* the kind's n_params parameters */
} backward_objs;

/* New reference: (grad_input, *grad_params), or NULL with an exception set; mask holds the
   kind's 1 + n_params output_mask entries. */
static PyObject *
backward(module_state *state, const norm_kind *kind, const char *what, const backward_objs *objs,
         const shape_t *ns_arg, const int mask[])
{
    PyObject *result = NULL, *got = NULL, *want = NULL;
    PyArrayObject *input = NULL, *grad_out = NULL, *grad_input = NULL;
    PyArrayObject *params[2] = {NULL, NULL}, *stats[2] = {NULL, NULL}, *grad_params[2] = {NULL, NULL};
    kernel_call call;
    call.n = 0;  /* for call_release, should the call end before call_init */
    shape_t ns = *ns_arg;
    axis_arg axis;
    norm_axes ax;

    /* Every conversion before any look at an array, as in forward: a grad_output or a
       statistic whose __array__ reshaped the input made the kernel walk rows longer than the
       weight. */
    if (!(input = as_array(objs->input)) || !(grad_out = as_array(objs->grad_output))) {
        goto done;
    }
    const int first_stat = 2 - kind->n_stats;  /* index into (mean, rstd) */
    for (int s = first_stat; objs->stats && s < 2; s++) {
        stats[s] = as_array(objs->stats[s - first_stat]);
        if (!stats[s]) {
            goto done;
        }
    }
    for (int p = 0; p < kind->n_params; p++) {
        if (param_object_array(objs->params[p], param_names[p], &params[p]) < 0) {
            goto done;
        }
    }
    if (parse_axis(objs->axis, &ns, &axis) < 0) {
        goto done;
    }
    const int dtype = kernel_dtype(state, input, what);
    if (dtype < 0) {
        goto done;
    }
    /* a module's backward compares the parameters' bytes with those its forward saved */
    const int params_read = PyArray_SIZE(input) > 0 || !objs->stats;
    for (int p = 0; p < kind->n_params; p++) {
        if (param_checked(state, what, param_names[p], &ns, param_type_num[dtype], params_read, &params[p]) < 0) {
            goto done;
        }
    }
    npy_intp rows;
    if (resolve_axes(state, kind->kernel, &axis, input, &ns, &ax) < 0 || batch_size(input, &ax, &rows) < 0) {
        goto done;
    }
    const int is_float = is_float_array(state, grad_out);
    if (is_float < 0) {
        goto done;
    }
    if (!is_float) {
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
    if (objs->stats) {
        for (int s = first_stat; s < 2; s++) {
            if (stats_check(state, stats[s], objs->stats[s - first_stat], kind->stats_source, stat_names[s],
                            rows) < 0) {
                goto done;
            }
        }
    }
    else {
        saved_layout layout;
        if (!PyBytes_Check(objs->saved_stats) ||
            saved_layout_of(kind, dtype, rows, ns.size, count_given(kind, params), &layout) < 0 ||
            PyBytes_GET_SIZE(objs->saved_stats) != layout.total) {
            PyErr_SetString(PyExc_ValueError,
                            "stats must be the bytes that training_forward returned with this input "
                            "and these parameters");
            goto done;
        }
        const char *saved_param = PyBytes_AS_STRING(objs->saved_stats) + kind->n_stats * layout.stat_bytes;
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
        for (int s = first_stat; s < 2; s++) {
            stats[s] = stats_over_bytes(objs->saved_stats,
                                        PyBytes_AS_STRING(objs->saved_stats) + (s - first_stat) * layout.stat_bytes,
                                        input, &ax, param_type_num[dtype]);
            if (!stats[s]) {
                goto done;
            }
        }
    }
    /* The results first, then any copies of the arguments: a call that cannot have its
       results fails before it has spent memory on copies (broadcast statistics of 2**30
       rows were 8 GiB of copies before grad_input's MemoryError). */
    if (mask[0]) {
        grad_input = new_result(state, what, "grad_input", input, grad_out, &ax, element_type_num(state, dtype));
        if (!grad_input) {
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
        for (int s = first_stat; s < 2; s++) {
            Py_SETREF(stats[s], stats_shaped(what, stat_names[s], stats[s], input, &ax, param_type_num[dtype]));
            if (!stats[s]) {
                goto done;
            }
        }
        if (PyArray_TYPE(grad_out) != PyArray_TYPE(input)) {
            Py_SETREF(grad_out, (PyArrayObject *)PyArray_FromArray(
                                    grad_out, PyArray_DescrFromType(PyArray_TYPE(input)),
                                    NPY_ARRAY_ALIGNED | NPY_ARRAY_FORCECAST));
            if (!grad_out) {
                allocation_failed(what, "grad_output in the input's dtype", PyArray_NDIM(input),
                                  PyArray_DIMS(input), PyArray_TYPE(input));
                goto done;
            }
        }
        call_init(&call, input, &ax);
        enum { GRAD_OUTPUT, INPUT, MEAN, RSTD, GRAD_INPUT };
        call_add(&call, grad_out, "grad_output", 0, 0);
        call_add(&call, input, "the input", 0, 0);
        call_add(&call, stats[0], "the mean", 0, 1);
        call_add(&call, stats[1], "the rstd", 0, 1);
        call_add(&call, grad_input, "grad_input", 1, 0);
        if (call_prepare(what, &call, INPUT) < 0) {
            goto done;
        }
        const ln_backward_args args = {
            .kind = kind->kernel,
            .dtype = (ln_dtype)dtype,
            .extent = call.extent,
            .grad_output = call_array_at(&call, GRAD_OUTPUT),
            .input = call_array_at(&call, INPUT),
            .mean = call_array_at(&call, MEAN),
            .rstd = call_array_at(&call, RSTD),
            .weight = params[0] ? PyArray_DATA(params[0]) : NULL,
            .grad_input = call_array_at(&call, GRAD_INPUT),
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
    if (call_finish(&call) < 0) {
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
    call_release(&call);
    Py_XDECREF(got);
    Py_XDECREF(want);
    Py_XDECREF(input);
    Py_XDECREF(grad_out);
    Py_XDECREF(grad_input);
    for (int i = 0; i < 2; i++) {
        Py_XDECREF(params[i]);
        Py_XDECREF(stats[i]);
        Py_XDECREF(grad_params[i]);
    }
    return result;
}

/* ------------------------------------------------------------------------ */
/* Python-facing functions: the norm family                                  */
/* ------------------------------------------------------------------------ */

/* Each function takes its parameters as consecutive arguments (weight[, bias]), so &v[WEIGHT]
   is the params array forward() and backward() want; axis=, out= and residual_out= are
   keyword-only. */

PyDoc_STRVAR(layer_norm_doc,
"layer_norm($module, input, normalized_shape, weight=None, bias=None, eps=1e-05, *, axis=None,\n"
"           out=None)\n"
"--\n"
"\n"
"Layer normalization over the last len(normalized_shape) dimensions (or the axes axis=\n"
"names), as torch.nn.functional.layer_norm: the core of layernorm.layer_norm.\n");

static PyObject *
layer_norm(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { INPUT, NORMALIZED_SHAPE, WEIGHT, BIAS, EPS, AXIS, OUT, N };
    static const keyword_id keywords[N] = {KW_INPUT, KW_NORMALIZED_SHAPE, KW_WEIGHT, KW_BIAS,
                                           KW_EPS, KW_AXIS, KW_OUT};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "layer_norm", args, nargs, kwnames, keywords, N, EPS + 1, 2, v) < 0) {
        return NULL;
    }
    const forward_objs objs = {.input = v[INPUT], .normalized_shape = v[NORMALIZED_SHAPE], .params = &v[WEIGHT],
                               .eps = v[EPS], .axis = v[AXIS], .out = v[OUT]};
    return forward(state, &layer_norm_kind, "layer_norm", &objs, RETURN_OUTPUT);
}

PyDoc_STRVAR(native_layer_norm_doc,
"native_layer_norm($module, input, normalized_shape, weight=None, bias=None, eps=1e-05, *,\n"
"                  axis=None)\n"
"--\n"
"\n"
"layer_norm that also returns its statistics, (output, mean, rstd), as\n"
"torch.native_layer_norm: the core of layernorm.native_layer_norm.\n");

static PyObject *
native_layer_norm(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { INPUT, NORMALIZED_SHAPE, WEIGHT, BIAS, EPS, AXIS, N };
    static const keyword_id keywords[N] = {KW_INPUT, KW_NORMALIZED_SHAPE, KW_WEIGHT, KW_BIAS, KW_EPS, KW_AXIS};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "native_layer_norm", args, nargs, kwnames, keywords, N, EPS + 1, 2, v) < 0) {
        return NULL;
    }
    const forward_objs objs = {.input = v[INPUT], .normalized_shape = v[NORMALIZED_SHAPE], .params = &v[WEIGHT],
                               .eps = v[EPS], .axis = v[AXIS]};
    return forward(state, &layer_norm_kind, "native_layer_norm", &objs, RETURN_STATS);
}

PyDoc_STRVAR(add_layer_norm_doc,
"add_layer_norm($module, input, residual, normalized_shape, weight=None, bias=None, eps=1e-05,\n"
"               *, axis=None, out=None, residual_out=None)\n"
"--\n"
"\n"
"(layer_norm(input + residual, ...), input + residual) in one pass over memory: the core\n"
"of layernorm.add_layer_norm.\n");

static PyObject *
add_layer_norm(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { INPUT, RESIDUAL, NORMALIZED_SHAPE, WEIGHT, BIAS, EPS, AXIS, OUT, RESIDUAL_OUT, N };
    static const keyword_id keywords[N] = {KW_INPUT, KW_RESIDUAL, KW_NORMALIZED_SHAPE, KW_WEIGHT, KW_BIAS,
                                           KW_EPS, KW_AXIS, KW_OUT, KW_RESIDUAL_OUT};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "add_layer_norm", args, nargs, kwnames, keywords, N, EPS + 1, 3, v) < 0) {
        return NULL;
    }
    const forward_objs objs = {.input = v[INPUT], .residual = v[RESIDUAL], .normalized_shape = v[NORMALIZED_SHAPE],
                               .params = &v[WEIGHT], .eps = v[EPS], .axis = v[AXIS], .out = v[OUT],
                               .residual_out = v[RESIDUAL_OUT]};
    return forward(state, &layer_norm_kind, "add_layer_norm", &objs, RETURN_SUM);
}

PyDoc_STRVAR(training_forward_doc,
"training_forward($module, input, normalized_shape, weight=None, bias=None, eps=1e-05, *,\n"
"                 axis=None)\n"
"--\n"
"\n"
"native_layer_norm that also returns what saved_backward needs to read later:\n"
"(output, (input, stats)), where input holds the input's values, in its memory order, in\n"
"an array that nothing else refers to (the array made from a list when there is one, else\n"
"a copy), so that changing the caller's array afterwards cannot change the gradients,\n"
"and stats is a bytes object holding the mean and then the rstd of every row, then the\n"
"weight and the bias as the kernel read them.  Used by LayerNorm in training mode.\n");

static PyObject *
training_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { INPUT, NORMALIZED_SHAPE, WEIGHT, BIAS, EPS, AXIS, N };
    static const keyword_id keywords[N] = {KW_INPUT, KW_NORMALIZED_SHAPE, KW_WEIGHT, KW_BIAS, KW_EPS, KW_AXIS};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "training_forward", args, nargs, kwnames, keywords, N, EPS + 1, 2, v) < 0) {
        return NULL;
    }
    const forward_objs objs = {.input = v[INPUT], .normalized_shape = v[NORMALIZED_SHAPE], .params = &v[WEIGHT],
                               .eps = v[EPS], .axis = v[AXIS]};
    return forward(state, &layer_norm_kind, layer_norm_kind.module_name, &objs, RETURN_SAVED_FOR_GRAD);
}

PyDoc_STRVAR(layer_norm_backward_doc,
"layer_norm_backward($module, grad_output, input, normalized_shape, mean, rstd, weight=None,\n"
"                    bias=None, output_mask=(True, True, True), *, axis=None)\n"
"--\n"
"\n"
"Gradients of layer_norm, (grad_input, grad_weight, grad_bias), as\n"
"torch.ops.aten.native_layer_norm_backward: the core of layernorm.layer_norm_backward.\n");

static PyObject *
layer_norm_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { GRAD_OUTPUT, INPUT, NORMALIZED_SHAPE, MEAN, RSTD, WEIGHT, BIAS, OUTPUT_MASK, AXIS, N };
    static const keyword_id keywords[N] = {KW_GRAD_OUTPUT, KW_INPUT, KW_NORMALIZED_SHAPE, KW_MEAN, KW_RSTD,
                                           KW_WEIGHT, KW_BIAS, KW_OUTPUT_MASK, KW_AXIS};
    module_state *state = get_state(module);
    PyObject *v[N];
    shape_t ns;
    int mask[3];
    if (parse_args(state, "layer_norm_backward", args, nargs, kwnames, keywords, N, OUTPUT_MASK + 1, RSTD + 1,
                   v) < 0 ||
        parse_normalized_shape(v[NORMALIZED_SHAPE], &ns) < 0 ||
        parse_output_mask(v[OUTPUT_MASK], 1 + layer_norm_kind.n_params, mask) < 0) {
        return NULL;
    }
    const backward_objs objs = {.grad_output = v[GRAD_OUTPUT], .input = v[INPUT], .axis = v[AXIS],
                                .stats = &v[MEAN], .params = &v[WEIGHT]};
    return backward(state, &layer_norm_kind, "layer_norm_backward", &objs, &ns, mask);
}

PyDoc_STRVAR(saved_backward_doc,
"saved_backward($module, grad_output, input, stats, normalized_shape, weight=None, bias=None,\n"
"               output_mask=(True, True, True), *, axis=None)\n"
"--\n"
"\n"
"layer_norm_backward from what training_forward saved: (input, stats), stats its bytes.\n"
"weight and bias must be given as they were to training_forward: a parameter whose values\n"
"differ from the saved ones raises ParameterChangedError.  Used by LayerNorm.backward.\n");

static PyObject *
saved_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { GRAD_OUTPUT, INPUT, STATS, NORMALIZED_SHAPE, WEIGHT, BIAS, OUTPUT_MASK, AXIS, N };
    static const keyword_id keywords[N] = {KW_GRAD_OUTPUT, KW_INPUT, KW_STATS, KW_NORMALIZED_SHAPE,
                                           KW_WEIGHT, KW_BIAS, KW_OUTPUT_MASK, KW_AXIS};
    module_state *state = get_state(module);
    PyObject *v[N];
    shape_t ns;
    int mask[3];
    if (parse_args(state, "saved_backward", args, nargs, kwnames, keywords, N, OUTPUT_MASK + 1,
                   NORMALIZED_SHAPE + 1, v) < 0 ||
        parse_normalized_shape(v[NORMALIZED_SHAPE], &ns) < 0 ||
        parse_output_mask(v[OUTPUT_MASK], 1 + layer_norm_kind.n_params, mask) < 0) {
        return NULL;
    }
    const backward_objs objs = {.grad_output = v[GRAD_OUTPUT], .input = v[INPUT], .axis = v[AXIS],
                                .saved_stats = v[STATS], .params = &v[WEIGHT]};
    return backward(state, &layer_norm_kind, layer_norm_kind.module_name, &objs, &ns, mask);
}

PyDoc_STRVAR(rms_norm_doc,
"rms_norm($module, input, normalized_shape, weight=None, eps=None, *, axis=None, out=None)\n"
"--\n"
"\n"
"RMS normalization over the last len(normalized_shape) dimensions (or the axes axis=\n"
"names), as torch.nn.functional.rms_norm: the core of layernorm.rms_norm.\n");

static PyObject *
rms_norm(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { INPUT, NORMALIZED_SHAPE, WEIGHT, EPS, AXIS, OUT, N };
    static const keyword_id keywords[N] = {KW_INPUT, KW_NORMALIZED_SHAPE, KW_WEIGHT, KW_EPS, KW_AXIS, KW_OUT};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "rms_norm", args, nargs, kwnames, keywords, N, EPS + 1, 2, v) < 0) {
        return NULL;
    }
    const forward_objs objs = {.input = v[INPUT], .normalized_shape = v[NORMALIZED_SHAPE], .params = &v[WEIGHT],
                               .eps = v[EPS], .axis = v[AXIS], .out = v[OUT]};
    return forward(state, &rms_norm_kind, "rms_norm", &objs, RETURN_OUTPUT);
}

PyDoc_STRVAR(native_rms_norm_doc,
"native_rms_norm($module, input, normalized_shape, weight=None, eps=None, *, axis=None)\n"
"--\n"
"\n"
"rms_norm that also returns its statistic, (output, rstd), as\n"
"torch.ops.aten._fused_rms_norm: the core of layernorm.native_rms_norm.\n");

static PyObject *
native_rms_norm(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { INPUT, NORMALIZED_SHAPE, WEIGHT, EPS, AXIS, N };
    static const keyword_id keywords[N] = {KW_INPUT, KW_NORMALIZED_SHAPE, KW_WEIGHT, KW_EPS, KW_AXIS};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "native_rms_norm", args, nargs, kwnames, keywords, N, EPS + 1, 2, v) < 0) {
        return NULL;
    }
    const forward_objs objs = {.input = v[INPUT], .normalized_shape = v[NORMALIZED_SHAPE], .params = &v[WEIGHT],
                               .eps = v[EPS], .axis = v[AXIS]};
    return forward(state, &rms_norm_kind, "native_rms_norm", &objs, RETURN_STATS);
}

PyDoc_STRVAR(add_rms_norm_doc,
"add_rms_norm($module, input, residual, normalized_shape, weight=None, eps=None, *, axis=None,\n"
"             out=None, residual_out=None)\n"
"--\n"
"\n"
"(rms_norm(input + residual, ...), input + residual) in one pass over memory: the core of\n"
"layernorm.add_rms_norm.\n");

static PyObject *
add_rms_norm(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { INPUT, RESIDUAL, NORMALIZED_SHAPE, WEIGHT, EPS, AXIS, OUT, RESIDUAL_OUT, N };
    static const keyword_id keywords[N] = {KW_INPUT, KW_RESIDUAL, KW_NORMALIZED_SHAPE, KW_WEIGHT,
                                           KW_EPS, KW_AXIS, KW_OUT, KW_RESIDUAL_OUT};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "add_rms_norm", args, nargs, kwnames, keywords, N, EPS + 1, 3, v) < 0) {
        return NULL;
    }
    const forward_objs objs = {.input = v[INPUT], .residual = v[RESIDUAL], .normalized_shape = v[NORMALIZED_SHAPE],
                               .params = &v[WEIGHT], .eps = v[EPS], .axis = v[AXIS], .out = v[OUT],
                               .residual_out = v[RESIDUAL_OUT]};
    return forward(state, &rms_norm_kind, "add_rms_norm", &objs, RETURN_SUM);
}

PyDoc_STRVAR(rms_training_forward_doc,
"rms_training_forward($module, input, normalized_shape, weight=None, eps=None, *, axis=None)\n"
"--\n"
"\n"
"training_forward for RMSNorm: (output, (input, stats)), stats holding the rstd of every\n"
"row and then the weight.  Used by RMSNorm in training mode.\n");

static PyObject *
rms_training_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { INPUT, NORMALIZED_SHAPE, WEIGHT, EPS, AXIS, N };
    static const keyword_id keywords[N] = {KW_INPUT, KW_NORMALIZED_SHAPE, KW_WEIGHT, KW_EPS, KW_AXIS};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "rms_training_forward", args, nargs, kwnames, keywords, N, EPS + 1, 2, v) < 0) {
        return NULL;
    }
    const forward_objs objs = {.input = v[INPUT], .normalized_shape = v[NORMALIZED_SHAPE], .params = &v[WEIGHT],
                               .eps = v[EPS], .axis = v[AXIS]};
    return forward(state, &rms_norm_kind, rms_norm_kind.module_name, &objs, RETURN_SAVED_FOR_GRAD);
}

PyDoc_STRVAR(rms_norm_backward_doc,
"rms_norm_backward($module, grad_output, input, normalized_shape, rstd, weight=None,\n"
"                  output_mask=(True, True), *, axis=None)\n"
"--\n"
"\n"
"Gradients of rms_norm, (grad_input, grad_weight), as\n"
"torch.ops.aten._fused_rms_norm_backward: the core of layernorm.rms_norm_backward.\n");

static PyObject *
rms_norm_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { GRAD_OUTPUT, INPUT, NORMALIZED_SHAPE, RSTD, WEIGHT, OUTPUT_MASK, AXIS, N };
    static const keyword_id keywords[N] = {KW_GRAD_OUTPUT, KW_INPUT, KW_NORMALIZED_SHAPE, KW_RSTD,
                                           KW_WEIGHT, KW_OUTPUT_MASK, KW_AXIS};
    module_state *state = get_state(module);
    PyObject *v[N];
    shape_t ns;
    int mask[2];
    if (parse_args(state, "rms_norm_backward", args, nargs, kwnames, keywords, N, OUTPUT_MASK + 1, RSTD + 1,
                   v) < 0 ||
        parse_normalized_shape(v[NORMALIZED_SHAPE], &ns) < 0 ||
        parse_output_mask(v[OUTPUT_MASK], 1 + rms_norm_kind.n_params, mask) < 0) {
        return NULL;
    }
    const backward_objs objs = {.grad_output = v[GRAD_OUTPUT], .input = v[INPUT], .axis = v[AXIS],
                                .stats = &v[RSTD], .params = &v[WEIGHT]};
    return backward(state, &rms_norm_kind, "rms_norm_backward", &objs, &ns, mask);
}

PyDoc_STRVAR(rms_saved_backward_doc,
"rms_saved_backward($module, grad_output, input, stats, normalized_shape, weight=None,\n"
"                   output_mask=(True, True), *, axis=None)\n"
"--\n"
"\n"
"rms_norm_backward from what rms_training_forward saved.  Used by RMSNorm.backward.\n");

static PyObject *
rms_saved_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { GRAD_OUTPUT, INPUT, STATS, NORMALIZED_SHAPE, WEIGHT, OUTPUT_MASK, AXIS, N };
    static const keyword_id keywords[N] = {KW_GRAD_OUTPUT, KW_INPUT, KW_STATS, KW_NORMALIZED_SHAPE,
                                           KW_WEIGHT, KW_OUTPUT_MASK, KW_AXIS};
    module_state *state = get_state(module);
    PyObject *v[N];
    shape_t ns;
    int mask[2];
    if (parse_args(state, "rms_saved_backward", args, nargs, kwnames, keywords, N, OUTPUT_MASK + 1,
                   NORMALIZED_SHAPE + 1, v) < 0 ||
        parse_normalized_shape(v[NORMALIZED_SHAPE], &ns) < 0 ||
        parse_output_mask(v[OUTPUT_MASK], 1 + rms_norm_kind.n_params, mask) < 0) {
        return NULL;
    }
    const backward_objs objs = {.grad_output = v[GRAD_OUTPUT], .input = v[INPUT], .axis = v[AXIS],
                                .saved_stats = v[STATS], .params = &v[WEIGHT]};
    return backward(state, &rms_norm_kind, rms_norm_kind.module_name, &objs, &ns, mask);
}

/* ------------------------------------------------------------------------ */
/* Python-facing functions: rows split across arrays (private)               */
/* ------------------------------------------------------------------------ */

/* layernorm._dask's chunks of an array whose normalized axes are cut into parts: each part's
   moments (merged there), then each part normalized with the merged statistics; backward, each
   part's row sums (added up there), then its grad_input from their means.  In NumPy terms, for
   a part x of each row (float64 results of the statistics' shape), g = grad_output * weight and
   xhat = (x - mean) * rstd:

       m2 = ((x - x.mean()) ** 2).sum()       # RMSNorm: (x ** 2).sum(), and no mean
       output = (x - mean) * rstd * weight + bias
       g_sum, g_xhat_sum = g.sum(), (g * xhat).sum()                 # RMSNorm: no g_sum
       grad_input = rstd * (g - g_mean - xhat * g_xhat_mean)         # RMSNorm: no g_mean

   as the ln_part_* entry points compute them.  normalized_shape is the part's. */

/* The arguments of one part call, as the Python-facing functions received them. */
typedef struct {
    PyObject *input, *normalized_shape, *axis;
    PyObject *const *stats;   /* normalize: the kind's n_stats statistics */
    PyObject *const *params;  /* normalize: the kind's n_params parameters */
    PyObject *scale;          /* normalize: the statistics' units, or NULL or None for ones */
    PyObject *row_len;        /* normalize: the whole row's length, or NULL or None for the part's */
} part_objs;

/* New reference: (mean, m2, scale) for a centred kind, (m2, scale) for RMSNorm, or NULL with
   an exception set. */
static PyObject *
part_moments(module_state *state, const norm_kind *kind, const char *what, const part_objs *objs)
{
    PyObject *result = NULL;
    PyArrayObject *input = NULL, *mean = NULL, *m2 = NULL, *scale = NULL;
    kernel_call call;
    call.n = 0;  /* for call_release, should the call end before call_init */
    shape_t ns;
    axis_arg axis;
    norm_axes ax;
    npy_intp rows;

    if (parse_normalized_shape(objs->normalized_shape, &ns) < 0 || !(input = as_array(objs->input)) ||
        parse_axis(objs->axis, &ns, &axis) < 0) {
        goto done;
    }
    const int dtype = kernel_dtype(state, input, what);
    if (dtype < 0 || resolve_axes(state, kind->kernel, &axis, input, &ns, &ax) < 0 ||
        batch_size(input, &ax, &rows) < 0) {
        goto done;
    }
    if (kind->n_stats == 2) {
        mean = stats_array(what, "mean", input, &ax, NPY_DOUBLE);
        if (!mean) {
            goto done;
        }
    }
    m2 = stats_array(what, "m2", input, &ax, NPY_DOUBLE);
    if (!m2) {
        goto done;
    }
    scale = stats_array(what, "scale", input, &ax, NPY_DOUBLE);
    if (!scale) {
        goto done;
    }
    call_init(&call, input, &ax);
    enum { INPUT, MEAN, M2, SCALE };
    call_add(&call, input, "the input", 0, 0);
    call_add(&call, mean, "the mean", 1, 1);
    call_add(&call, m2, "m2", 1, 1);
    call_add(&call, scale, "the scale", 1, 1);
    if (call_prepare(what, &call, INPUT) < 0) {
        goto done;
    }
    const ln_part_moments_args args = {
        .kind = kind->kernel,
        .dtype = (ln_dtype)dtype,
        .extent = call.extent,
        .input = call_array_at(&call, INPUT),
        .mean = call_array_at(&call, MEAN),
        .m2 = call_array_at(&call, M2),
        .scale = call_array_at(&call, SCALE),
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = ln_part_moments(&args);
    Py_END_ALLOW_THREADS
    if (status < 0) {
        PyErr_Format(PyExc_MemoryError, "%s: the kernel could not allocate its scratch memory for %zd "
                     "rows of %zd elements",
                     what, (Py_ssize_t)rows, (Py_ssize_t)ns.size);
        goto done;
    }
    if (call_finish(&call) < 0) {
        goto done;
    }
    result = mean ? PyTuple_Pack(3, (PyObject *)mean, (PyObject *)m2, (PyObject *)scale)
                  : PyTuple_Pack(2, (PyObject *)m2, (PyObject *)scale);
done:
    call_release(&call);
    Py_XDECREF(input);
    Py_XDECREF(mean);
    Py_XDECREF(m2);
    Py_XDECREF(scale);
    return result;
}

/* New reference: the part normalized with the statistics given (float64 values, one per row,
   any shape), or NULL with an exception set. */
static PyObject *
part_normalize(module_state *state, const norm_kind *kind, const char *what, const part_objs *objs)
{
    PyObject *result = NULL;
    PyArrayObject *input = NULL, *output = NULL, *scale = NULL;
    PyArrayObject *params[2] = {NULL, NULL}, *stats[2] = {NULL, NULL};
    kernel_call call;
    call.n = 0;  /* for call_release, should the call end before call_init */
    shape_t ns;
    axis_arg axis;
    norm_axes ax;
    npy_intp rows;
    Py_ssize_t row_len = 0;

    /* every conversion before any look at an array (see forward) */
    if (parse_normalized_shape(objs->normalized_shape, &ns) < 0 || !(input = as_array(objs->input))) {
        goto done;
    }
    const int first_stat = 2 - kind->n_stats;  /* index into (mean, rstd) */
    for (int s = first_stat; s < 2; s++) {
        stats[s] = as_array(objs->stats[s - first_stat]);
        if (!stats[s]) {
            goto done;
        }
    }
    if (is_given(objs->scale) && !(scale = as_array(objs->scale))) {
        goto done;
    }
    for (int p = 0; p < kind->n_params; p++) {
        if (param_object_array(objs->params[p], param_names[p], &params[p]) < 0) {
            goto done;
        }
    }
    if (parse_axis(objs->axis, &ns, &axis) < 0) {
        goto done;
    }
    if (is_given(objs->row_len)) {
        row_len = PyNumber_AsSsize_t(objs->row_len, PyExc_OverflowError);
        if (row_len == -1 && PyErr_Occurred()) {
            goto done;
        }
    }
    const int dtype = kernel_dtype(state, input, what);
    if (dtype < 0) {
        goto done;
    }
    const int params_read = PyArray_SIZE(input) > 0;
    for (int p = 0; p < kind->n_params; p++) {
        if (param_checked(state, what, param_names[p], &ns, param_type_num[dtype], params_read, &params[p]) < 0) {
            goto done;
        }
    }
    if (resolve_axes(state, kind->kernel, &axis, input, &ns, &ax) < 0 || batch_size(input, &ax, &rows) < 0) {
        goto done;
    }
    if (!is_given(objs->row_len)) {
        row_len = (Py_ssize_t)ns.size;
    }
    else {
        if (row_len < (Py_ssize_t)ns.size) {
            PyErr_Format(PyExc_ValueError, "%s: row_len must be the whole row's length, at least the part's "
                         "(%zd); got %zd", what, (Py_ssize_t)ns.size, row_len);
            goto done;
        }
    }
    for (int s = first_stat; s < 2; s++) {
        if (stats_check(state, stats[s], objs->stats[s - first_stat], NULL, stat_names[s], rows) < 0) {
            goto done;
        }
        Py_SETREF(stats[s], stats_shaped(what, stat_names[s], stats[s], input, &ax, NPY_DOUBLE));
        if (!stats[s]) {
            goto done;
        }
    }
    if (scale) {
        if (stats_check(state, scale, objs->scale, NULL, "scale", rows) < 0) {
            goto done;
        }
        Py_SETREF(scale, stats_shaped(what, "scale", scale, input, &ax, NPY_DOUBLE));
        if (!scale) {
            goto done;
        }
    }
    output = new_result(state, what, "the output", input, NULL, &ax, element_type_num(state, dtype));
    if (!output) {
        goto done;
    }
    call_init(&call, input, &ax);
    enum { INPUT, OUTPUT, MEAN, RSTD, SCALE };
    call_add(&call, input, "the input", 0, 0);
    call_add(&call, output, "the output", 1, 0);
    call_add(&call, stats[0], "the mean", 0, 1);
    call_add(&call, stats[1], "the rstd", 0, 1);
    call_add(&call, scale, "the scale", 0, 1);
    if (call_prepare(what, &call, INPUT) < 0) {
        goto done;
    }
    const ln_part_normalize_args args = {
        .kind = kind->kernel,
        .dtype = (ln_dtype)dtype,
        .extent = call.extent,
        .input = call_array_at(&call, INPUT),
        .output = call_array_at(&call, OUTPUT),
        .weight = params[0] ? PyArray_DATA(params[0]) : NULL,
        .bias = params[1] ? PyArray_DATA(params[1]) : NULL,
        .mean = call_array_at(&call, MEAN),
        .rstd = call_array_at(&call, RSTD),
        .scale = call_array_at(&call, SCALE),
        .row_len = row_len,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = ln_part_normalize(&args);
    Py_END_ALLOW_THREADS
    if (status < 0) {
        PyErr_Format(PyExc_MemoryError, "%s: the kernel could not allocate its scratch memory for %zd "
                     "rows of %zd elements",
                     what, (Py_ssize_t)rows, (Py_ssize_t)ns.size);
        goto done;
    }
    if (call_finish(&call) < 0) {
        goto done;
    }
    Py_INCREF(output);
    result = (PyObject *)output;
done:
    call_release(&call);
    Py_XDECREF(input);
    Py_XDECREF(output);
    Py_XDECREF(scale);
    for (int i = 0; i < 2; i++) {
        Py_XDECREF(params[i]);
        Py_XDECREF(stats[i]);
    }
    return result;
}

PyDoc_STRVAR(layer_norm_part_moments_doc,
"_layer_norm_part_moments($module, input, normalized_shape, *, axis=None)\n"
"--\n"
"\n"
"(mean, m2, scale) of each row's part in input, float64: its mean and the sum of its squared\n"
"deviations from it, as layer_norm takes them, in units of scale (a power of two, 1 but for\n"
"parts of extreme magnitude) (private: for layernorm._dask).\n");

static PyObject *
layer_norm_part_moments(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { INPUT, NORMALIZED_SHAPE, AXIS, N };
    static const keyword_id keywords[N] = {KW_INPUT, KW_NORMALIZED_SHAPE, KW_AXIS};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "_layer_norm_part_moments", args, nargs, kwnames, keywords, N, AXIS, 2, v) < 0) {
        return NULL;
    }
    const part_objs objs = {.input = v[INPUT], .normalized_shape = v[NORMALIZED_SHAPE], .axis = v[AXIS]};
    return part_moments(state, &layer_norm_kind, "_layer_norm_part_moments", &objs);
}

PyDoc_STRVAR(layer_norm_part_normalize_doc,
"_layer_norm_part_normalize($module, input, normalized_shape, mean, rstd, weight=None, bias=None,\n"
"                           *, axis=None, scale=None, row_len=None)\n"
"--\n"
"\n"
"(input - mean) * rstd * weight + bias with the rows' statistics given (float64), as\n"
"layer_norm computes it from its own; mean and rstd in units of scale (mean / scale and\n"
"rstd * scale) where it is given; row_len: the whole row's length (private: for\n"
"layernorm._dask).\n");

static PyObject *
layer_norm_part_normalize(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { INPUT, NORMALIZED_SHAPE, MEAN, RSTD, WEIGHT, BIAS, AXIS, SCALE, ROW_LEN, N };
    static const keyword_id keywords[N] = {KW_INPUT, KW_NORMALIZED_SHAPE, KW_MEAN, KW_RSTD,
                                           KW_WEIGHT, KW_BIAS, KW_AXIS, KW_SCALE, KW_ROW_LEN};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "_layer_norm_part_normalize", args, nargs, kwnames, keywords, N, AXIS, 4, v) < 0) {
        return NULL;
    }
    const part_objs objs = {.input = v[INPUT], .normalized_shape = v[NORMALIZED_SHAPE], .axis = v[AXIS],
                            .stats = &v[MEAN], .params = &v[WEIGHT], .scale = v[SCALE], .row_len = v[ROW_LEN]};
    return part_normalize(state, &layer_norm_kind, "_layer_norm_part_normalize", &objs);
}

PyDoc_STRVAR(rms_norm_part_moments_doc,
"_rms_norm_part_moments($module, input, normalized_shape, *, axis=None)\n"
"--\n"
"\n"
"(m2, scale) of each row's part in input, float64: the sum of its squares, as rms_norm takes\n"
"it, in units of scale (a power of two, 1 but for parts of extreme magnitude) (private: for\n"
"layernorm._dask).\n");

static PyObject *
rms_norm_part_moments(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { INPUT, NORMALIZED_SHAPE, AXIS, N };
    static const keyword_id keywords[N] = {KW_INPUT, KW_NORMALIZED_SHAPE, KW_AXIS};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "_rms_norm_part_moments", args, nargs, kwnames, keywords, N, AXIS, 2, v) < 0) {
        return NULL;
    }
    const part_objs objs = {.input = v[INPUT], .normalized_shape = v[NORMALIZED_SHAPE], .axis = v[AXIS]};
    return part_moments(state, &rms_norm_kind, "_rms_norm_part_moments", &objs);
}

PyDoc_STRVAR(rms_norm_part_normalize_doc,
"_rms_norm_part_normalize($module, input, normalized_shape, rstd, weight=None, *, axis=None,\n"
"                         scale=None, row_len=None)\n"
"--\n"
"\n"
"input * rstd * weight with the rows' rstd given (float64), as rms_norm computes it from\n"
"its own; rstd in units of scale (rstd * scale) where it is given; row_len: the whole row's\n"
"length (private: for layernorm._dask).\n");

static PyObject *
rms_norm_part_normalize(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { INPUT, NORMALIZED_SHAPE, RSTD, WEIGHT, AXIS, SCALE, ROW_LEN, N };
    static const keyword_id keywords[N] = {KW_INPUT, KW_NORMALIZED_SHAPE, KW_RSTD, KW_WEIGHT, KW_AXIS, KW_SCALE,
                                           KW_ROW_LEN};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "_rms_norm_part_normalize", args, nargs, kwnames, keywords, N, AXIS, 3, v) < 0) {
        return NULL;
    }
    const part_objs objs = {.input = v[INPUT], .normalized_shape = v[NORMALIZED_SHAPE], .axis = v[AXIS],
                            .stats = &v[RSTD], .params = &v[WEIGHT], .scale = v[SCALE], .row_len = v[ROW_LEN]};
    return part_normalize(state, &rms_norm_kind, "_rms_norm_part_normalize", &objs);
}

/* The arguments of one part backward call: the statistics (the kind's n_stats) and, for
   grad_input, the row means of g and g * xhat (the kind's n_stats: RMSNorm has no mean(g))
   followed by the rows' largest magnitudes. */
typedef struct {
    PyObject *grad_output, *input, *normalized_shape, *axis;
    PyObject *const *stats;
    PyObject *const *row_means;  /* NULL: the row sums are wanted, not grad_input */
    PyObject *weight;
} part_backward_objs;

/* What the part's row sums give and what grad_input takes, one float64 per row each: two
   sums (or means), then the largest magnitudes in ln_kernels.h's order. */
enum { ROW_VALUES = 2 + LN_LARGEST_COUNT };
static const char *const row_sum_names[ROW_VALUES] = {"g_sum", "g_xhat_sum", "g_largest", "dy_largest",
                                                      "xc_largest"};
static const char *const row_mean_names[ROW_VALUES] = {"g_mean", "g_xhat_mean", "g_largest", "dy_largest",
                                                       "xc_largest"};
static const char *const row_value_texts[ROW_VALUES] = {"the sums of g", "the sums of g * xhat", "the largest |g|",
                                                        "the largest |dy|", "the largest |x - mean| (|x|)"};

/* New reference: with row_means, grad_input; without, the part's row sums and largest
   magnitudes (g_sum, g_xhat_sum, g_largest, dy_largest, xc_largest) for a centred kind,
   without g_sum for RMSNorm.  NULL with an exception set. */
static PyObject *
part_backward(module_state *state, const norm_kind *kind, const char *what, const part_backward_objs *objs)
{
    PyObject *result = NULL;
    PyArrayObject *input = NULL, *grad_out = NULL, *weight = NULL, *grad_input = NULL;
    PyArrayObject *stats[2] = {NULL, NULL}, *rows_g[ROW_VALUES] = {NULL};
    kernel_call call;
    call.n = 0;  /* for call_release, should the call end before call_init */
    shape_t ns;
    axis_arg axis;
    norm_axes ax;
    npy_intp rows;

    /* every conversion before any look at an array (see forward) */
    if (parse_normalized_shape(objs->normalized_shape, &ns) < 0 || !(input = as_array(objs->input)) ||
        !(grad_out = as_array(objs->grad_output))) {
        goto done;
    }
    const int first_stat = 2 - kind->n_stats;  /* index into (mean, rstd) and the row sums */
    for (int s = first_stat; s < 2; s++) {
        if (!(stats[s] = as_array(objs->stats[s - first_stat]))) {
            goto done;
        }
    }
    for (int s = first_stat; objs->row_means && s < ROW_VALUES; s++) {
        if (!(rows_g[s] = as_array(objs->row_means[s - first_stat]))) {
            goto done;
        }
    }
    if (param_object_array(objs->weight, "weight", &weight) < 0 || parse_axis(objs->axis, &ns, &axis) < 0) {
        goto done;
    }
    const int dtype = kernel_dtype(state, input, what);
    if (dtype < 0 ||
        param_checked(state, what, "weight", &ns, param_type_num[dtype], PyArray_SIZE(input) > 0, &weight) < 0 ||
        resolve_axes(state, kind->kernel, &axis, input, &ns, &ax) < 0 || batch_size(input, &ax, &rows) < 0) {
        goto done;
    }
    if (!PyArray_SAMESHAPE(grad_out, input)) {
        PyErr_Format(PyExc_ValueError, "%s: grad_output must have the input's shape", what);
        goto done;
    }
    if (PyArray_TYPE(grad_out) != PyArray_TYPE(input)) {
        Py_SETREF(grad_out, (PyArrayObject *)PyArray_FromArray(grad_out, PyArray_DescrFromType(PyArray_TYPE(input)),
                                                               NPY_ARRAY_ALIGNED | NPY_ARRAY_FORCECAST));
        if (!grad_out) {
            allocation_failed(what, "grad_output in the input's dtype", PyArray_NDIM(input), PyArray_DIMS(input),
                              PyArray_TYPE(input));
            goto done;
        }
    }
    for (int s = first_stat; s < 2; s++) {
        if (stats_check(state, stats[s], objs->stats[s - first_stat], NULL, stat_names[s], rows) < 0) {
            goto done;
        }
        Py_SETREF(stats[s], stats_shaped(what, stat_names[s], stats[s], input, &ax, NPY_DOUBLE));
        if (!stats[s]) {
            goto done;
        }
    }
    for (int s = first_stat; s < ROW_VALUES; s++) {
        if (objs->row_means) {
            if (stats_check(state, rows_g[s], objs->row_means[s - first_stat], NULL, row_mean_names[s], rows) < 0) {
                goto done;
            }
            Py_SETREF(rows_g[s], stats_shaped(what, row_mean_names[s], rows_g[s], input, &ax, NPY_DOUBLE));
        }
        else {
            rows_g[s] = stats_array(what, row_sum_names[s], input, &ax, NPY_DOUBLE);
        }
        if (!rows_g[s]) {
            goto done;
        }
    }
    if (objs->row_means) {
        grad_input = new_result(state, what, "grad_input", input, grad_out, &ax, element_type_num(state, dtype));
        if (!grad_input) {
            goto done;
        }
    }
    call_init(&call, input, &ax);
    enum { GRAD_OUTPUT, INPUT, MEAN, RSTD, ROWS_G, GRAD_INPUT = ROWS_G + ROW_VALUES };
    call_add(&call, grad_out, "grad_output", 0, 0);
    call_add(&call, input, "the input", 0, 0);
    call_add(&call, stats[0], "the mean", 0, 1);
    call_add(&call, stats[1], "the rstd", 0, 1);
    for (int s = 0; s < ROW_VALUES; s++) {
        call_add(&call, rows_g[s], row_value_texts[s], !objs->row_means, 1);
    }
    call_add(&call, grad_input, "grad_input", 1, 0);
    if (call_prepare(what, &call, INPUT) < 0) {
        goto done;
    }
    ln_part_backward_args args = {
        .kind = kind->kernel,
        .dtype = (ln_dtype)dtype,
        .extent = call.extent,
        .grad_output = call_array_at(&call, GRAD_OUTPUT),
        .input = call_array_at(&call, INPUT),
        .weight = weight ? PyArray_DATA(weight) : NULL,
        .mean = call_array_at(&call, MEAN),
        .rstd = call_array_at(&call, RSTD),
        .g = call_array_at(&call, ROWS_G),
        .g_xhat = call_array_at(&call, ROWS_G + 1),
        .grad_input = call_array_at(&call, GRAD_INPUT),
    };
    for (int i = 0; i < LN_LARGEST_COUNT; i++) {
        args.largest[i] = call_array_at(&call, ROWS_G + 2 + i);
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = objs->row_means ? ln_part_grad_input(&args) : ln_part_grad_sums(&args);
    Py_END_ALLOW_THREADS
    if (status < 0) {
        PyErr_Format(PyExc_MemoryError, "%s: the kernel could not allocate its scratch memory for %zd "
                     "rows of %zd elements",
                     what, (Py_ssize_t)rows, (Py_ssize_t)ns.size);
        goto done;
    }
    if (call_finish(&call) < 0) {
        goto done;
    }
    if (grad_input) {
        Py_INCREF(grad_input);
        result = (PyObject *)grad_input;
    }
    else {
        result = PyTuple_New(ROW_VALUES - first_stat);
        for (int s = first_stat; result && s < ROW_VALUES; s++) {
            Py_INCREF(rows_g[s]);
            PyTuple_SET_ITEM(result, s - first_stat, (PyObject *)rows_g[s]);
        }
    }
done:
    call_release(&call);
    Py_XDECREF(input);
    Py_XDECREF(grad_out);
    Py_XDECREF(weight);
    Py_XDECREF(grad_input);
    for (int i = 0; i < 2; i++) {
        Py_XDECREF(stats[i]);
    }
    for (int i = 0; i < ROW_VALUES; i++) {
        Py_XDECREF(rows_g[i]);
    }
    return result;
}

PyDoc_STRVAR(layer_norm_part_grad_sums_doc,
"_layer_norm_part_grad_sums($module, grad_output, input, normalized_shape, mean, rstd,\n"
"                           weight=None, *, axis=None)\n"
"--\n"
"\n"
"(g_sum, g_xhat_sum, g_largest, dy_largest, xc_largest) of each row's part, float64: the sums\n"
"of g = grad_output * weight and of g * xhat that layer_norm_backward takes, and the largest\n"
"|g|, |grad_output| and |input - mean| (private: for layernorm._dask).\n");

static PyObject *
layer_norm_part_grad_sums(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { GRAD_OUTPUT, INPUT, NORMALIZED_SHAPE, MEAN, RSTD, WEIGHT, AXIS, N };
    static const keyword_id keywords[N] = {KW_GRAD_OUTPUT, KW_INPUT, KW_NORMALIZED_SHAPE, KW_MEAN, KW_RSTD,
                                           KW_WEIGHT, KW_AXIS};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "_layer_norm_part_grad_sums", args, nargs, kwnames, keywords, N, AXIS, 5, v) < 0) {
        return NULL;
    }
    const part_backward_objs objs = {.grad_output = v[GRAD_OUTPUT], .input = v[INPUT],
                                     .normalized_shape = v[NORMALIZED_SHAPE], .axis = v[AXIS],
                                     .stats = &v[MEAN], .weight = v[WEIGHT]};
    return part_backward(state, &layer_norm_kind, "_layer_norm_part_grad_sums", &objs);
}

PyDoc_STRVAR(layer_norm_part_grad_input_doc,
"_layer_norm_part_grad_input($module, grad_output, input, normalized_shape, mean, rstd, g_mean,\n"
"                            g_xhat_mean, g_largest, dy_largest, xc_largest, weight=None, *,\n"
"                            axis=None)\n"
"--\n"
"\n"
"rstd * (g - g_mean - xhat * g_xhat_mean) on the part, with the rows' means of g and g * xhat\n"
"and the rows' largest |g|, |grad_output| and |input - mean| given (float64), as\n"
"layer_norm_backward computes grad_input (private: for layernorm._dask).\n");

static PyObject *
layer_norm_part_grad_input(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { GRAD_OUTPUT, INPUT, NORMALIZED_SHAPE, MEAN, RSTD, G_MEAN, G_XHAT_MEAN, G_LARGEST, DY_LARGEST,
           XC_LARGEST, WEIGHT, AXIS, N };
    static const keyword_id keywords[N] = {KW_GRAD_OUTPUT, KW_INPUT, KW_NORMALIZED_SHAPE, KW_MEAN, KW_RSTD,
                                           KW_G_MEAN, KW_G_XHAT_MEAN, KW_G_LARGEST, KW_DY_LARGEST, KW_XC_LARGEST,
                                           KW_WEIGHT, KW_AXIS};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "_layer_norm_part_grad_input", args, nargs, kwnames, keywords, N, AXIS, 10, v) < 0) {
        return NULL;
    }
    const part_backward_objs objs = {.grad_output = v[GRAD_OUTPUT], .input = v[INPUT],
                                     .normalized_shape = v[NORMALIZED_SHAPE], .axis = v[AXIS],
                                     .stats = &v[MEAN], .row_means = &v[G_MEAN], .weight = v[WEIGHT]};
    return part_backward(state, &layer_norm_kind, "_layer_norm_part_grad_input", &objs);
}

PyDoc_STRVAR(rms_norm_part_grad_sums_doc,
"_rms_norm_part_grad_sums($module, grad_output, input, normalized_shape, rstd, weight=None, *,\n"
"                         axis=None)\n"
"--\n"
"\n"
"(g_xhat_sum, g_largest, dy_largest, xc_largest) of each row's part, float64: the sum of\n"
"g * xhat that rms_norm_backward takes, and the largest |g|, |grad_output| and |input|\n"
"(private: for layernorm._dask).\n");

static PyObject *
rms_norm_part_grad_sums(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { GRAD_OUTPUT, INPUT, NORMALIZED_SHAPE, RSTD, WEIGHT, AXIS, N };
    static const keyword_id keywords[N] = {KW_GRAD_OUTPUT, KW_INPUT, KW_NORMALIZED_SHAPE, KW_RSTD, KW_WEIGHT,
                                           KW_AXIS};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "_rms_norm_part_grad_sums", args, nargs, kwnames, keywords, N, AXIS, 4, v) < 0) {
        return NULL;
    }
    const part_backward_objs objs = {.grad_output = v[GRAD_OUTPUT], .input = v[INPUT],
                                     .normalized_shape = v[NORMALIZED_SHAPE], .axis = v[AXIS],
                                     .stats = &v[RSTD], .weight = v[WEIGHT]};
    return part_backward(state, &rms_norm_kind, "_rms_norm_part_grad_sums", &objs);
}

PyDoc_STRVAR(rms_norm_part_grad_input_doc,
"_rms_norm_part_grad_input($module, grad_output, input, normalized_shape, rstd, g_xhat_mean,\n"
"                          g_largest, dy_largest, xc_largest, weight=None, *, axis=None)\n"
"--\n"
"\n"
"rstd * (g - xhat * g_xhat_mean) on the part, with the rows' means of g * xhat and largest\n"
"|g|, |grad_output| and |input| given (float64), as rms_norm_backward computes grad_input\n"
"(private: for layernorm._dask).\n");

static PyObject *
rms_norm_part_grad_input(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    enum { GRAD_OUTPUT, INPUT, NORMALIZED_SHAPE, RSTD, G_XHAT_MEAN, G_LARGEST, DY_LARGEST, XC_LARGEST, WEIGHT,
           AXIS, N };
    static const keyword_id keywords[N] = {KW_GRAD_OUTPUT, KW_INPUT, KW_NORMALIZED_SHAPE, KW_RSTD,
                                           KW_G_XHAT_MEAN, KW_G_LARGEST, KW_DY_LARGEST, KW_XC_LARGEST,
                                           KW_WEIGHT, KW_AXIS};
    module_state *state = get_state(module);
    PyObject *v[N];
    if (parse_args(state, "_rms_norm_part_grad_input", args, nargs, kwnames, keywords, N, AXIS, 8, v) < 0) {
        return NULL;
    }
    const part_backward_objs objs = {.grad_output = v[GRAD_OUTPUT], .input = v[INPUT],
                                     .normalized_shape = v[NORMALIZED_SHAPE], .axis = v[AXIS],
                                     .stats = &v[RSTD], .row_means = &v[G_XHAT_MEAN], .weight = v[WEIGHT]};
    return part_backward(state, &rms_norm_kind, "_rms_norm_part_grad_input", &objs);
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

/* Stores into *value the int argument `arg`, called `name`, of fname(), clipped to the
   Py_ssize_t range.  Returns 0, or -1 with TypeError set when it is not an int (a bool is
   not taken) or ValueError when it is below `minimum`. */
static int
int_argument(const char *fname, const char *name, PyObject *arg, Py_ssize_t minimum, Py_ssize_t *value)
{
    if (!PyIndex_Check(arg) || PyBool_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "%s() takes an int, got %.200s", fname, Py_TYPE(arg)->tp_name);
        return -1;
    }
    *value = PyNumber_AsSsize_t(arg, NULL);
    if (*value == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (*value < minimum) {
        PyErr_Format(PyExc_ValueError, "%s() needs %s >= %zd, got %R", fname, name, minimum, arg);
        return -1;
    }
    return 0;
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
    /* 10**30 threads are as many as the kernels run */
    Py_ssize_t n;
    if (int_argument("set_num_threads", "n", arg, 1, &n) < 0) {
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

PyDoc_STRVAR(set_result_cache_doc,
"set_result_cache($module, max_bytes, /)\n--\n\n"
"Keep up to max_bytes of the memory of freed large results (4 MiB and more) for the next\n"
"results of their size; 0 keeps none, and releases what is kept.  The default is 256 MiB.\n"
"Backward's scratch sums of more than 16 MiB are kept here too.\n"
"\n"
"The OS hands out a new mapping of zeroed pages for each large allocation: taking memory\n"
"kept here instead, a loop of calls on large arrays runs at the speed of calls writing\n"
"into out= (2048x4096 float32 forward, one thread: 6.5 ms into new memory, 3.3 ms into\n"
"reused memory).  Blocks kept are unmapped, oldest first, once the limit or 16 blocks\n"
"are passed.");

static PyObject *
set_result_cache(PyObject *module, PyObject *arg)
{
    /* 10**30 bytes are more than any address space holds */
    Py_ssize_t max_bytes;
    if (int_argument("set_result_cache", "max_bytes", arg, 0, &max_bytes) < 0) {
        return NULL;
    }
    ln_buffers_set_limit((size_t)max_bytes);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(result_cache_info_doc,
"result_cache_info($module, /)\n--\n\n"
"The memory kept for large results (and backward's large scratch): a dict with max_bytes\n"
"(set_result_cache's limit), bytes (kept now) and blocks (how many).");

static PyObject *
result_cache_info(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    const ln_buffers_state kept = ln_buffers_get();
    return Py_BuildValue("{snsnsi}", "max_bytes", (Py_ssize_t)kept.limit, "bytes", (Py_ssize_t)kept.held,
                         "blocks", kept.blocks);
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

/* A METH_FASTCALL | METH_KEYWORDS entry: Python name, C function, and its docstring function##_doc. */
#define KEYWORD_METHOD(name, function) \
    {name, (PyCFunction)(void (*)(void))function, METH_FASTCALL | METH_KEYWORDS, function##_doc}

static PyMethodDef layernorm_methods[] = {
    KEYWORD_METHOD("layer_norm", layer_norm),
    KEYWORD_METHOD("native_layer_norm", native_layer_norm),
    KEYWORD_METHOD("add_layer_norm", add_layer_norm),
    KEYWORD_METHOD("layer_norm_backward", layer_norm_backward),
    KEYWORD_METHOD("training_forward", training_forward),
    KEYWORD_METHOD("saved_backward", saved_backward),
    KEYWORD_METHOD("rms_norm", rms_norm),
    KEYWORD_METHOD("native_rms_norm", native_rms_norm),
    KEYWORD_METHOD("add_rms_norm", add_rms_norm),
    KEYWORD_METHOD("rms_norm_backward", rms_norm_backward),
    KEYWORD_METHOD("rms_training_forward", rms_training_forward),
    KEYWORD_METHOD("rms_saved_backward", rms_saved_backward),
    KEYWORD_METHOD("_layer_norm_part_moments", layer_norm_part_moments),
    KEYWORD_METHOD("_layer_norm_part_normalize", layer_norm_part_normalize),
    KEYWORD_METHOD("_rms_norm_part_moments", rms_norm_part_moments),
    KEYWORD_METHOD("_rms_norm_part_normalize", rms_norm_part_normalize),
    KEYWORD_METHOD("_layer_norm_part_grad_sums", layer_norm_part_grad_sums),
    KEYWORD_METHOD("_layer_norm_part_grad_input", layer_norm_part_grad_input),
    KEYWORD_METHOD("_rms_norm_part_grad_sums", rms_norm_part_grad_sums),
    KEYWORD_METHOD("_rms_norm_part_grad_input", rms_norm_part_grad_input),
    {"set_num_threads", set_num_threads, METH_O, set_num_threads_doc},
    {"get_num_threads", get_num_threads, METH_NOARGS, get_num_threads_doc},
    {"set_result_cache", set_result_cache, METH_O, set_result_cache_doc},
    {"result_cache_info", result_cache_info, METH_NOARGS, result_cache_info_doc},
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
    state->bfloat16_type_num = -1;
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
    state->result_memory = PyCapsule_New(&result_memory_handler, "mem_handler", NULL);
    if (!state->result_memory) {
        return -1;
    }
    /* NumPy's own class, so that `except np.exceptions.AxisError` catches ours */
    PyObject *numpy = PyImport_ImportModule("numpy");
    if (!numpy) {
        return -1;
    }
    PyObject *exceptions = PyObject_GetAttrString(numpy, "exceptions");  /* NumPy >= 1.25 */
    if (!exceptions) {
        PyErr_Clear();
        Py_INCREF(numpy);
        exceptions = numpy;
    }
    state->axis_error = PyObject_GetAttrString(exceptions, "AxisError");
    state->too_hard_error = state->axis_error ? PyObject_GetAttrString(exceptions, "TooHardError") : NULL;
    state->shares_memory = state->too_hard_error ? PyObject_GetAttrString(numpy, "shares_memory") : NULL;
    Py_DECREF(exceptions);
    Py_DECREF(numpy);
    if (!state->shares_memory) {
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
