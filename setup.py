"""Builds the compiled core, layernorm._layernorm (metadata lives in pyproject.toml).

Environment switches for development builds:
  LAYERNORM_DEBUG=1     -O0 -g, assertions on
  LAYERNORM_SANITIZE=1  AddressSanitizer and UndefinedBehaviorSanitizer, at -O1
Release builds (neither switch) carry no debug info.
"""
import os
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Baseline code for the target and strict IEEE semantics (no host-specific -march, no
# fast-math flags): the wheel must run on any CPU of its architecture and NaN must stay NaN.
# SIMD kernels are chosen at run time (src/ln_dispatch.c).  -ffp-contract=off keeps every
# level doing the same roundings (bit-identical results).
compile_args = ["-std=c11", "-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wextra",
                "-Wno-unused-parameter", "-Wno-psabi", "-Wno-missing-field-initializers"]
link_args = []
debug = bool(os.environ.get("LAYERNORM_DEBUG"))
sanitize = bool(os.environ.get("LAYERNORM_SANITIZE"))
undef_macros = ["NDEBUG"] if debug else []
if sanitize:
    # -fno-wrapv undoes the -fwrapv of Python's own CFLAGS, so UBSan sees signed overflow;
    # -O1, as the sanitizers advise, builds in half the time of -O3 and checks the same accesses;
    # UBSan's object-size check, which ASan's bounds checks subsume, took a third of the build
    compile_args += ["-O1", "-fsanitize=address,undefined", "-fno-sanitize=object-size", "-fno-wrapv",
                     "-fno-omit-frame-pointer", "-g"]
    link_args += ["-fsanitize=address,undefined"]
if debug:
    compile_args += ["-O0", "-g"]  # after the sanitizers' -O1: both switches build at -O0
release = not (debug or sanitize)
if release:
    # Release builds carry no debug info: Python's CFLAGS add -g (3.5 MB on a 0.8 MB extension).
    compile_args.append("-g0")

# One translation unit per SIMD level, each compiled for its own instruction set; the x86
# levels exist only in x86-64 builds (their sources compile to nothing elsewhere).
# The scalar level, which runs only when asked for (ln_simd_set) wherever a vector level is
# built, is optimized for size (-Os, same bits: 11 s to compile instead of 45 s at -O3, and
# 2-5x slower).  The others stay at -O3: at -O2 GCC kept the accumulators of short rows in
# memory (4x20 float32 forward 10% slower, 2048x1024 float16 backward 11%), and the SSE2
# level, the one x86-64 CPUs without AVX2 and FMA run, took 2.4-4x as long at -Os (512x768
# float32, forward and backward), copying its 64-byte groups with `rep movs`.
# GCC_ONLY_ARGS go to GCC alone (clang warns of them): -O3's loop unswitching copied each
# loop once per combination of the layout tests it hoisted (the strided and residual routes
# test several arrays'), a fifth of the vector levels' build time, with no speed difference
# measured; the loops that gained from it compile their common case apart instead
# (LN_AFFINE_LOOP_APART).
LEVEL_FLAGS = {}
GCC_ONLY_ARGS = ["-fno-unswitch-loops"]
platform = sysconfig.get_platform()
size_optimized = ["-Os"] if release else []
if platform.endswith(("x86_64", "amd64")):
    LEVEL_FLAGS = {
        os.path.normpath("src/ln_level_scalar.c"): size_optimized,
        os.path.normpath("src/ln_level_avx2.c"): ["-mavx2", "-mfma", "-mf16c"],
        os.path.normpath("src/ln_level_avx512.c"): ["-mavx512f", "-mavx512bw", "-mavx2", "-mfma", "-mf16c"],
        os.path.normpath("src/ln_level_avx512_bf16.c"): ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512bf16",
                                                        "-mavx2", "-mfma", "-mf16c"],
    }
elif platform.endswith(("aarch64", "arm64")):
    LEVEL_FLAGS = {os.path.normpath("src/ln_level_scalar.c"): size_optimized}


