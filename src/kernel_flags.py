"""The compile flags of the C sources, in one place for the two builds of the kernel layer:
setup.py's, into the extension, and tests/c/build-driver.sh's, into the C driver that checks
the kernels' bits.  Both compile each kernel source (src/ln_*.c, which includes no Python or
NumPy header) as

    <compiler> <target flags> <kernel_flags(...)> -Isrc -c src/ln_<name>.c -o <object>

so the driver runs the machine code the extension runs, and a compiler cache (ccache) that
has compiled one serves the other, and serves every Python version alike.

    python3 src/kernel_flags.py TARGET COMPILER_KIND SOURCE   (as build-driver.sh asks)

prints the flags of one source in a release build: TARGET is x86_64, aarch64 or another
machine name; COMPILER_KIND is gcc or clang.

Baseline code for the target and strict IEEE semantics: no host-specific -march and no
fast-math flags (the extension must run on any CPU of its architecture and NaN must stay
NaN); SIMD kernels are chosen at run time (src/ln_dispatch.c).  -ffp-contract=off keeps
every level doing the same roundings (bit-identical results).
"""
import os
import sys

# every C source: the kernels and the binding
COMMON = ["-std=c11", "-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wextra",
          "-Wno-unused-parameter", "-Wno-psabi", "-Wno-missing-field-initializers"]

# -fno-wrapv undoes the -fwrapv of Python's own CFLAGS (the binding's), so UBSan sees signed
# overflow; -O1, as the sanitizers advise, builds in half the time of -O3 and checks the same
# accesses; UBSan's object-size check, which ASan's bounds checks subsume, took a third of
# the build.
SANITIZE = ["-O1", "-fsanitize=address,undefined", "-fno-sanitize=object-size", "-fno-wrapv",
            "-fno-omit-frame-pointer", "-g"]
# GCC's variable tracking for -g took half of the sanitizer build's time; stack traces need only
# the line numbers.
GCC_ONLY_SANITIZE = ["-fno-var-tracking-assignments", "-fno-var-tracking"]
# The SIMD level instrumented (see kernel_flags) without ASan's use-after-scope check: poisoning
# each stack buffer of the row kernels, always inlined, at every scope's end took the build of
# the avx2 level from 276 s to 517 s of CPU on the 2-core AMD machine (GCC 12, two compiles side
# by side; UBSan alone: 204 s).  Its stack buffers keep their redzones, so overflows are still
# found; a pointer to a block's buffer used after the block has ended is not.  The sources
# around the levels keep the check.
SANITIZE_LEVEL = ["-fno-sanitize-address-use-after-scope"]
DEBUG = ["-O0", "-g"]  # after the sanitizers' -O1: both switches build at -O0
# Release builds carry no debug info (Python's CFLAGS add -g: 3.5 MB on a 0.8 MB extension),
# and the kernels' assertions are off.
RELEASE = ["-g0"]
RELEASE_KERNELS = ["-DNDEBUG"]

# To GCC alone (clang warns of them): -O3's loop unswitching copied each loop once per
# combination of the layout tests it hoisted (the strided and residual routes test several
# arrays'), a fifth of the vector levels' build time, with no speed difference measured; the
# loops that gained from it compile their common case apart instead (LN_AFFINE_LOOP_APART).
# -O3's load CSE after register allocation took 21% of the AVX2 level's compile and 30% of the
# SSE2 level's (60 s and 182 s of CPU) and removed 136 of the 318,000 instructions it had then:
# no speed difference measured, and the same bits (it moves loads, not arithmetic).
GCC_ONLY = ["-fno-unswitch-loops", "-fno-gcse-after-reload"]

# One translation unit per SIMD level, each compiled for its own instruction set; the x86
# levels exist only in x86-64 builds (their sources compile to nothing elsewhere).
X86_LEVELS = {
    "ln_level_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "ln_level_avx512.c": ["-mavx512f", "-mavx512bw", "-mavx2", "-mfma", "-mf16c"],
    "ln_level_avx512_bf16.c": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512bf16", "-mavx2", "-mfma",
                               "-mf16c"],
}
# The scalar level, which runs only when asked for (ln_simd_set) wherever a vector level is
# built, is optimized for size in release builds (same bits: 11 s to compile instead of 45 s
# at -O3, and 2-5x slower).  The others stay at -O3: at -O2 GCC kept the accumulators of
# short rows in memory (4x20 float32 forward 10% slower, 2048x1024 float16 backward 11%), and
# the SSE2 level, the one x86-64 CPUs without AVX2 and FMA run, took 2.4-4x as long at -Os
# (512x768 float32, forward and backward), copying its 64-byte groups with `rep movs`.
SIZE_OPTIMIZED = {"ln_level_scalar.c": ["-Os"]}


