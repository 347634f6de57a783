#!/usr/bin/env bash
# Builds tests/c/kernel_driver.c with the kernel sources (every src/ln_*.c) into OUTPUT, or,
# when OUTPUT ends in .so, the kernel sources alone into a shared library (for ctypes:
# tests/c/check_reference.py).
#
#   bash tests/c/build-driver.sh COMPILER OUTPUT [EXTRA FLAG...]     e.g. -static for qemu
#
# The flags are the package's (setup.py): no host-specific -march, no fast-math, and
# -ffp-contract=off so that every level does the same roundings.  The AVX2/AVX-512 level
# files get their target flags, and are built only when the compiler targets x86-64; the
# scalar level, which setup.py optimizes for size, is built with -Os here too.
set -euo pipefail
cd "$(dirname "$0")/../.."

compiler=$1
output=$2
shift 2
common=(-std=c11 -O2 -ffp-contract=off -fno-math-errno -pthread -Wall -Isrc "$@")
sources=(tests/c/kernel_driver.c src/ln_*.c)
link=()
if [[ $output == *.so ]]; then
  common+=(-fPIC)
  sources=(src/ln_*.c)
  link=(-shared)
fi

case "$("$compiler" -dumpmachine)" in
  x86_64*) x86=1 ;;
  *) x86=0 ;;
esac

objects=$(mktemp -d)
trap 'rm -rf "$objects"' EXIT
# The sources compile side by side (the level files take most of the time); a failure is
# reported once all have finished.
compiles=()
for source in "${sources[@]}"; do
  flags=()
  case "$(basename "$source")" in
    ln_level_avx2.c) [[ $x86 == 1 ]] || continue; flags=(-mavx2 -mfma -mf16c) ;;
    ln_level_avx512.c) [[ $x86 == 1 ]] || continue; flags=(-mavx512f -mavx512bw -mavx2 -mfma -mf16c) ;;
    ln_level_avx512_bf16.c) [[ $x86 == 1 ]] || continue
      flags=(-mavx512f -mavx512bw -mavx512dq -mavx512bf16 -mavx2 -mfma -mf16c) ;;
    ln_level_scalar.c) flags=(-Os) ;;
  esac
  "$compiler" "${common[@]}" "${flags[@]}" -c "$source" -o "$objects/$(basename "$source" .c).o" &
  compiles+=($!)
done
failed=0
for compile in "${compiles[@]}"; do
  wait "$compile" || failed=1
done
((failed == 0)) || { echo "build-driver: $compiler failed to compile the kernels" >&2; exit 1; }
mkdir -p "$(dirname "$output")"
"$compiler" "${common[@]}" "${link[@]}" "$objects"/*.o -o "$output" -lm -pthread
