#!/usr/bin/env bash
# The package builds with clang and passes its tests there: builds the extension with CC=clang
# in a new virtual environment, on a copy of the sources in build/clang/ (the working tree's
# in-place build is other legs'), and runs the test suite against it.  That the kernels give
# clang's build the same bits as gcc's is .ci/kernel-bits.sh's check.
#
#   bash .ci/clang.sh                  Debian's default clang
#   CLANG=clang-19 bash .ci/clang.sh   another version (its Debian package has the same name)
#
# Run from anywhere as root; installs the clang asked for from Debian if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/lib.sh

clang=${CLANG:-clang}
ensure_tools "$clang"
echo "clang: $("$clang" --version | head -n 1)"

work=build/clang
copy_sources "$work/src"
python3 -m venv "$work/venv"
cd "$work/src"
# no torch: the tests whose oracle it is skip, the rest check the clang build against the
# float64 reference (the README's test command runs them all with the gcc build)
../venv/bin/python -m pip install -q numpy pytest hypothesis "setuptools>=77"
CC=$clang ../venv/bin/python -m pip install -q --no-build-isolation -e .
extension=layernorm/_layernorm$(../venv/bin/python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
if ! grep -qa "clang version" "$extension"; then
  echo "clang: $extension was not compiled by $clang" >&2
  exit 1
fi
# CC also for the tests that compile C themselves (tests/test_c_checks.py)
CC=$clang ../venv/bin/python -m pytest -q -p no:cacheprovider
echo "clang: ok in ${SECONDS}s"
