#!/usr/bin/env bash
# Builds tests/c/kernel_driver.c with the kernel sources (every src/ln_*.c) into OUTPUT, or,
# when OUTPUT ends in .so, the kernel sources alone into a shared library (for ctypes:
# tests/c/check_reference.py).
#
#   bash tests/c/build-driver.sh COMPILER OUTPUT [EXTRA FLAG...]     e.g. -static for qemu
#
# The kernel sources compile exactly as setup.py compiles them into the extension (the flags
# of src/kernel_flags.py, as position-independent code), so the driver checks the machine code
# the extension runs, and a compiler cache that built one serves the other.  EXTRA FLAGs go to
# the driver's own source and to the link.
set -euo pipefail
cd "$(dirname "$0")/../.."

compiler=$1
output=$2
shift 2
extra=("$@")
driver=(tests/c/kernel_driver.c)
link=()
if [[ $output == *.so ]]; then
  driver=()
  link=(-shared)
fi

case "$("$compiler" -dumpmachine)" in
  x86_64*) target=x86_64 ;;
  aarch64*) target=aarch64 ;;
  *) target=$("$compiler" -dumpmachine) ;;
esac
if "$compiler" -dM -E -x c /dev/null | grep -q __clang__; then kind=clang; else kind=gcc; fi

objects=$(mktemp -d)
trap 'rm -rf "$objects"' EXIT
# The sources compile side by side (the level files take most of the time); a failure is
# reported once all have finished.
compiles=()
for source in src/ln_*.c; do
  read -r -a flags <<<"$(python3 src/kernel_flags.py "$target" "$kind" "$source")"
  "$compiler" -fPIC "${flags[@]}" -Isrc -c "$source" -o "$objects/$(basename "$source" .c).o" &
  compiles+=($!)
done
for source in "${driver[@]}"; do
  "$compiler" -std=c11 -O2 -ffp-contract=off -pthread -Wall -Isrc "${extra[@]}" -c "$source" \
    -o "$objects/$(basename "$source" .c).o" &
  compiles+=($!)
done
failed=0
for compile in "${compiles[@]}"; do
  wait "$compile" || failed=1
done
((failed == 0)) || { echo "build-driver: $compiler failed to compile the kernels" >&2; exit 1; }
mkdir -p "$(dirname "$output")"
"$compiler" "${extra[@]}" "${link[@]}" "$objects"/*.o -o "$output" -lm -pthread
