#!/usr/bin/env bash
# The kernel layer gives the same bits on aarch64 as on x86-64: builds the C kernel driver
# (tests/c) natively and for aarch64 (static, run under qemu-user), and checks that every case
# gives one hash at every SIMD level and thread count on both architectures.
# Run from anywhere as root; installs the cross compiler and qemu from Debian if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v aarch64-linux-gnu-gcc >/dev/null || missing+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
command -v qemu-aarch64 >/dev/null || command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user)
if ((${#missing[@]})); then
  echo "cross-aarch64: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # The lock timeout waits for another apt run instead of failing.
  apt-get update -qq -o DPkg::Lock::Timeout=600
  apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 "${missing[@]}" >/dev/null
fi
qemu=$(command -v qemu-aarch64 || command -v qemu-aarch64-static)

out=build/kernel-driver
native=$(uname -m)-gcc
bash tests/c/build-driver.sh gcc "$out/$native" &
native_build=$!
# On failure, waits for the native build so as to leave nothing running.
bash tests/c/build-driver.sh aarch64-linux-gnu-gcc "$out/aarch64-gcc" -static || { wait "$native_build"; exit 1; }
wait "$native_build"

"$out/$native" >"$out/$native.txt"
"$qemu" "$out/aarch64-gcc" >"$out/aarch64-gcc.txt"
python3 tests/c/check_levels.py "$out/$native.txt" "$out/aarch64-gcc.txt"
echo "cross-aarch64: ok in ${SECONDS}s"
