"""The thread pool and the default thread count (src/ln_threads.c), checked in C by
tests/c/thread_pool_check.c: built here with the C compiler setuptools would use (CC, else
the one Python was built with), plain and under ThreadSanitizer, and run.  Skipped where there
is no compiler or no source tree.
"""

import os
import shlex
import subprocess
import sysconfig

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
CHECK = os.path.join(ROOT, "tests", "c", "thread_pool_check.c")
POOL = os.path.join(ROOT, "src", "ln_threads.c")
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
    if not os.path.isfile(CHECK) or not os.path.isfile(POOL):
        pytest.skip("no source tree next to the tests")
    program = tmp_path / "thread_pool_check"
    built = subprocess.run(
        compiler() + ["-std=c11", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter", "-UNDEBUG",
                      "-I", os.path.join(ROOT, "src"), *FLAGS[build], CHECK, POOL, "-o", str(program)],
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
