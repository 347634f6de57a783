#!/usr/bin/env bash
# The test suite, and the fuzz test's long profile, against an AddressSanitizer +
# UndefinedBehaviorSanitizer build of the extension (setup.py's LAYERNORM_SANITIZE=1), in a new
# virtual environment (without torch), on a copy of the sources in build/sanitize/ so that the
# in-place build of the working tree is left alone.  Any sanitizer report stops the run.
#
#   bash .ci/sanitize.sh                          suite + 1000 long-profile fuzz examples a test
#   FUZZ_EXAMPLES=5000 FUZZ_SEED=7 bash .ci/sanitize.sh    more fuzzing, other examples
#
# The fuzz examples come from a fixed seed (FUZZ_SEED, 0 unless set), so that a run fails or
# passes the same way every time: the long profile's random seeds find the kernel's rare
# numerical defects (LAYERNORM_FUZZ=long, see tests/test_fuzz.py), which are no sanitizer's
# finding and would make this leg fail at random.
#
# setup.py's sanitizer build checks the assertions and signed overflow (undoing Python's -DNDEBUG
# and -fwrapv), and instruments the SIMD level this machine's CPU runs (with the sources around
# the levels): the other levels, which only the tests comparing levels' bits run, compile as in
# a release build (src/kernel_flags.py), from the compiler cache when try-it has built them.
# Needs gcc with libasan and libubsan.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/lib.sh

work=build/sanitize
copy_sources "$work"

echo "sanitize: building (a few minutes; log in $work/build.log)"
python3 -m venv "$work/venv"
(
  cd "$work"
  venv/bin/python -m pip install -q --upgrade numpy pytest hypothesis "setuptools>=77"
  LAYERNORM_SANITIZE=1 venv/bin/python setup.py -q build_ext --inplace
  venv/bin/python setup.py -q egg_info  # the package's metadata, which the tests read
) >"$work/build.log" 2>&1 || { tail -n 40 "$work/build.log"; exit 1; }

# The interpreter's own allocations outlive it: no leak report.  Allocations that cannot be had
# return NULL (the tests expect a MemoryError), as without the sanitizer.
export LD_PRELOAD
LD_PRELOAD=$(gcc -print-file-name=libasan.so)
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:allocator_may_return_null=1:abort_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
# Left out: tests that measure resident memory or wall time (they measure the sanitizer's
# allocator, whose quarantine keeps freed memory, and its slowness).
skip="not memory_flat and not gil_released and not keeps_the_input and not keeps_nothing"

# pytest's summary, or on a failure the end of its output (a sanitizer's report, or the failing
# example with the seed that reproduces it); the whole of it stays in $work/<log>.
run_pytest() {
  local log=$1
  shift
  if venv/bin/python -m pytest -q -p no:cacheprovider -rfE -k "$skip" "$@" >"$log" 2>&1; then
    tail -n 1 "$log"
  else
    tail -n 150 "$log"
    echo "sanitize: FAILED (the whole output: $work/$log)"
    exit 1
  fi
}

cd "$work"
echo "sanitize: suite"
run_pytest suite.log
echo "sanitize: fuzz, long profile, ${FUZZ_EXAMPLES:-1000} examples a test, seed ${FUZZ_SEED:-0}"
LAYERNORM_FUZZ=long LAYERNORM_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-1000} \
  run_pytest fuzz.log --hypothesis-seed="${FUZZ_SEED:-0}" tests/test_fuzz.py
echo "sanitize: ok in ${SECONDS}s (no sanitizer reports)"
