"""Checks written in C, of parts of the kernel layer that need no Python: built here with the C
compiler setuptools would use (CC, else the one Python was built with) and run.  Skipped where
there is no compiler or no source tree.

- tests/c/thread_pool_check.c: the thread pool and the default thread count (src/ln_threads.c),
  built plain and under ThreadSanitizer;
- tests/c/sse2_fma_check.c: the SSE2 level's fused multiply-adds (src/ln_simd_vec128.h), bit
  for bit against the C library's fma() and fmaf(), on x86-64;
- tests/c/odd_rounding_check.c: the rounding to odd of 16 float64 values on their bits
  (src/ln_types.h), against the scalar rounding it stands in for.
"""

import os
import platform
import shlex
import subprocess
import sysconfig

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
CHECK = os.path.join(ROOT, "tests", "c", "thread_pool_check.c")
# the pool, and the large results' blocks its scratch memory may come from
POOL = [os.path.join(ROOT, "src", name) for name in ("ln_threads.c", "ln_buffers.c")]
SSE2_FMA_CHECK = os.path.join(ROOT, "tests", "c", "sse2_fma_check.c")
ODD_ROUNDING_CHECK = os.path.join(ROOT, "tests", "c", "odd_rounding_check.c")
FLAGS = {
    "plain": ["-O2"],
    "thread-sanitizer": ["-O1", "-g", "-fsanitize=thread"],
}


def compiler():
    """The C compiler command, as a list; the test skips without one."""
    command = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    try:
        subprocess.run(command + ["--version"], capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"no C compiler ({command[0]})")
    return command


@pytest.mark.parametrize("build", FLAGS)
def test_thread_pool_check(build, tmp_path):
    if not all(os.path.isfile(path) for path in [CHECK, *POOL]):
        pytest.skip("no source tree next to the tests")
    program = tmp_path / "thread_pool_check"
    built = subprocess.run(
        compiler() + ["-std=c11", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter", "-UNDEBUG",
                      "-I", os.path.join(ROOT, "src"), *FLAGS[build], CHECK, *POOL, "-o", str(program)],
        capture_output=True, text=True, timeout=300)
    if built.returncode != 0 and build == "thread-sanitizer":
        pytest.skip(f"this compiler builds no ThreadSanitizer programs: {built.stderr[-300:]}")
    assert built.returncode == 0, built.stderr
    assert "warning" not in built.stderr, built.stderr
    # a sanitizer preloaded into this interpreter (.ci/sanitize.sh) is not the program's
    env = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
    env["TSAN_OPTIONS"] = "halt_on_error=1"
    ran = subprocess.run([str(program)], capture_output=True, text=True, timeout=600, env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout == "thread_pool_check: ok\n"


def run_plain_check(source, tmp_path):
    """Builds the single-file check `source` at -O3 and runs it: it prints "<name>: ok\\n"."""
    if not os.path.isfile(source):
        pytest.skip("no source tree next to the tests")
    name = os.path.splitext(os.path.basename(source))[0]
    program = tmp_path / name
    built = subprocess.run(
        compiler() + ["-std=c11", "-O3", "-ffp-contract=off", "-Wall", "-Wextra", "-UNDEBUG",
                      "-I", os.path.join(ROOT, "src"), source, "-lm", "-o", str(program)],
        capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    assert "warning" not in built.stderr, built.stderr
    env = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
    ran = subprocess.run([str(program)], capture_output=True, text=True, timeout=600, env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout == f"{name}: ok\n"


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the SSE2 level is x86-64's")
def test_sse2_fma_check(tmp_path):
    run_plain_check(SSE2_FMA_CHECK, tmp_path)


def test_odd_rounding_check(tmp_path):
    run_plain_check(ODD_ROUNDING_CHECK, tmp_path)
