"""Builds the compiled core, layernorm._layernorm (metadata lives in pyproject.toml).

Environment switches for development builds:
  LAYERNORM_DEBUG=1     -O0 -g, assertions on
  LAYERNORM_SANITIZE=1  AddressSanitizer and UndefinedBehaviorSanitizer, at -O1, assertions on,
                        on the SIMD level the building CPU runs (src/kernel_flags.py)
Release builds (neither switch) carry no debug info.
"""
import os
import runpy
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import numpy
from setuptools import Extension, setup
from setuptools.errors import CompileError
from setuptools.command.build_ext import build_ext

debug_build = bool(os.environ.get("LAYERNORM_DEBUG"))
sanitize = bool(os.environ.get("LAYERNORM_SANITIZE"))
link_args = ["-fsanitize=address,undefined"] if sanitize else []
undef_macros = ["NDEBUG"] if debug_build or sanitize else []  # Python's CFLAGS define it

# The flags live in src/kernel_flags.py, which tests/c/build-driver.sh reads too (run as a
# file: an isolated build does not put this directory on sys.path).
kernel_flags = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "src", "kernel_flags.py"))
platform = sysconfig.get_platform()
if platform.endswith(("x86_64", "amd64")):
    target = "x86_64"
elif platform.endswith(("aarch64", "arm64")):
    target = "aarch64"
else:
    target = platform

# Python's CFLAGS that are CPython's own choices of optimization, debug info, warnings,
# macros and overflow semantics: the kernel sources get the project's instead, so that their
# objects are the same whichever Python builds them.  Python's other flags (the target's,
# such as macOS's -arch) and any CFLAGS from the environment stay.
PYTHON_CHOICES = ("-O", "-g", "-W", "-D", "-U", "-std=", "-fwrapv", "-fno-strict-overflow")


def kernel_compiler_of(compiler):
    """setuptools' compiler command (CC, Python's CFLAGS, CFLAGS from the environment, CCSHARED)
    without Python's own choices (PYTHON_CHOICES)."""
    python_cflags = set((sysconfig.get_config_var("CFLAGS") or "").split())
    return [arg for arg in compiler.compiler_so
            if not (arg in python_cflags and arg.startswith(PYTHON_CHOICES))]


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
        if debug_build or sanitize:
            variant = "-".join(name for name, on in (("debug", debug_build), ("sanitize", sanitize)) if on)
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
            gcc = compiler_is_gcc(compiler)
            binding_flags = extra_postargs + kernel_flags["common_flags"](gcc, debug=debug_build, sanitize=sanitize)
            kernel_compiler = kernel_compiler_of(compiler)

            def compile_object(obj):
                source, source_ext = build[obj]
                if not kernel_flags["is_kernel_source"](source):
                    compiler._compile(obj, source, source_ext, cc_args, binding_flags, pp_opts)
                    return
                flags = kernel_flags["kernel_flags"](source, target, gcc, debug=debug_build, sanitize=sanitize)
                command = kernel_compiler + flags + ["-Isrc", "-c", source, "-o", obj]
                print(" ".join(command), flush=True)
                os.makedirs(os.path.dirname(obj), exist_ok=True)
                if subprocess.run(command).returncode != 0:
                    raise CompileError(f"compiling {source} failed")

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
            extra_link_args=link_args + ["-lpthread", "-lm"],
        )
    ],
)
