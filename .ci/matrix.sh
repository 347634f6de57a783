#!/usr/bin/env bash
# The test suite on the oldest Python and NumPy the package supports (Python 3.9, NumPy 1.23.5)
# and on the newest (Python 3.13, the newest NumPy pip finds for it), without torch: each leg
# in a new virtual environment made from pyenv's Pythons, where pip builds the package as a
# user's `pip install` does (an isolated build against numpy>=2, pyproject's build requirement,
# whose binary runs on the NumPy 1.23 that NPY_TARGET_VERSION in setup.py names).
#
#   bash .ci/matrix.sh                 both legs
#   bash .ci/matrix.sh oldest          one leg: oldest or newest
#
# The Pythons are the newest 3.9.x and 3.13.x in pyenv's versions directory (`pyenv root`, else
# $PYENV_ROOT, else ~/.pyenv); PYTHON_OLDEST / PYTHON_NEWEST name other interpreters.  Each leg
# prints its Python and NumPy versions and pytest's summary line (and the log's tail on failure);
# the script fails when a leg does.  Environments live in build/matrix/.
set -euo pipefail
cd "$(dirname "$0")/.."

# The interpreter of the newest pyenv Python $1.x (e.g. 3.9 -> .../versions/3.9.18/bin/python).
pyenv_python() {
  local root version
  if command -v pyenv >/dev/null; then
    root=$(pyenv root)
  else
    root=${PYENV_ROOT:-$HOME/.pyenv}
  fi
  version=$(find "$root/versions" -mindepth 1 -maxdepth 1 -printf '%f\n' 2>/dev/null |
            grep -E "^${1//./\\.}\.[0-9]+$" | sort -V | tail -n 1 || true)
  if [[ -z $version || ! -x $root/versions/$version/bin/python ]]; then
    echo "matrix: no Python $1 under $root/versions" >&2
    return 1
  fi
  echo "$root/versions/$version/bin/python"
}

# run_leg NAME PYTHON NUMPY_REQUIREMENT: 0 when the suite passes there.
run_leg() {
  local name=$1 python=$2 numpy=$3
  local venv=build/matrix/$name log=build/matrix/$name.log status=0
  rm -rf "$venv"
  # pip's and the build's chatter goes to the log, shown when a step fails
  if ! { "$python" -m venv "$venv" &&
         "$venv/bin/python" -m pip install -q --upgrade pip &&
         "$venv/bin/python" -m pip install -q "$numpy" pytest hypothesis &&
         "$venv/bin/python" -m pip install -q -e .; } >"$log" 2>&1; then
    tail -n 40 "$log"
    echo "matrix $name: setting up the environment failed"
    return 1
  fi
  echo "matrix $name: $("$venv/bin/python" -c 'import sys, numpy
print(f"Python {sys.version.split()[0]}, NumPy {numpy.__version__}")')"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider >>"$log" 2>&1 || status=$?
  if ((status != 0)); then
    tail -n 40 "$log"
  fi
  echo "matrix $name: $(tail -n 1 "$log")"
  return "$status"
}

legs=("${@:-oldest newest}")
read -r -a legs <<<"${legs[*]}"
mkdir -p build/matrix
failed=0
for leg in "${legs[@]}"; do
  case $leg in
    oldest) run_leg oldest "${PYTHON_OLDEST:-$(pyenv_python 3.9)}" "numpy==1.23.5" || failed=1 ;;
    newest) run_leg newest "${PYTHON_NEWEST:-$(pyenv_python 3.13)}" "numpy" || failed=1 ;;
    *) echo "matrix: unknown leg '$leg' (oldest, newest)" >&2; exit 2 ;;
  esac
done
echo "matrix: $( ((failed)) && echo FAILED || echo ok) in ${SECONDS}s"
exit "$failed"
