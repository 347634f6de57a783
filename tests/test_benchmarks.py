"""The benchmarks' machinery: placed arrays land at the page offsets asked for, and quick runs
report their tables and targets (the placement sweep without torch too: torch is then left out)."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from helpers import ml_dtypes

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not (REPOSITORY / "benchmarks" / "placement.py").exists(),
                                reason="benchmarks/ is not part of this copy of the tests")


@pytest.fixture
def placement(monkeypatch):
    monkeypatch.syspath_prepend(str(REPOSITORY))
    from benchmarks import placement
    return placement


@pytest.mark.parametrize("offset", [0, 16, 240, 2048, 4080])
def test_placed_copy_starts_at_the_page_offset_asked(placement, offset):
    values = np.arange(24, dtype=np.float32).reshape(4, 6)
    placed = placement.placed_copy(values, offset)
    assert placed.ctypes.data % placement.PAGE == offset
    np.testing.assert_array_equal(placed, values)
    assert placed.dtype == values.dtype and placed.shape == values.shape


def test_full_sweep_covers_the_first_256_bytes_and_the_rest_of_the_page(placement):
    pairs = placement.placements(quick=False)
    assert len(set(pairs)) == len(pairs) == 16 * 16 + 15
    assert {x for x, _ in pairs} == set(range(0, 256, 16)) | set(range(256, 4096, 256))
    assert {dy for _, dy in pairs} == set(range(0, 256, 16))


class _VirtualTime:
    """Stands in for the time module: perf_counter reads a clock that only the fake calls advance."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        pass


def test_checked_ratio_keeps_a_slow_placement_and_drops_a_slowed_moment(placement, monkeypatch):
    clock = _VirtualTime()
    monkeypatch.setattr(placement, "time", clock)
    cost = {(0, 0): 1.0, (16, 0): 1.5, (32, 0): 1.0, (48, 0): 1.0}  # seconds a call, of the placement itself
    timed = []

    def make_call(x, dy):
        def call():
            timed.append((x, dy))
            moment = 3.0 if len(timed) <= 8 and (x, dy) == (32, 0) else 1.0  # its sweep rounds slowed
            stretch = 2.0 if len(timed) > 8 else 1.0  # the machine slower during the check
            clock.now += cost[x, dy] * moment * stretch
            return 0
        return call

    pairs = list(cost)
    sweep = placement.Sweep("fake", make_call, pairs, {pair: pair for pair in pairs})
    for _ in range(2):
        sweep.time_round()
    assert sweep.slowest(1) == [(32, 0)] and sweep.best[32, 0] == 3.0
    sweep.check_slowest(count=3, pairs=4)
    assert sweep.fastest() not in sweep.checked
    assert sweep.checked == {(32, 0): 1.0, (16, 0): 1.5}
    row, ratio = placement.sweep_row(sweep)
    assert ratio == 1.5 and row[4] == "3.00" and row[5] == "1.50"


def test_quick_run_reports_each_thread_count_and_the_target():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.placement", "--quick", "--threads", "1"],
                          cwd=REPOSITORY, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "## 1 thread" in proc.stdout
    assert "| layernorm |" in proc.stdout
    assert "slowest / fastest" in proc.stdout.split("## Target")[1]


def test_fused_add_quick_run_reports_both_libraries_without_a_target():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.placement", "--quick", "--threads", "1", "--fused-add"],
                          cwd=REPOSITORY, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "# add_layer_norm against the placement of its results" in proc.stdout
    assert "| layernorm |" in proc.stdout and "| unfused |" in proc.stdout
    assert "## Target" not in proc.stdout


@pytest.mark.parametrize("offsets", [(0, 16), (240, 2048, 4080)])
def test_placed_views_start_at_the_page_offsets_asked(placement, offsets):
    views = placement.placed_views((3, 5), np.float32, offsets)
    assert {offset: view.ctypes.data % placement.PAGE for offset, view in views.items()} == {o: o for o in offsets}
    assert all(view.shape == (3, 5) and view.dtype == np.float32 for view in views.values())


