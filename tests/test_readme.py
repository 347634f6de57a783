"""The README's examples run, and print what the README says they print (the ones that compare
with torch need it).

Every number in the README comes from a command in the repo.  These tests re-run the commands
whose output the README shows (`python -m layernorm`, the scripts, the quickstart session), so
that a change to the package that moves one of those numbers makes the README wrong loudly; the
timings come from the benchmark commands, which no test re-runs.  Numbers are compared to
10% (they are printed with 2 to 5 digits), differences from torch to a factor of 2 (torch's
rounding depends on the CPU); all other text must match exactly, up to white space.
"""

import contextlib
import doctest
import importlib.util
import io
import os
import re
import subprocess
import sys

import numpy as np

from helpers import demo_output, requires_torch

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def read_readme():
    with open(README, encoding="utf-8") as f:
        return f.read()


def fenced_blocks(text):
    """[(info string, body)] of the README's top-level ``` blocks, in order."""
    return [(m.group(1), m.group(2))
            for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, flags=re.S | re.M)]


def _numbers_agree(got, want, factor):
    g, w = float(got), float(want)
    if factor:
        return g == w == 0 or (g * w > 0 and 1 / factor <= g / w <= factor)
    return abs(g - w) <= 0.1 * abs(w) + 1e-12


def same_text(got, want):
    """Equal up to white space, line by line, numbers within 10% of each other -- except a
    difference from torch (a number in e-notation on a line that mentions torch): torch's
    float32 rounding depends on which of its kernels the CPU runs (AVX2 or AVX-512), so those
    agree to within a factor of 2, the same order of magnitude."""
    got_lines = [line for line in got.splitlines() if line.strip()]
    want_lines = [line for line in want.splitlines() if line.strip()]
    if len(got_lines) != len(want_lines):
        return False
    for got_line, want_line in zip(got_lines, want_lines):
        got_words, want_words = NUMBER.split(" ".join(got_line.split())), NUMBER.split(" ".join(want_line.split()))
        got_numbers, want_numbers = NUMBER.findall(got_line), NUMBER.findall(want_line)
        if got_words != want_words or len(got_numbers) != len(want_numbers):
            return False
        about_torch = "torch" in want_line
        if not all(_numbers_agree(g, w, 2.0 if about_torch and "e" in w.lower() else None)
                   for g, w in zip(got_numbers, want_numbers)):
            return False
    return True


def assert_same_text(got, want):
    assert same_text(got, want), f"README says:\n{want}\nbut the code printed:\n{got}"


@requires_torch
def test_demo_output_is_the_readmes():
    text = read_readme()
    start = text.index("<summary>What <code>python -m layernorm</code>")
    shown = next(body for _, body in fenced_blocks(text[start:]))
    # The first two lines name the versions, the SIMD level and the thread count of the machine.
    assert_same_text("\n".join(demo_output().splitlines()[2:]), "\n".join(shown.splitlines()[2:]))


def test_pitfall_numbers_in_why_come_from_the_demo():
    text = read_readme()
    why = text[text.index("## Why"):text.index("## Set-up")]
    quoted = re.findall(r"^  ```\n(.*?)\n  ```$", why, flags=re.M | re.S)
    assert len(quoted) == 2
    demo_lines = demo_output().splitlines()
    for line in quoted:
        assert any(same_text(demo_line, line.strip()) for demo_line in demo_lines), line


@requires_torch
def test_scripts_print_what_the_readme_shows(restore_runtime):
    """Each ```python block that is not a session runs, in order, in one namespace (the training
    check continues the training script); a plain ``` block right after it is its output."""
    blocks = fenced_blocks(read_readme())
    namespace = {"__name__": "__readme__"}
    checked = 0
    for index, (info, body) in enumerate(blocks):
        if info != "python" or body.lstrip().startswith(">>>"):
            continue
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            exec(compile(body, f"README block {index}", "exec"), namespace)
        following = blocks[index + 1] if index + 1 < len(blocks) else None
        if following and following[0] == "" and stdout.getvalue():
            assert_same_text(stdout.getvalue(), following[1])
            checked += 1
    assert checked >= 3  # the accuracy comparison and the two training scripts


class _TolerantChecker(doctest.OutputChecker):
    def check_output(self, want, got, optionflags):
        return super().check_output(want, got, optionflags) or same_text(got, want)


@requires_torch
def test_quickstart_session(restore_runtime):
    sessions = [body for info, body in fenced_blocks(read_readme())
                if info == "python" and body.lstrip().startswith(">>>")]
    assert sessions
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(
        checker=_TolerantChecker(), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    namespace = {"np": np}
    for number, session in enumerate(sessions):
        if "import ml_dtypes" in session and importlib.util.find_spec("ml_dtypes") is None:
            continue  # the bfloat16 session needs the optional ml_dtypes
        test = parser.get_doctest(session, namespace, f"README session {number}", README, 0)
        report = io.StringIO()
        result = runner.run(test, out=report.write, clear_globs=False)
        assert result.failed == 0, report.getvalue()
        namespace = test.globs  # the next session continues this one


def test_ci_runs_both_setup_commands_verbatim():
    # CI proves the README's two set-up commands work from a fresh clone only if it runs them
    # as written (a plain `pip install .` once passed review but failed from the clone).
    text = read_readme()
    setup = text[text.index("## Set-up"):]
    commands = [body.strip() for info, body in fenced_blocks(setup)[:2]]
    assert commands[0].startswith("python -m pip install") and "python -m layernorm" in commands[0]
    assert commands[1].endswith("python -m pytest")
    with open(os.path.join(os.path.dirname(__file__), os.pardir, ".ci", "run"), encoding="utf-8") as f:
        ci_lines = [line.strip() for line in f]
    for command in commands:
        assert any(line.startswith(command) for line in ci_lines), command


def test_demo_piped_into_a_reader_that_leaves_early_prints_no_traceback():
    # `python -m layernorm | head -2`: the demo's later prints find the pipe closed.
    proc = subprocess.Popen([sys.executable, "-m", "layernorm"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("layernorm ")
    proc.stdout.close()
    stderr = proc.stderr.read()
    proc.wait(timeout=120)
    assert "Traceback" not in stderr and proc.returncode in (0, 1)


def test_demo_with_a_torch_that_fails_to_load_says_so(tmp_path):
    # A torch install whose import raises something other than ImportError (a shared library
    # missing: OSError) leaves the demo without its comparison, not with a traceback.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text('raise OSError("libtorch_cpu.so: cannot open shared object file")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "layernorm"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "torch is installed but could not be imported (OSError: libtorch_cpu.so" in proc.stdout