def is_kernel_source(source):
    """Whether SOURCE is one of the kernel layer's (src/ln_*.c), which include no Python header."""
    return os.path.basename(source).startswith("ln_")


def common_flags(compiler_is_gcc, debug=False, sanitize=False):
    """The flags of every C source, the binding's included."""
    flags = list(COMMON)
    if sanitize:
        flags += SANITIZE
    if debug:
        flags += DEBUG
    if not (debug or sanitize):
        flags += RELEASE
    if compiler_is_gcc:
        flags += GCC_ONLY + (GCC_ONLY_SANITIZE if sanitize else [])
    return flags


# The x86-64 levels from best to least, as ln_dispatch.c picks them.
X86_DISPATCH_ORDER = ["ln_level_avx512_bf16.c", "ln_level_avx512.c", "ln_level_avx2.c", "ln_level_vec128.c"]


def building_cpu_features():
    """The instruction sets of the CPU this build runs on, as GCC's -m flags name them (None where
    the system does not list them: /proc/cpuinfo is Linux's)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            features = next(line for line in cpuinfo if line.startswith("flags")).split(":", 1)[1].split()
    except (OSError, StopIteration):
        return None
    return {name.replace("avx512_bf16", "avx512bf16") for name in features}  # Linux's spelling


def dispatched_on_building_cpu(source, target):
    """Whether the kernel source SOURCE holds code that the building CPU runs at its default level:
    every source but the level units; of those, the best level the CPU has (as ln_dispatch.c
    picks it, with avx512 beside avx512bf16, whose kernels serve the other types), and on a
    target without vector levels the scalar one.  True of every level where the CPU's features
    are not known."""
    name = os.path.basename(source)
    if not name.startswith("ln_level_") or target not in ("x86_64", "aarch64"):
        return True
    if target == "aarch64":
        return name == "ln_level_vec128.c"
    features = building_cpu_features()
    if features is None:
        return True
    runs = [level for level in X86_DISPATCH_ORDER
            if all(flag[2:] in features for flag in X86_LEVELS.get(level, []))]
    return name == runs[0] or (runs[0] == "ln_level_avx512_bf16.c" and name == "ln_level_avx512.c")


def kernel_flags(source, target, compiler_is_gcc, debug=False, sanitize=False):
    """The flags of the kernel source SOURCE for TARGET ("x86_64", "aarch64", ...)."""
    name = os.path.basename(source)
    # A sanitizer build serves the tests of the machine that builds it, and checks the code their
    # calls run: the level its CPU runs unless told otherwise.  The other levels, which only the
    # tests comparing levels' bits run, compile as in a release build (ASan allows code without
    # its checks), and a compiler cache that holds the release build's objects serves them.  They
    # share the row kernels' source (src/ln_rows.h) with the level instrumented, and
    # instrumenting them took most of the build's time: on an AVX2 CPU, 626 s of CPU with the
    # avx2 level instrumented against about 2400 s with scalar, sse2 and avx2 (both with the
    # use-after-scope check that SANITIZE_LEVEL now leaves out).
    if sanitize and not dispatched_on_building_cpu(name, target):
        sanitize = False
    release = not (debug or sanitize)
    flags = common_flags(compiler_is_gcc, debug, sanitize)
    if sanitize and name.startswith("ln_level_"):
        flags += SANITIZE_LEVEL
    if release:
        flags += RELEASE_KERNELS + SIZE_OPTIMIZED.get(name, [])
    if target == "x86_64":
        flags += X86_LEVELS.get(name, [])
    return flags


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[2] not in ("gcc", "clang"):
        sys.exit("usage: python3 src/kernel_flags.py TARGET gcc|clang SOURCE")
    print(" ".join(kernel_flags(sys.argv[3], sys.argv[1], sys.argv[2] == "gcc")))
