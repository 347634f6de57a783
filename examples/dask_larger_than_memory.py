"""Normalize an array larger than the memory this process may use, with dask.

The input is generated lazily, chunk by chunk (or read from a .npy file through a memory map,
--input), normalized by layernorm.layer_norm on the dask array, and written chunk by chunk into a
.npy file on disk with dask.array.store: no more than a few chunks are ever in memory.  The
script samples the process's anonymous memory (Linux: RssAnon in /proc/self/status, which the
memory-mapped files do not count in), prints its peak and fails if that exceeded --memory-limit.
Then it checks a few rows of the file against layernorm on NumPy (bit for bit: each chunk holds
whole rows, and layernorm's dask graph runs the same kernel on each).

    python examples/dask_larger_than_memory.py                       # 4 GiB in, 4 GiB out, 1 GiB allowed
    python examples/dask_larger_than_memory.py --rows 65536 --chunk-rows 4096 --memory-limit 128
    python examples/dask_larger_than_memory.py --input big.npy --output normalized.npy

Needs dask (python -m pip install "dask[array]") and the disk space for the output.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import dask.array as da
import numpy as np

import layernorm

CHECKED_ROWS = 4


class PeakMemory:
    """Samples the process's anonymous resident memory in a background thread."""

    def __init__(self, interval=0.005):
        self.interval = interval
        self.baseline = self.peak = self.read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def read():
        """RssAnon in bytes (Linux), or None where /proc/self/status has none."""
        try:
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("RssAnon:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.read())

    def __enter__(self):
        if self.baseline is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc_info):
        if self.baseline is not None:
            self._stop.set()
            self._thread.join()


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2**20, help="rows of the generated input (default 2**20)")
    parser.add_argument("--cols", type=int, default=1024, help="row length, normalized over (default 1024)")
    parser.add_argument("--chunk-rows", type=int, default=16384, help="rows per chunk (default 16384: 64 MiB)")
    parser.add_argument("--input", help="a 2-d float .npy file to normalize instead of generated data")
    parser.add_argument("--output", help="the .npy file to write (default: one in a temporary directory)")
    parser.add_argument("--memory-limit", type=float, default=1024,
                        help="MiB of anonymous memory the run may add to what it held at the start (default 1024)")
    return parser.parse_args(argv)


def source(arguments):
    """The input as a lazy dask array: a .npy file's memory map, or float32 normal values
    generated chunk by chunk from a seed."""
    if arguments.input:
        data = np.load(arguments.input, mmap_mode="r")
        return da.from_array(data, chunks=(arguments.chunk_rows, data.shape[1]))
    rng = da.random.default_rng(0)
    shape = (arguments.rows, arguments.cols)
    return rng.standard_normal(shape, chunks=(arguments.chunk_rows, arguments.cols), dtype=np.float32)


def main(argv=None):
    arguments = parse_arguments(argv)
    x = source(arguments)
    cols = x.shape[1]
    weight = np.linspace(0.5, 1.5, cols, dtype=np.float32)
    bias = np.linspace(-1, 1, cols, dtype=np.float32)
    y = layernorm.layer_norm(x, cols, weight, bias)  # lazy: nothing is computed yet

    with tempfile.TemporaryDirectory() as scratch:
        path = arguments.output or os.path.join(scratch, "normalized.npy")
        target = np.lib.format.open_memmap(path, mode="w+", dtype=y.dtype, shape=y.shape)
        started = time.perf_counter()
        with PeakMemory() as memory:
            da.store(y, target)  # chunk by chunk: computed, written, released
        target.flush()
        seconds = time.perf_counter() - started
        print(f"normalized {x.shape[0]} x {cols} {x.dtype} ({x.nbytes / 2**30:.2f} GiB) in chunks of"
              f" {x.chunksize[0]} rows ({np.prod(x.chunksize) * x.dtype.itemsize / 2**20:.0f} MiB) into"
              f" {path if arguments.output else 'a temporary file (--output PATH keeps it)'}"
              f" in {seconds:.1f} s")

        rows = np.linspace(0, x.shape[0] - 1, CHECKED_ROWS).astype(int).tolist()
        expected = layernorm.layer_norm(x[rows].compute(), cols, weight, bias)
        written = np.load(path, mmap_mode="r")[rows]
        if not np.array_equal(written, expected):
            sys.exit(f"rows {rows} of {path} differ from layernorm on NumPy")
        print(f"rows {rows}: bit-identical to layernorm.layer_norm on NumPy")

    if memory.baseline is None:
        print("peak memory: not measured (no RssAnon in /proc/self/status on this system)")
        return
    added = (memory.peak - memory.baseline) / 2**20
    print(f"peak anonymous memory: {memory.peak / 2**20:.0f} MiB, {added:.0f} MiB above the"
          f" {memory.baseline / 2**20:.0f} MiB at the start (limit {arguments.memory_limit:g} MiB;"
          f" the array is {x.nbytes / 2**20:.0f} MiB)")
    if added > arguments.memory_limit:
        sys.exit(f"the run used {added:.0f} MiB, more than --memory-limit {arguments.memory_limit:g} MiB")


if __name__ == "__main__":
    main()
