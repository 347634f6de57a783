"""Builds the compiled core, layernorm._layernorm (metadata lives in pyproject.toml).

Environment switches for development builds:
  LAYERNORM_DEBUG=1     -O0 -g, assertions on
  LAYERNORM_SANITIZE=1  AddressSanitizer and UndefinedBehaviorSanitizer
"""
import os

import numpy
from setuptools import Extension, setup

# Baseline x86-64 code and strict IEEE semantics (no host-specific -march, no fast-math
# flags): the wheel must run on any x86-64 and NaN must stay NaN.  SIMD kernels are chosen at run time (see src/ln_kernels.c).
# -ffp-contract=off keeps every level doing the same roundings (bit-identical results).
compile_args = ["-std=c11", "-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wextra",
                "-Wno-unused-parameter", "-Wno-psabi", "-Wno-missing-field-initializers"]
link_args = []
undef_macros = ["NDEBUG"] if os.environ.get("LAYERNORM_DEBUG") else []
if os.environ.get("LAYERNORM_DEBUG"):
    compile_args += ["-O0", "-g"]
if os.environ.get("LAYERNORM_SANITIZE"):
    compile_args += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]
    link_args += ["-fsanitize=address,undefined"]

setup(
    ext_modules=[
        Extension(
            "layernorm._layernorm",
            sources=["src/_layernorm.c", "src/ln_kernels.c"],
            depends=["src/ln_kernels.h", "src/ln_kernel_impl.h"],
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
