#!/usr/bin/env bash
# The kernel layer's results depend neither on the compiler nor on the architecture: builds the
# C kernel driver (tests/c) with gcc and with clang for this machine, and with gcc for aarch64
# (static, run under qemu-user), and checks that every case gives one hash at every SIMD level
# and thread count in all three.
#
#   bash .ci/kernel-bits.sh                   Debian's default clang
#   CLANG=clang-19 bash .ci/kernel-bits.sh    another version (its Debian package has the same name)
#
# Run from anywhere as root; installs clang, the cross compiler and qemu from Debian if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/lib.sh

clang=${CLANG:-clang}
ensure_tools "$clang" aarch64-gcc qemu-aarch64
qemu=$(command -v qemu-aarch64 || command -v qemu-aarch64-static)
echo "kernel-bits: $(gcc --version | head -n 1); $("$clang" --version | head -n 1); $(aarch64-linux-gnu-gcc --version | head -n 1)"

out=build/kernel-driver
native=$(uname -m)
builds=()
bash tests/c/build-driver.sh gcc "$out/$native-gcc" & builds+=($!)
bash tests/c/build-driver.sh "$clang" "$out/$native-clang" & builds+=($!)
bash tests/c/build-driver.sh aarch64-linux-gnu-gcc "$out/aarch64-gcc" -static & builds+=($!)
failed=0
for build in "${builds[@]}"; do
  wait "$build" || failed=1
done
((failed == 0)) || exit 1

# the slow one under emulation, beside the two native runs
"$qemu" "$out/aarch64-gcc" >"$out/aarch64-gcc.txt" & emulated=$!
"$out/$native-gcc" >"$out/$native-gcc.txt"
"$out/$native-clang" >"$out/$native-clang.txt"
wait "$emulated"
python3 tests/c/check_levels.py "$out/$native-gcc.txt" "$out/$native-clang.txt" "$out/aarch64-gcc.txt"
echo "kernel-bits: ok in ${SECONDS}s"
