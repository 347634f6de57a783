#!/usr/bin/env bash
# Static types, in a new virtual environment: `mypy --strict` over the package and over
# tests/typing/public_api.py, a typed example that calls every public function and class as a
# user would (its assert_type lines pin what each returns); mypy's stubtest against the compiled
# core's stub; then the example is run, so it stays true at run time too.
#
#   bash .ci/typecheck.sh                     in a new virtual environment, the package installed there
#   VENV=.venv-ci-try bash .ci/typecheck.sh   in one where the package is installed (.ci/run's
#                                             try-it environment): mypy is added to it
set -euo pipefail
cd "$(dirname "$0")/.."

work=build/typecheck
rm -rf "$work"
mkdir -p "$work"
venv=${VENV:-$work/venv}
# mypy is a CI tool, not a test dependency of the package: it is installed here, in the
# environment this script makes or is given, and the `test` extra does not list it.
{
  if [[ -z ${VENV:-} ]]; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -e .
  fi
  "$venv/bin/python" -m pip install -q mypy numpy typing_extensions
} >"$work/setup.log" 2>&1 || { tail -n 40 "$work/setup.log"; exit 1; }
echo "typecheck: $("$venv/bin/python" -m mypy --version), NumPy $("$venv/bin/python" -c 'import numpy; print(numpy.__version__)')"

# torch, ml_dtypes and dask are optional and not installed here (pip would fetch torch's CUDA
# build): the package looks them up only when they are there.  dask is skipped where it is
# installed too: its functions carry no types, which --strict refuses to call.
cat >"$work/mypy.ini" <<'CONFIG'
[mypy]
strict = True
[mypy-torch,torch.*,ml_dtypes,ml_dtypes.*]
ignore_missing_imports = True
[mypy-dask,dask.*]
ignore_missing_imports = True
follow_imports = skip
CONFIG
"$venv/bin/python" -m mypy --config-file "$work/mypy.ini" --cache-dir "$work/mypy-cache" \
  layernorm tests/typing/public_api.py
"$venv/bin/python" -m mypy.stubtest --mypy-config-file "$work/mypy.ini" layernorm._layernorm
"$venv/bin/python" tests/typing/public_api.py
echo "typecheck: ok in ${SECONDS}s"