def compiler_is_gcc(compiler):
    """Whether setuptools' C compiler is GCC: clang defines __GNUC__ too, and __clang__."""
    command = list(compiler.compiler_so) + ["-dM", "-E", "-x", "c", os.devnull]
    try:
        macros = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return False
    return "__GNUC__" in macros and "__clang__" not in macros


class BuildExt(build_ext):
    """build_ext that compiles an extension's sources in parallel, each with its level's flags.

    setuptools compiles one source after another; the SIMD levels are the slow ones and
    independent, so they go to a pool of os.cpu_count() threads (each runs a compiler process).
    """

    def finalize_options(self):
        super().finalize_options()
        # A development build's objects and extension go to directories of their own: in the
        # release build's, setuptools would take them for up to date, and a release build
        # after a debug one linked the debug objects of every source it had not changed.
        if not release:
            variant = "-".join(name for name, on in (("debug", debug), ("sanitize", sanitize)) if on)
            self.build_temp += "-" + variant
            self.build_lib += "-" + variant

    def copy_extensions_to_source(self):
        # always: setuptools skips the copy where the package's extension is the newer, which
        # it is when it is the other variant's
        force, self.force = self.force, True
        try:
            super().copy_extensions_to_source()
        finally:
            self.force = force

    def build_extension(self, ext):
        compiler = self.compiler
        # Pythons built with --enable-shared (pyenv's among them) link with -Wl,-rpath to their
        # own lib/; an extension loads no libpython, so that path would only leak into the wheel.
        compiler.linker_so = [arg for arg in compiler.linker_so if not arg.startswith("-Wl,-rpath")]
        listed = {os.path.normpath(source): index for index, source in enumerate(ext.sources)}

        def compile_sources(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                            extra_preargs=None, extra_postargs=None, depends=None):
            macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs)
            cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
            if compiler_is_gcc(compiler):
                extra_postargs = extra_postargs + GCC_ONLY_ARGS

            def compile_object(obj):
                source, source_ext = build[obj]
                flags = LEVEL_FLAGS.get(os.path.normpath(source), [])
                compiler._compile(obj, source, source_ext, cc_args, extra_postargs + flags, pp_opts)

            # in the order ext.sources lists them (setuptools sorts them by name)
            stale = sorted((obj for obj in objects if obj in build),
                           key=lambda obj: listed.get(os.path.normpath(build[obj][0]), len(listed)))
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                list(pool.map(compile_object, stale))
            return objects

        compiler.compile = compile_sources
        super().build_extension(ext)


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "layernorm._layernorm",
            # slowest to compile first: they start first in BuildExt's pool
            sources=["src/ln_level_avx2.c", "src/ln_level_avx512.c", "src/ln_level_vec128.c", "src/ln_level_scalar.c",
                     "src/ln_level_avx512_bf16.c",
                     "src/_layernorm.c", "src/ln_backward.c", "src/ln_forward.c",
                     "src/ln_parts.c", "src/ln_threads.c", "src/ln_dispatch.c", "src/ln_layout.c",
                     "src/ln_exact.c", "src/ln_buffers.c"],
            depends=["src/ln_kernels.h", "src/ln_layout.h", "src/ln_internal.h", "src/ln_types.h", "src/ln_tuning.h",
                     "src/ln_rows.h", "src/ln_simd_group.h", "src/ln_simd_scalar.h",
                     "src/ln_simd_vec128.h", "src/ln_simd_avx2.h", "src/ln_simd_avx512.h"],
            include_dirs=[numpy.get_include(), "src"],
            define_macros=[
                ("NPY_NO_DEPRECATED_API", "NPY_1_23_API_VERSION"),
                ("NPY_TARGET_VERSION", "NPY_1_23_API_VERSION"),
            ],
            undef_macros=undef_macros,
            extra_compile_args=compile_args,
            extra_link_args=link_args + ["-lpthread", "-lm"],
        )
    ],
)
