"""Dask arrays through the norm family: the functions of ``layernorm.functional`` on
``dask.array.Array`` arguments, returning lazy dask arrays.

functional.py hands a call here when one of its arguments is a dask array; only then are this
module and dask imported.  A call first runs the NumPy function on stand-ins that hold no rows
(so every refusal is the NumPy call's own, raised before any graph exists, and the stand-ins'
results give the outputs' dtypes), then builds one of two graphs:

- Rows held whole by each chunk (one chunk along every normalized axis): one task per chunk runs
  the NumPy function on it, so outputs and statistics are bit for bit the NumPy call's on the
  whole array; parameter gradients are summed across chunks in a tree.
- Normalized axes split across chunks: float64 partial moments per chunk, merged in a tree, then
  one blockwise pass that normalizes each chunk (results within the float64 truth's tolerance,
  not the NumPy call's bits; no chunk is ever rechunked into whole rows)::

      chunk b:  n_b = its part of the row, mean_b = mean(x_b), M2_b = sum((x_b - mean_b) ** 2)
      merged:   n = sum(n_b), mean = sum(n_b * mean_b) / n,
                M2 = sum(M2_b + n_b * (mean_b - mean) ** 2)          (Chan et al.)
      rstd = 1 / sqrt(M2 / n + eps),  y = (x - mean) * rstd * weight + bias

  A chunk of extreme magnitude (float64 near 1e300 or 1e-300, bfloat16 subnormals) has its
  moments in units of a power of two s_b (x_b / s_b, chosen by the kernels); the merge takes every part in the
  largest s_b's units, so that no square overflows or underflows, and so does normalize,
  which computes such rows, and any whose rstd the kernels cannot carry, in plain float64.

  RMSNorm is the same with every mean 0 (M2 is then the sum of squares); the fused adds
  normalize NumPy's sum of each pair of chunks.  Backward merges the row sums it needs the same
  way: with g = grad_output * weight and xhat = (x - mean) * rstd,
  grad_input = rstd * (g - mean(g) - xhat * mean(g * xhat)) (RMSNorm: no mean(g)), with each
  row's largest |g|, |grad_output| and |x - mean| merged alongside (by maximum): the kernels
  compute a row whose products come near the subnormals or the largest float in float64, as
  the NumPy call does, and need the whole row's to tell.
  Each chunk's moments, its normalized values, its row sums and its grad_input come from the
  kernel layer's private part entry points (_layernorm._layer_norm_part_moments, ...), one
  read of the chunk each; the merges happen here, in float64.

Every function a task runs is a module-level function of NumPy arrays, so graphs pickle (for
dask.distributed); task names are dask's tokens of everything a result depends on.
"""

from __future__ import annotations

import math
import operator
from functools import partial
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional, Sequence, Tuple, TypeVar, cast

import dask.array as da
import numpy as np

from . import _layernorm as _core
from ._reference import normalized_axes, rms_norm_default_eps
from .functional import _as_numpy

# ---------------------------------------------------------------------------------------------
# The family, as the graphs see it
# ---------------------------------------------------------------------------------------------


class _Family(NamedTuple):
    """Which arguments of a family function are arrays, what it computes, what it returns."""

    kind: str  # "norm", "add" (the norm of input + residual) or "backward" (a norm's gradients)
    centred: bool  # LayerNorm (the mean taken out), not RMSNorm
    rows: Tuple[str, ...]  # arguments of the input's shape; the first dask one sets the chunks
    stats: Tuple[str, ...]  # statistics given: the input's shape with 1 on the normalized axes
    params: Tuple[str, ...]  # arguments of normalized_shape
    outputs: Tuple[str, ...]  # what it returns, in order; a single name: an array, not a tuple


_LAYER_NORM_PARAMS, _RMS_NORM_PARAMS = ("weight", "bias"), ("weight",)
_FAMILY: Dict[str, _Family] = {
    "layer_norm": _Family("norm", True, ("input",), (), _LAYER_NORM_PARAMS, ("output",)),
    "native_layer_norm": _Family("norm", True, ("input",), (), _LAYER_NORM_PARAMS, ("output", "mean", "rstd")),
    "layer_norm_backward": _Family("backward", True, ("input", "grad_output"), ("mean", "rstd"),
                                   _LAYER_NORM_PARAMS, ("grad_input", "grad_weight", "grad_bias")),
    "add_layer_norm": _Family("add", True, ("input", "residual"), (), _LAYER_NORM_PARAMS, ("output", "sum")),
    "rms_norm": _Family("norm", False, ("input",), (), _RMS_NORM_PARAMS, ("output",)),
    "native_rms_norm": _Family("norm", False, ("input",), (), _RMS_NORM_PARAMS, ("output", "rstd")),
    "rms_norm_backward": _Family("backward", False, ("input", "grad_output"), ("rstd",), _RMS_NORM_PARAMS,
                                 ("grad_input", "grad_weight")),
    "add_rms_norm": _Family("add", False, ("input", "residual"), (), _RMS_NORM_PARAMS, ("output", "sum")),
}