def test_pool_wake_quick_run_reports_both_columns():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.pool_wake", "--quick", "--threads", "2"],
                          cwd=REPOSITORY, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "## 2 threads" in proc.stdout
    assert "| 128x768 float32 |" in proc.stdout and "after idle / back to back" in proc.stdout


def test_row_lengths_quick_run_reports_each_row_length(monkeypatch):
    monkeypatch.syspath_prepend(str(REPOSITORY))
    from benchmarks import row_lengths

    proc = subprocess.run([sys.executable, "-m", "benchmarks.row_lengths", "--quick", "--threads", "1"],
                          cwd=REPOSITORY, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.split("## 1 thread")[1]
    for n in row_lengths.QUICK_ROW_LENGTHS:
        assert f"\n| {n} | " in table


def test_param_dtypes_quick_run_reports_each_dtype():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.param_dtypes", "--quick", "--threads", "1"],
                          cwd=REPOSITORY, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.split("## 1 thread")[1]
    assert "\n| 16x768 float16 | " in table
    assert ("\n| 16x768 bfloat16 | " in table) == (ml_dtypes is not None)


@pytest.mark.parametrize("peer_name, module", [("ort_forward", "onnxruntime"), ("jax_forward", "jax")])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_optional_peers_compute_layer_norm(monkeypatch, peer_name, module, dtype):
    pytest.importorskip(module)
    if module == "onnxruntime":
        pytest.importorskip("onnx")
    monkeypatch.syspath_prepend(str(REPOSITORY))
    from benchmarks import cases, peers
    from layernorm import _reference

    case = cases.Case(8, 64, dtype)
    data = cases.make_case_data(case, np.random.default_rng(0))
    timed = getattr(peers, peer_name)(case, data)
    timed.use_threads()
    expected = _reference.layer_norm(data.x, (64,), data.weight.astype(dtype), data.bias.astype(dtype), cases.EPS)[0]
    np.testing.assert_allclose(timed.run(), expected, rtol=0, atol=1e-4 if dtype == "float32" else 1e-10)


def test_ort_rms_normalization_computes_rms_norm(monkeypatch):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    monkeypatch.syspath_prepend(str(REPOSITORY))
    from benchmarks import cases, peers
    from layernorm import _reference

    rng = np.random.default_rng(1)
    x, weight = rng.standard_normal((8, 64), dtype=np.float32), rng.standard_normal(64).astype(np.float32)
    timed = peers.ort_timed("RMSNormalization", "8x64", x, weight)
    timed.use_threads()
    expected = _reference.rms_norm(x, 64, weight, cases.EPS)[0]
    np.testing.assert_allclose(timed.run(), expected, rtol=0, atol=1e-5)


def test_module_section_reports_training_mode_against_eval_mode():
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--threads", "1", "--cases", "module 512x768"],
                          cwd=REPOSITORY, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "## Module, 1 thread: LayerNorm(768)(x)" in proc.stdout
    assert "| copy of x (the fastest of at most this many threads) |" in proc.stdout
    assert "module 512x768 float32 (1 thread) module train / module eval ≤ 1.15" in proc.stdout.split("## Targets")[1]


# Every case's bounds, as the targets state them: (ours/torch, x floor), None where there is none.
# ours/torch: 0.33 on the small inputs both ways, 0.5 on 4x20 forward and every bfloat16 case,
# 0.9 on other forwards, 0.6 on other backwards; x floor: large float32 1.1 forward and 1.3
# backward, large float16/bfloat16 1.3.  The out= case has no ours/torch check.
TARGETS = {
    "4x20 float32": {"fwd": (0.5, None), "bwd": (0.6, None)},
    "16x768 float32": {"fwd": (0.33, None), "bwd": (0.33, None)},
    "1x4096 float32": {"fwd": (0.33, None), "bwd": (0.33, None)},
    "512x768 float32": {"fwd": (0.9, None), "bwd": (0.6, None)},
    "6304x768 float32": {"fwd": (0.9, 1.1), "bwd": (0.6, 1.3)},
    "2048x4096 float32": {"fwd": (0.9, 1.1), "bwd": (0.6, 1.3)},
    "1000000x8 float32": {"fwd": (0.9, 1.1), "bwd": (0.6, 1.3)},
    "8x1000000 float32": {"fwd": (0.9, 1.1), "bwd": (0.6, 1.3)},
    "1024x1024 float64": {"fwd": (0.9, None), "bwd": (0.6, None)},
    "2048x1024 float16": {"fwd": (0.9, None), "bwd": (0.6, None)},
    "2048x4096 float16": {"fwd": (0.9, 1.3), "bwd": (0.6, 1.3)},
    "2048x4096 float32 out=": {"fwd": (None, 1.1)},
    "512x768 bfloat16": {"fwd": (0.5, None), "bwd": (0.5, None)},
    "2048x1024 bfloat16": {"fwd": (0.5, None), "bwd": (0.5, None)},
    "2048x4096 bfloat16": {"fwd": (0.5, 1.3), "bwd": (0.5, 1.3)},
}


def test_each_case_has_its_targets(monkeypatch):
    monkeypatch.syspath_prepend(str(REPOSITORY))
    from types import SimpleNamespace

    from benchmarks import cases, report
    found = {}
    for case in cases.CASES:
        for section in ("forward", "backward") if case.has_backward else ("forward",):
            result = SimpleNamespace(section=section, case=case, label=case.label, threads=1,
                                     ratio=lambda ours, peer: 1.0)
            checks = {check.target.split(")")[1].split("≤")[0].strip(): float(check.target.split("≤")[1])
                      for check in report.result_checks(result)}
            found.setdefault(case.label, {})[cases.SECTION_PREFIXES[section]] = (
                checks.get("ours/torch"), checks.get("x floor"))
    assert found == TARGETS


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_copy_in_parts_copies_every_element(threads):
    from benchmarks import peers

    source = np.arange(1001, dtype=np.float32).reshape(7, 143)
    destination = np.zeros_like(source)
    peers.set_copy_threads(threads)
    try:
        peers.copyto_in_parts(destination, source)
    finally:
        peers.set_copy_threads(1)
    np.testing.assert_array_equal(destination, source)


def test_a_tables_floor_is_the_fastest_copy_of_at_most_its_threads():
    from benchmarks import peers

    times = {("ours", 1): 5.0, ("ours", 2): 3.0, ("copy", 1): 2.0, ("copy", 2): 2.5, ("copy", 4): 1.0}
    floors = peers.floor_times(times)
    assert floors == {("ours", 1): 5.0, ("ours", 2): 3.0, ("copy", 1): 2.0, ("copy", 2): 2.0, ("copy", 4): 1.0}
    # the copy is timed at 1 thread too, whatever counts the run asks for
    assert peers.floor_thread_counts("copy", [2]) == [1, 2] and peers.floor_thread_counts("ours", [2]) == [2]


def test_two_runs_counts_a_target_met_only_when_both_runs_meet_it(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(REPOSITORY))
    from benchmarks import report, two_runs
    runs = {"first": [("a", "0.4", True), ("b", "1.2", False), ("c", "0.9", True), ("d", "n/a", None)],
            "second": [("a", "0.5", True), ("b", "1.0", True), ("c", "1.1", False), ("d", "0.3", True)]}
    paths = []
    for name, checks in runs.items():
        path = tmp_path / f"{name}.md"
        lines = [report.checklist_line(report.Check(target, value, met, "torch not installed"))
                 for target, value, met in checks]
        path.write_text("# a report\n\n" + "\n".join(lines) + "\n", encoding="utf-8")
        paths.append(str(path))
    first, second = (two_runs.read_checks(path) for path in paths)
    assert first == {"a": ("0.4", True), "b": ("1.2", False), "c": ("0.9", True), "d": ("n/a", None)}
    lines = two_runs.two_runs_lines(first, second)
    assert lines[0] == ("Targets of two runs: met 1 in both, 2 in one, 0 in neither, 1 not measured in one run or"
                        " both (of 4).")
    assert lines[4:] == ["| a | 0.4 | 0.5 | both |", "| b | 1.2 | 1.0 | one |", "| c | 0.9 | 1.1 | one |",
                         "| d | n/a | 0.3 | not measured |"]


def test_two_runs_reads_the_norm_familys_checklist(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(REPOSITORY))
    from benchmarks import two_runs
    path = tmp_path / "family.md"
    path.write_text("## Targets\n\n- [met] rms fwd 4x20 float32, 1 thread: ours / torch = 0.07 (target <= 0.5)\n"
                    "- [NOT met] add_rms_norm 2048x4096 float32 out=, 2 threads: ours / copy = 2.50 (target <= 2.2)\n"
                    "- [n/a] rms fwd 4x20 float32, 1 thread: ours / ort = n/a (target <= 0.8)\n", encoding="utf-8")
    assert two_runs.read_checks(str(path)) == {
        "rms fwd 4x20 float32, 1 thread: ours / torch (target <= 0.5)": ("0.07", True),
        "add_rms_norm 2048x4096 float32 out=, 2 threads: ours / copy (target <= 2.2)": ("2.50", False),
        "rms fwd 4x20 float32, 1 thread: ours / ort (target <= 0.8)": ("n/a", None)}


@pytest.fixture
def small_family(monkeypatch, restore_runtime):
    """benchmarks.family with small shapes; the thread counts its quick run sets put back after."""
    monkeypatch.syspath_prepend(str(REPOSITORY))
    from benchmarks import family, peers
    monkeypatch.setattr(family, "STANDARD_SHAPES", [(4, 20)])
    monkeypatch.setattr(family, "CHANNELS_FIRST_SHAPE", (2, 8, 4, 4))
    monkeypatch.setattr(family, "IN_PLACE_SHAPE", (2, 8, 4, 4))
    monkeypatch.setattr(family, "ADD_SHAPE", (8, 64))
    monkeypatch.setattr(family, "BLOCK_SIZE", {"d_model": 32, "n_heads": 2, "n_layers": 2, "batch": 1, "seq": 8})
    monkeypatch.setattr(family, "CONVNEXT_SHAPE", (1, 16, 4, 4))
    torch_threads = peers.torch.get_num_threads() if peers.torch else None
    yield family
    peers.set_copy_threads(1)
    if torch_threads:
        peers.torch.set_num_threads(torch_threads)


def family_rows(text):
    """The case cells and the rest of the rows of the norm family's first table."""
    table = text.split("## 1 thread")[1].split("## Targets")[0]
    rows = [line.strip("| ").split(" | ") for line in table.splitlines() if line.startswith("| ")]
    return {cells[0]: cells[1:] for cells in rows if cells[0] != "case"}


def test_family_times_the_examples_against_torch(small_family, capsys):
    if not small_family.torch:
        pytest.skip("torch is not installed: the block rows compare with it")
    small_family.main(["--quick", "--threads", "1", "--cases", "block"])
    out = capsys.readouterr().out
    rows = family_rows(out)
    assert set(rows) == {"block GPT-2 2 layers 1x8x32 float32", "block Llama 2 layers 1x8x32 float32",
                         "block ConvNeXt norm 1x16x4x4 axis=1"}
    for label, cells in rows.items():
        assert float(cells[0]) > 0 and float(cells[1]) > 0, label  # ours µs, ours / torch
        assert cells[2] == cells[4] == "n/a"  # ort, unfused
        assert (cells[3] != "n/a") == ("ConvNeXt" in label)  # copy: the ConvNeXt norm's floor only
    assert out.split("## Targets")[1].strip() == ""


def test_family_without_torch_leaves_the_block_rows_out(small_family, monkeypatch):
    monkeypatch.setattr(small_family, "torch", None)
    assert small_family.block_comparisons(np.random.default_rng(0)) == []


def test_family_cases_keeps_the_labels_that_contain_it(small_family, capsys):
    small_family.main(["--quick", "--threads", "1", "--cases", "channels-first"])
    out = capsys.readouterr().out
    assert set(family_rows(out)) == {"channels-first fwd 2x8x4x4 axis=1", "channels-first bwd 2x8x4x4 axis=1",
                                     "channels-first fwd 2x8x4x4 axis=1 in place"}
    assert all(line.startswith("- [") and " channels-first " in line
               for line in out.split("## Targets")[1].strip().splitlines())
    with pytest.raises(SystemExit) as raised:
        small_family.main(["--quick", "--threads", "1", "--cases", "no such case"])
    assert raised.value.code == 2
