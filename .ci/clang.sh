#!/usr/bin/env bash
# The package builds with clang and its results do not depend on the compiler: builds the C
# kernel driver (tests/c) with clang and with gcc and checks that every case gives one hash
# with both, then builds the extension with CC=clang in a new virtual environment and runs
# the test suite against it.
#
#   bash .ci/clang.sh                  Debian's default clang
#   CLANG=clang-19 bash .ci/clang.sh   another version (its Debian package has the same name)
#
# Run from anywhere as root; installs the clang asked for from Debian if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

clang=${CLANG:-clang}
if ! command -v "$clang" >/dev/null; then
  echo "clang: installing $clang"
  export DEBIAN_FRONTEND=noninteractive
  # The lock timeout waits for another apt run instead of failing.
  apt-get update -qq -o DPkg::Lock::Timeout=600
  apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 "$clang" >/dev/null
fi
echo "clang: $("$clang" --version | head -n 1)"

out=build/kernel-driver
native=$(uname -m)
bash tests/c/build-driver.sh gcc "$out/$native-gcc" &
gcc_build=$!
# On failure, waits for the gcc build so as to leave nothing running.
bash tests/c/build-driver.sh "$clang" "$out/$native-clang" || { wait "$gcc_build"; exit 1; }
wait "$gcc_build"
"$out/$native-gcc" >"$out/$native-gcc.txt"
"$out/$native-clang" >"$out/$native-clang.txt"
python3 tests/c/check_levels.py "$out/$native-gcc.txt" "$out/$native-clang.txt"

venv=build/venv-clang
[[ -x $venv/bin/python ]] || python3 -m venv "$venv"
# no torch: the tests whose oracle it is skip, the rest check the clang build against the
# float64 reference (the README's test command runs them all with the gcc build)
"$venv/bin/python" -m pip install -q numpy pytest hypothesis "setuptools>=77"
# An editable install builds in a new temporary directory each time, so nothing built before
# by another compiler is reused; the package metadata it installs is what the suite expects.
CC=$clang "$venv/bin/python" -m pip install -q --no-build-isolation -e .
# this Python's build of the extension (other legs of CI may have left other Pythons' beside it)
extension=layernorm/_layernorm$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
if ! grep -qa "clang version" "$extension"; then
  echo "clang: $extension was not compiled by $clang" >&2
  exit 1
fi
# CC also for the tests that compile C themselves (tests/test_thread_pool.py)
CC=$clang "$venv/bin/python" -m pytest -q
echo "clang: ok in ${SECONDS}s"