# Outputs of the statistics' shape, and of normalized_shape; the others have the input's shape.
_STATISTICS = ("mean", "rstd")
_PARAMETER_GRADIENTS = ("grad_weight", "grad_bias")


# ---------------------------------------------------------------------------------------------
# The call
# ---------------------------------------------------------------------------------------------

_Result = TypeVar("_Result")


def call(function: Callable[..., _Result], **arguments: Any) -> _Result:
    """``function(**arguments)``, a function of layernorm.functional called with at least one
    dask array: the same results as lazy dask arrays, nothing computed (typed as the function's
    NumPy results, which they stand for)."""
    name = function.__name__
    family = _FAMILY[name]
    for target in ("out", "residual_out"):
        if arguments.pop(target, None) is not None:
            raise TypeError(
                f"{name}() with dask arrays returns lazy dask arrays and cannot write into "
                f"{target}=; write a result into an array with dask.array.store(result, target)"
            )
    arrays = {key: _as_array(arguments.pop(key)) for key in family.rows + family.stats}
    params = {key: _as_param(arguments.pop(key)) for key in family.params}
    options = arguments  # normalized_shape, eps, output_mask, ...
    leader = next((key for key in family.rows if isinstance(arrays[key], da.Array)), family.rows[0])
    input = arrays[leader] if isinstance(arrays[leader], da.Array) else da.asarray(arrays[leader])
    axes, results = _checked_call(function, family, input.shape, arrays, params, options)
    metas = {
        key: None if result is None else np.empty((0,) * result.ndim, result.dtype)
        for key, result in zip(family.outputs, results)
    }

    chunks = input.chunks
    empty_rows = math.prod(input.shape[a] for a in axes) == 0
    if empty_rows:
        # the kernel's answer (mean 0, rstd NaN) needs no merging: rows taken whole, and the
        # results (with no element to move) given the input's chunks back below
        chunks = tuple((n,) if a in axes else c for a, (n, c) in enumerate(zip(input.shape, chunks)))
    stats_chunks = tuple((1,) if a in axes else c for a, c in enumerate(chunks))
    param_chunks = tuple(chunks[a] for a in axes)
    aligned: Dict[str, Optional[da.Array]] = {
        key: _chunked(value, chunks if key in family.rows else stats_chunks, name, key, leader)
        for key, value in arrays.items()
    }
    aligned.update((key, None if value is None else _chunked(value, param_chunks, name, key, leader))
                   for key, value in params.items())

    graph = _Graph(name, family, axes, input.ndim, options, metas)
    if all(len(chunks[a]) == 1 for a in axes):
        outputs = graph.whole_rows(function, aligned)
    elif family.kind == "backward":
        outputs = graph.split_backward(aligned)
    else:
        outputs = graph.split_norm(aligned)
    if empty_rows:
        for key in family.outputs:
            if outputs[key] is not None and key not in _STATISTICS:
                along = axes if key in _PARAMETER_GRADIENTS else range(input.ndim)
                outputs[key] = outputs[key].rechunk(tuple(input.chunks[a] for a in along))
    result = tuple(outputs[key] for key in family.outputs)
    return cast(_Result, result[0] if len(result) == 1 else result)


def _checked_call(function: Callable[..., Any], family: _Family, input_shape: Tuple[float, ...],
                  arrays: Dict[str, Any], params: Dict[str, Any],
                  options: Dict[str, Any]) -> Tuple[Tuple[int, ...], Tuple[Any, ...]]:
    """(the normalized axes, the NumPy function's results on stand-ins without rows), or the
    NumPy call's refusal of the arguments.  Statistics given in another shape of one value per
    row are reshaped in `arrays` to the one native_layer_norm returns."""
    name = function.__name__
    axes = _normalized_axes(len(input_shape), options["normalized_shape"], options.get("axis"))
    if axes is None:
        # the NumPy call's refusal of normalized_shape or axis, which no size changes
        _checked(function, arrays, params, options, {key: (0,) * value.ndim for key, value in arrays.items()})
        axes = normalized_axes(len(input_shape), options["normalized_shape"], options.get("axis"))
    _refuse_unknown_sizes(name, {**arrays, **params}, axes, family.params)
    stats_shape = tuple(1 if a in axes else n for a, n in enumerate(input_shape))
    arrays.update((key, _one_per_row(arrays[key], stats_shape)) for key in family.stats)
    expected = {key: input_shape if key in family.rows else stats_shape for key in arrays}
    mismatched = [key for key, value in arrays.items() if not _same_shape(value.shape, expected[key])]
    # stand-ins without rows, but for arrays of other shapes than the input's, which the
    # NumPy call is to refuse
    shapes = {
        key: tuple(0 if math.isnan(n) or (a not in axes and key not in mismatched) else int(n)
                   for a, n in enumerate(value.shape))
        for key, value in arrays.items()
    }
    results = _checked(function, arrays, params, options, shapes)
    if mismatched:
        key = mismatched[0]
        raise ValueError(f"{name}(): {key} has shape {arrays[key].shape}, but the input's shape "
                         f"{input_shape} wants {expected[key]}")
    return axes, (results,) if len(family.outputs) == 1 else tuple(results)


def _as_array(value: Any) -> Any:
    """A dask array as it is; anything else as the NumPy array the kernels would make of it."""
    return _unmasked(value) if isinstance(value, da.Array) else np.asarray(_as_numpy(value))


def _as_param(value: Any) -> Any:
    """A parameter: a dask array or None as it is, anything else through _as_numpy (the
    probe refuses what the kernels refuse, e.g. text, with their words)."""
    if isinstance(value, da.Array):
        return _unmasked(value)
    return value if value is None else _as_numpy(value)


def _unmasked(value: da.Array) -> da.Array:
    """`value`, unless its chunks are masked arrays (dask.array.ma): which elements are masked
    is known only once they are computed, and the kernels would read the values under the mask,
    so such an array is refused now, as a NumPy masked array with masked elements is."""
    if isinstance(value._meta, np.ma.MaskedArray):
        raise ValueError("dask arrays of masked arrays (dask.array.ma) are not supported (the kernels would read "
                         "the values under the mask): pass dask.array.ma.filled(a, fill_value)")
    return value


def _normalized_axes(ndim: int, normalized_shape: Any, axis: Any) -> Optional[Tuple[int, ...]]:
    """The axes normalized over, from the number of normalized_shape's sizes (not the sizes,
    which may be unknown), or None when normalized_shape and axis name none."""
    try:
        rank = 1 if isinstance(normalized_shape, (int, np.integer)) else len(normalized_shape)
        return normalized_axes(ndim, (1,) * rank, axis)
    except (TypeError, ValueError):
        return None


def _one_per_row(stats: Any, shape: Tuple[float, ...]) -> Any:
    """Statistics in the shape native_layer_norm gives them: the kernels take one value per
    row in any shape."""
    if _same_shape(stats.shape, shape) or any(math.isnan(n) for n in stats.shape + shape):
        return stats
    # (through one dimension: dask reshapes only by merging or splitting dimensions evenly)
    return stats.ravel().reshape(shape) if stats.size == math.prod(shape) else stats


def _same_shape(shape: Tuple[float, ...], other: Tuple[float, ...]) -> bool:
    """Whether two shapes are equal, an unknown size (NaN) equal to any."""
    return len(shape) == len(other) and all(
        a == b or math.isnan(a) or math.isnan(b) for a, b in zip(shape, other)
    )


def _refuse_unknown_sizes(name: str, arrays: Dict[str, Any], axes: Tuple[int, ...],
                          params: Sequence[str]) -> None:
    """Raise ValueError when a dask array's size along a normalized axis is unknown (as after
    boolean indexing): a row's length must be known before its chunks can be merged."""
    for key, value in arrays.items():
        if not isinstance(value, da.Array):
            continue
        along = range(value.ndim) if key in params else [a for a in axes if a < value.ndim]
        unknown = [a for a in along if math.isnan(value.shape[a])]
        if unknown:
            raise ValueError(
                f"{name}(): {key} has unknown chunk sizes along axis {unknown[0]}, which is "
                f"normalized; call {key}.compute_chunk_sizes() first (unknown sizes are fine "
                "along the other axes)"
            )


def _checked(function: Callable[..., Any], arrays: Dict[str, Any], params: Dict[str, Any],
             options: Dict[str, Any], shapes: Dict[str, Tuple[int, ...]]) -> Any:
    """The NumPy function's results on stand-ins of `shapes` (fewer rows than the arrays
    have): its dtypes, or its refusal of these arguments.  A ValueError, whose message may
    name sizes, comes from the stand-ins of the caller's sizes: the same check refuses them
    before anything is computed."""
    try:
        return _probe(function, arrays, params, options, shapes)
    except ValueError as error:
        refusal = error
    caller = {key: value.shape for key, value in arrays.items()}
    if not any(math.isnan(n) for shape in caller.values() for n in shape):
        _probe(function, arrays, params, options, caller)  # raises, outside the handler of the first
    raise refusal


def _probe(function: Callable[..., Any], arrays: Dict[str, Any], params: Dict[str, Any],
           options: Dict[str, Any], shapes: Dict[str, Tuple[int, ...]]) -> Any:
    """``function`` on zero-filled stand-ins of the arrays, of `shapes`, and of the dask
    parameters (NumPy ones as they are); stand-ins take no memory, so a parameter of a wrong
    and huge shape is refused as the NumPy call refuses it, before anything is allocated."""
    stand_ins = {
        key: np.broadcast_to(np.zeros((), value.dtype), shapes[key]) for key, value in arrays.items()
    }
    stand_ins.update(
        (key, np.broadcast_to(np.zeros((), value.dtype), value.shape) if isinstance(value, da.Array) else value)
        for key, value in params.items()
    )
    return function(**stand_ins, **options)


def _chunked(value: Any, chunks: Tuple[Tuple[float, ...], ...], name: str, key: str, leader: str) -> da.Array:
    """`value` (a dask or NumPy array, argument `key` of function `name`) as a dask array of
    these chunks, those of argument `leader`.  Chunks of unknown size (NaN, as after boolean
    indexing) can only be those of a dask array that has them already."""
    if isinstance(value, da.Array) and value.chunks == chunks:
        return value
    unknown = next((a for a, sizes in enumerate(chunks) if any(math.isnan(n) for n in sizes)), None)
    if unknown is not None:
        raise ValueError(
            f"{name}(): {leader} has chunks of unknown size along axis {unknown} (as after boolean "
            f"indexing), which {key} cannot be split into; pass {key} as a dask array chunked like "
            f"{leader}, or call {leader}.compute_chunk_sizes() first"
        )
    if not isinstance(value, da.Array):
        return da.from_array(np.asarray(value), chunks=chunks)
    return value.rechunk(chunks)


# ---------------------------------------------------------------------------------------------
# The graphs
# ---------------------------------------------------------------------------------------------

# The index of the stacked parameter gradients' first axis (the batch and normalized axes are
# indexed by their numbers, as in the input).
_STACKED = -1


class _Graph:
    """Builds a call's graph from its arguments, as dask arrays of matching chunks."""

    def __init__(self, name: str, family: _Family, axes: Tuple[int, ...], ndim: int,
                 options: Dict[str, Any], metas: Dict[str, Optional[np.ndarray]]) -> None:
        self.name = name  # the function's, the prefix of every task name
        self.family = family
        self.axes = axes  # the normalized axes, in normalized_shape's order
        self.index = tuple(range(ndim))  # the input's axes, as blockwise indexes them
        self.batch = tuple(a for a in self.index if a not in axes)
        self.options = options  # the arguments that are not arrays
        self.metas = metas  # an empty array of each output's type; None for an output of None
        self.gradients = tuple(key for key in _PARAMETER_GRADIENTS if metas.get(key) is not None)

    def _blockwise(self, what: str, func: Callable[..., Any], *pairs: Any, **kwargs: Any) -> da.Array:
        """A layer named after the function and `what` it makes, indexed like the input."""
        return da.blockwise(func, self.index, *pairs, token=f"{self.name}-{what}", **kwargs)

    def _pairs(self, arrays: Dict[str, Any], keys: Sequence[str]) -> list[Any]:
        """blockwise's (array, index) pairs for these arguments; (None, None) for one absent."""
        pairs: list[Any] = []
        for key in keys:
            value = arrays.get(key)
            index = self.axes if key in self.family.params else self.index
            pairs += (value, None if value is None else index)
        return pairs

    def _summed_gradients(self, func: Callable[..., Any], *pairs: Any) -> Dict[str, da.Array]:
        """The parameter gradients: `func` makes each chunk's part of them (stacked, with the
        batch axes first, of size 1), which are summed over the batch axes in a tree in
        float64, then rounded to their dtype, every NaN the one quiet NaN."""
        parts = da.blockwise(
            func, (_STACKED,) + self.batch + self.axes, *pairs,
            new_axes={_STACKED: len(self.gradients)}, adjust_chunks={a: 1 for a in self.batch},
            token=f"{self.name}-gradients", meta=np.empty((0,) * (1 + len(self.index))),
        )
        if self.batch:
            parts = parts.sum(axis=tuple(range(1, 1 + len(self.batch))))
        parts = parts.map_blocks(_one_quiet_nan, meta=np.empty((0,) * parts.ndim))
        return {
            key: parts[place].astype(self.metas[key].dtype)  # type: ignore[union-attr]
            for place, key in enumerate(self.gradients)
        }

    # -- rows held whole ------------------------------------------------------------------

    def whole_rows(self, function: Callable[..., Any], arrays: Dict[str, Any]) -> Dict[str, Any]:
        """One task per chunk running the NumPy function; its parameter gradients summed."""
        keys = tuple(key for key, value in arrays.items() if value is not None)
        kernel = partial(_on_blocks, function, keys, self.options)
        pairs = self._pairs(arrays, keys)
        if len(self.family.outputs) == 1:
            (key,) = self.family.outputs
            return {key: da.blockwise(kernel, self.index, *pairs, token=self.name, meta=self.metas[key])}
        results = da.blockwise(kernel, self.index, *pairs, token=self.name,
                               meta=np.empty((0,) * len(self.index), object))
        outputs: Dict[str, Any] = dict.fromkeys(self.metas)
        for place, (key, meta) in enumerate(self.metas.items()):
            if meta is not None and key not in self.gradients:
                adjust = {a: 1 for a in self.axes} if key in _STATISTICS else None
                outputs[key] = self._blockwise(key, operator.getitem, results, self.index, place, None,
                                               adjust_chunks=adjust, meta=meta)
        if self.gradients:
            places = tuple(list(self.metas).index(key) for key in self.gradients)
            outputs.update(self._summed_gradients(
                partial(_stacked_gradients, places, len(self.batch)), results, self.index
            ))
        return outputs

    # -- normalized axes split across chunks ----------------------------------------------

    def split_norm(self, arrays: Dict[str, Any]) -> Dict[str, Any]:
        """The forward on rows split across chunks: moments merged in a tree, then normalized
        (the fused adds: the norm of input + residual, NumPy's sum of each pair of chunks)."""
        input = arrays["input"]
        meta = self.metas["output"]
        assert meta is not None
        outputs: Dict[str, Any] = {}
        if self.family.kind == "add":
            input = outputs["sum"] = self._blockwise("sum", _sum, input, self.index, arrays["residual"],
                                                     self.index, meta=self.metas["sum"])
        eps = self.options["eps"]
        if eps is None:  # RMSNorm's default, torch's rule
            eps = rms_norm_default_eps(meta.dtype)
        one_per_row = {a: 1 for a in self.axes}
        parts = self._blockwise(
            "moment-parts", partial(_block_moments, axes=self.axes, centred=self.family.centred),
            input, self.index, adjust_chunks=one_per_row, meta=_empty(self.index, _MOMENTS),
        )
        moments = da.reduction(
            parts, _identity, _merged_moments, combine=_merged_moments, axis=self.axes,
            keepdims=True, dtype=_MOMENTS, meta=_empty(self.index, _MOMENTS),
            name=f"{self.name}-moments",
        )
        stats = self._blockwise("statistics", partial(_row_statistics, eps=float(eps)),
                                moments, self.index, meta=_empty(self.index, _STATS))
        outputs["output"] = self._blockwise(
            "output",
            partial(_normalized_block, axes=self.axes, centred=self.family.centred,
                    row_len=math.prod(input.shape[a] for a in self.axes)),
            input, self.index, stats, self.index, *self._pairs(arrays, ("weight", "bias")), meta=meta,
        )
        for key in _STATISTICS:
            stat_meta = self.metas.get(key)
            if stat_meta is not None:
                outputs[key] = self._blockwise(key, partial(_statistic, key, stat_meta.dtype), stats,
                                               self.index, meta=stat_meta)
        return outputs

    def split_backward(self, arrays: Dict[str, Any]) -> Dict[str, Any]:
        """The gradients on rows split across chunks: the row sums grad_input needs merged in a
        tree, then grad_input blockwise; parameter gradients summed over the batch axes."""
        operands = self._pairs(arrays, ("input", "grad_output", "mean", "rstd", "weight"))
        outputs: Dict[str, Any] = dict.fromkeys(self.metas)
        meta = self.metas["grad_input"]
        if meta is not None:
            parts = self._blockwise(
                "row-sum-parts", partial(_block_row_sums, axes=self.axes), *operands,
                adjust_chunks={a: 1 for a in self.axes}, meta=_empty(self.index, _ROW_SUMS),
            )
            row_len = math.prod(arrays["input"].shape[a] for a in self.axes)
            means = da.reduction(
                parts, _identity, partial(_row_means, row_len=row_len), combine=_merged_row_sums,
                axis=self.axes, keepdims=True, dtype=_ROW_SUMS, meta=_empty(self.index, _ROW_SUMS),
                name=f"{self.name}-row-sums",
            )
            outputs["grad_input"] = self._blockwise(
                "grad_input",
                partial(_grad_input_block, axes=self.axes),
                *operands, means, self.index, meta=meta,
            )
        if self.gradients:
            outputs.update(self._summed_gradients(
                partial(_block_gradients, self.gradients, axes=self.axes), *operands
            ))
        return outputs


def _empty(index: Tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    return np.empty((0,) * len(index), dtype)


# ---------------------------------------------------------------------------------------------
# Tasks: rows held whole
# ---------------------------------------------------------------------------------------------


def _on_blocks(function: Callable[..., Any], keys: Tuple[str, ...], options: Dict[str, Any],
               *blocks: np.ndarray) -> Any:
    """The NumPy function on one chunk of each array argument (named by `keys`)."""
    return function(**dict(zip(keys, blocks)), **options)


def _stacked_gradients(places: Tuple[int, ...], batch_ndim: int, results: Tuple[Any, ...]) -> np.ndarray:
    """The chunk's parameter gradients (results[place] for each place) stacked, in float64,
    with a size-1 axis for each batch axis between the stack's axis and theirs."""
    first = results[places[0]]
    stacked = np.stack([results[place] for place in places]).astype(np.float64)
    return stacked.reshape((len(places),) + (1,) * batch_ndim + first.shape)


# ---------------------------------------------------------------------------------------------
# Tasks: normalized axes split across chunks
# ---------------------------------------------------------------------------------------------

# A chunk's part of each row: its length, mean and sum of squared deviations from that mean,
# the last two in units of scale (a power of two: mean * scale is the mean).
_MOMENTS = np.dtype([("count", np.float64), ("mean", np.float64), ("m2", np.float64), ("scale", np.float64)])
# A row's statistics, in float64, in units of scale (mean * scale and rstd / scale are theirs).
_STATS = np.dtype([("mean", np.float64), ("rstd", np.float64), ("scale", np.float64)])
# A chunk's part of the row sums backward needs (g = grad_output * weight), then their means;
# and the largest magnitudes of g, grad_output and x - mean (x for RMSNorm), of the chunk's
# part, then of the row.
_SUMMED = ("g", "g_xhat")
_LARGEST = ("g_largest", "dy_largest", "xc_largest")
_ROW_SUMS = np.dtype([(field, np.float64) for field in _SUMMED + _LARGEST])

# Elements per slab: the parameter gradients work through a chunk slab by slab, so that their
# float64 intermediates (512 KiB each) stay in a core's cache instead of being chunk-sized
# arrays, also with dask's other threads' beside them (measured on the forward's former NumPy
# slabs: 2 threads on 2 cores, 64 x 4194304 float32 in 64 MiB chunks, 1.09 s with 2 ** 16,
# 1.20 s with 2 ** 15, 1.64 s with 2 ** 17).
_SLAB = 1 << 16


class _Chunk:
    """A chunk of `shape` worked through slab by slab, with the sums over its batch axes (one
    value per column, as the parameters)."""

    def __init__(self, shape: Tuple[int, ...], axes: Tuple[int, ...]) -> None:
        self.shape = shape
        self.axes = axes  # the normalized axes, in normalized_shape's order
        self.batch = tuple(a for a in range(len(shape)) if a not in axes)
        self.row_shape = tuple(1 if a in axes else n for a, n in enumerate(shape))
        self.column_shape = tuple(n if a in axes else 1 for a, n in enumerate(shape))

    def slabs(self) -> Iterator[Tuple[Tuple[slice, ...], Tuple[slice, ...], Tuple[slice, ...]]]:
        """(slab, its rows, its columns): index tuples of slices (no axis dropped) into the
        chunk, into an array of row_shape and into one of column_shape, for slabs of about
        _SLAB elements cut along the chunk's leading axes."""
        shape = self.shape
        if not math.prod(shape):
            return
        axis = 0
        while math.prod(shape[axis + 1 :]) > _SLAB and axis + 1 < len(shape):
            axis += 1
        step = max(1, _SLAB // math.prod(shape[axis + 1 :]))
        whole = slice(None)
        for lead in np.ndindex(*shape[:axis]):
            for start in range(0, shape[axis], step):
                slab = tuple(slice(i, i + 1) for i in lead) + (slice(start, start + step),)
                slab += (whole,) * (len(shape) - len(slab))
                yield (
                    slab,
                    tuple(whole if a in self.axes else i for a, i in enumerate(slab)),
                    tuple(i if a in self.axes else whole for a, i in enumerate(slab)),
                )

    def column_sum(self, values: np.ndarray) -> np.ndarray:
        total: np.ndarray = values.sum(axis=self.batch, keepdims=True)
        return total

    def column_dot(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """sum(a * b) over the batch axes, keeping them."""
        kept = tuple(n if k in self.axes else 1 for k, n in enumerate(a.shape))
        total: np.ndarray = np.einsum(a, self._all, b, self._all, tuple(sorted(self.axes)))
        return total.reshape(kept)

    @property
    def _all(self) -> Tuple[int, ...]:
        return tuple(range(len(self.shape)))

class _Scratch:
    """float64 work arrays of a slab's shape, reused from slab to slab."""

    def __init__(self, count: int) -> None:
        self._buffers = [np.empty(_SLAB) for _ in range(count)]

    def __call__(self, shape: Tuple[int, ...]) -> list[np.ndarray]:
        size = math.prod(shape)
        if size > self._buffers[0].size:
            self._buffers = [np.empty(size) for _ in self._buffers]
        return [buffer[:size].reshape(shape) for buffer in self._buffers]


def _sum(input: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """input + residual as the kernels form it: NumPy's sum, but a NaN is the one quiet NaN,
    and without NumPy's warnings of overflow and invalid operations, as the kernels give none.
    Chunks of other shapes (sizes unknown when the graph was built) are refused, not broadcast."""
    if input.shape != residual.shape:
        raise ValueError(f"residual has a chunk of shape {list(residual.shape)}, but input has one of shape "
                         f"{list(input.shape)} there: their sizes along an axis of unknown chunks differ")
    with np.errstate(over="ignore", invalid="ignore"):
        total: np.ndarray = np.add(input, residual)
    total[np.isnan(total)] = np.nan
    return total


def _block_moments(block: np.ndarray, *, axes: Tuple[int, ...], centred: bool) -> np.ndarray:
    """_MOMENTS of the chunk's part of each row, in float64, as the kernels take a whole row's
    (its chunks' one-pass moments about their first element, merged in order): one read of the
    chunk.  RMSNorm's mean is 0 and its M2 the sum of squares."""
    sizes = tuple(block.shape[a] for a in axes)
    moments = np.empty(tuple(1 if a in axes else n for a, n in enumerate(block.shape)), _MOMENTS)
    moments["count"] = math.prod(sizes)
    if centred:
        moments["mean"], moments["m2"], moments["scale"] = _core._layer_norm_part_moments(block, sizes, axis=axes)
    else:
        moments["mean"] = 0.0
        moments["m2"], moments["scale"] = _core._rms_norm_part_moments(block, sizes, axis=axes)
    return moments


def _identity(parts: np.ndarray, axis: Tuple[int, ...], keepdims: bool) -> np.ndarray:
    return parts


def _merged_moments(parts: np.ndarray, axis: Tuple[int, ...], keepdims: bool = True) -> np.ndarray:
    """The _MOMENTS of the union of the parts along `axis` (Chan et al.), in the units of the
    largest part's scale (exact powers of two: parts all in units of 1 keep their bits), the
    means taken relative to the first part's so that rows with a large offset keep their last
    bits."""
    count = parts["count"].sum(axis=axis, keepdims=True)
    scale = np.where(parts["count"] > 0, parts["scale"], 0.0).max(axis=axis, keepdims=True)
    scale[scale == 0.0] = 1.0  # only empty parts
    ratio = np.where(parts["count"] > 0, parts["scale"] / scale, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):  # parts holding NaN or Inf, dealt with below
        means = parts["mean"] * ratio
        pivot = means[tuple(slice(0, 1) if a in axis else slice(None) for a in range(parts.ndim))]
        # (a group of empty parts, from chunks of size 0, keeps count 0 and the pivot's mean)
        offset = (parts["count"] * (means - pivot)).sum(axis=axis, keepdims=True)
        mean = pivot + offset / np.maximum(count, 1)
        deviation = means - mean
        m2 = (parts["m2"] * ratio * ratio + parts["count"] * deviation * deviation).sum(axis=axis, keepdims=True)
    # a row holding NaN or Inf has NaN statistics, its mean too, as the kernels give it
    non_finite = (~np.isfinite(parts["mean"]) | ~np.isfinite(parts["m2"])).any(axis=axis, keepdims=True)
    mean[non_finite] = np.nan
    m2[non_finite] = np.nan
    merged = np.empty(count.shape, _MOMENTS)
    merged["count"], merged["mean"], merged["m2"], merged["scale"] = count, mean, m2, scale
    return merged


def _row_statistics(moments: np.ndarray, eps: float) -> np.ndarray:
    """_STATS of each row from its _MOMENTS, as the kernels' exact rows take them (ln_exact.c):
    in the moments' units s, rstd_s = 1 / sqrt(M2_s / n + eps / s**2); where the variance is 0
    or eps / s**2 overflows, eps is all there is, rstd = 1 / sqrt(0 + eps) (-0.0: +inf), in units of 1."""
    scale = moments["scale"]
    variance = moments["m2"] / moments["count"]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # a negative eps: NaN, as the kernels give
        eps_scaled = eps / scale / scale
        eps_only = (variance == 0.0) | ~np.isfinite(eps_scaled)
        stats = np.empty(moments.shape, _STATS)
        stats["mean"] = np.where(eps_only, moments["mean"] * scale, moments["mean"])
        stats["rstd"] = np.where(eps_only, 1.0 / np.sqrt(0.0 + eps), 1.0 / np.sqrt(variance + eps_scaled))
    stats["scale"] = np.where(eps_only, 1.0, scale)
    return stats


def _statistic(field: str, dtype: np.dtype[Any], stats: np.ndarray) -> np.ndarray:
    """One field of _STATS in units of 1 (the mean times the scale, the rstd over it), rounded
    to `dtype`."""
    value = stats["mean"] * stats["scale"] if field == "mean" else stats["rstd"] / stats["scale"]
    return _one_quiet_nan(value).astype(dtype)


def _one_quiet_nan(values: np.ndarray) -> np.ndarray:
    """values (float64) with every NaN the one quiet NaN, as the kernels write it."""
    return np.where(np.isnan(values), np.nan, values)


def _normalized_block(block: np.ndarray, stats: np.ndarray, weight: Optional[np.ndarray],
                      bias: Optional[np.ndarray], *, axes: Tuple[int, ...], centred: bool,
                      row_len: int) -> np.ndarray:
    """(x - mean) * rstd * weight + bias on a chunk of rows of row_len elements, as the kernels
    compute a row from its float64 statistics: one read of the chunk and one write of the
    output."""
    sizes = tuple(block.shape[a] for a in axes)
    if centred:
        return _core._layer_norm_part_normalize(block, sizes, stats["mean"], stats["rstd"], weight, bias,
                                                axis=axes, scale=stats["scale"], row_len=row_len)
    return _core._rms_norm_part_normalize(block, sizes, stats["rstd"], weight, axis=axes, scale=stats["scale"],
                                          row_len=row_len)


def _xhat_and_dy(scratch: _Scratch, slab: Tuple[slice, ...], rows: Tuple[slice, ...], input: np.ndarray,
                 grad_output: np.ndarray, mean: Optional[np.ndarray],
                 rstd: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """xhat = (x - mean) * rstd and grad_output on a slab, in float64."""
    xhat, dy = scratch(input[slab].shape)
    if mean is None:
        np.multiply(input[slab], rstd[rows], out=xhat)
    else:
        np.subtract(input[slab], mean[rows], out=xhat)
        xhat *= rstd[rows]
    np.copyto(dy, grad_output[slab])
    return xhat, dy


def _block_row_sums(input: np.ndarray, grad_output: np.ndarray, mean: Optional[np.ndarray],
                    rstd: np.ndarray, weight: Optional[np.ndarray], *,
                    axes: Tuple[int, ...]) -> np.ndarray:
    """_ROW_SUMS of the chunk's part of each row, sum(g) and sum(g * xhat), as the kernels sum
    a row's (RMSNorm, without a mean: no sum(g)), and its largest magnitudes."""
    sizes = tuple(input.shape[a] for a in axes)
    sums = np.empty(tuple(1 if a in axes else n for a, n in enumerate(input.shape)), _ROW_SUMS)
    parts: Tuple[np.ndarray, ...]
    fields: Tuple[str, ...]
    if mean is None:
        sums["g"] = 0.0
        parts = _core._rms_norm_part_grad_sums(grad_output, input, sizes, rstd, weight, axis=axes)
        fields = _SUMMED[1:] + _LARGEST
    else:
        parts = _core._layer_norm_part_grad_sums(grad_output, input, sizes, mean, rstd, weight, axis=axes)
        fields = _SUMMED + _LARGEST
    for field, part in zip(fields, parts):
        sums[field] = part
    return sums


def _merged_row_sums(parts: np.ndarray, axis: Tuple[int, ...], keepdims: bool = True) -> np.ndarray:
    """The _ROW_SUMS of the union of the parts along `axis`."""
    sums = np.empty(tuple(1 if a in axis else n for a, n in enumerate(parts.shape)), parts.dtype)
    for field in _SUMMED:
        sums[field] = parts[field].sum(axis=axis, keepdims=True)
    for field in _LARGEST:
        sums[field] = parts[field].max(axis=axis, keepdims=True)
    return sums


def _row_means(parts: np.ndarray, axis: Tuple[int, ...], keepdims: bool, row_len: int) -> np.ndarray:
    """The row sums' means, mean(g) and mean(g * xhat), and the row's largest magnitudes."""
    sums = _merged_row_sums(parts, axis)
    for field in _SUMMED:
        sums[field] /= row_len
    return sums


def _grad_input_block(input: np.ndarray, grad_output: np.ndarray, mean: Optional[np.ndarray],
                      rstd: np.ndarray, weight: Optional[np.ndarray], means: np.ndarray, *,
                      axes: Tuple[int, ...]) -> np.ndarray:
    """grad_input = rstd * (g - mean(g) - xhat * mean(g * xhat)) on a chunk (RMSNorm, without a
    mean: without mean(g)), as the kernels compute it from the row means given."""
    sizes = tuple(input.shape[a] for a in axes)
    largest = (means["g_largest"], means["dy_largest"], means["xc_largest"])
    if mean is None:
        return _core._rms_norm_part_grad_input(grad_output, input, sizes, rstd, means["g_xhat"], *largest, weight,
                                               axis=axes)
    return _core._layer_norm_part_grad_input(grad_output, input, sizes, mean, rstd, means["g"], means["g_xhat"],
                                             *largest, weight, axis=axes)


def _block_gradients(which: Tuple[str, ...], input: np.ndarray, grad_output: np.ndarray,
                     mean: Optional[np.ndarray], rstd: np.ndarray, weight: Optional[np.ndarray], *,
                     axes: Tuple[int, ...]) -> np.ndarray:
    """The chunk's part of the parameter gradients named in `which` (grad_weight: the sum of
    grad_output * xhat over the batch axes; grad_bias: of grad_output), stacked, in float64,
    with the batch axes (size 1) first and then the normalized ones in normalized_shape's
    order."""
    chunk = _Chunk(input.shape, axes)
    mean = None if mean is None else mean.astype(np.float64)
    rstd = rstd.astype(np.float64)
    sums = {key: np.zeros(chunk.column_shape) for key in which}
    scratch = _Scratch(2)
    for slab, rows, columns in chunk.slabs():
        xhat, dy = _xhat_and_dy(scratch, slab, rows, input, grad_output, mean, rstd)
        if "grad_weight" in sums:
            sums["grad_weight"][columns] += chunk.column_dot(dy, xhat)
        if "grad_bias" in sums:
            sums["grad_bias"][columns] += chunk.column_sum(dy)
    stacked = np.stack([sums[key] for key in which])
    return stacked.transpose((0,) + tuple(1 + a for a in chunk.batch + axes))
