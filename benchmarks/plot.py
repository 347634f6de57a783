"""The PNG bar chart of ours/torch time ratios.

matplotlib is optional (python -m pip install ".[bench]"); nothing else in the package needs it.
"""

from __future__ import annotations

import sys

import layernorm

from . import peers
from .report import SMALL_CASES, SMALL_TORCH_LIMIT, TORCH_LIMIT, cpu_model_name, results_of, torch_limit, turns_text
from .timing import QUICK_SETTINGS


def import_pyplot():
    """matplotlib.pyplot with the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def check_plot_prerequisites():
    """Exit before any timing if --plot cannot be honoured."""
    if not peers.torch_version():
        sys.exit("--plot draws ours/torch ratios, and torch is not installed")
    if import_pyplot() is None:
        sys.exit('--plot needs matplotlib: python -m pip install ".[bench]" (from the repository root)')


def plot_title(settings):
    run = "quick run, " if settings is QUICK_SETTINGS else ""
    return (f"layernorm time / torch time per call ({run}best of {turns_text(settings)})\n"
            f"{cpu_model_name()}, {layernorm.get_num_threads()} threads, simd {layernorm.simd_level()},"
            f" torch {peers.torch_version()}")


def write_plot(path, results, title):
    """Horizontal bars of ours/torch per case, green where the case meets its target, red where not."""
    plt = import_pyplot()
    # (the out= case is left out: ours without an allocation against torch with one)
    plotted = [r for r in results if r.ratio("ours", "torch") is not None and not r.case.use_out]
    if not plotted:
        print("no ours/torch ratio was measured: no plot written", file=sys.stderr)
        return
    labels = [r.label for r in plotted]
    ratios = [r.ratio("ours", "torch") for r in plotted]
    colors = ["tab:green" if ratio <= torch_limit(r) else "tab:red" for r, ratio in zip(plotted, ratios)]

    figure, axes = plt.subplots(figsize=(8, 1.6 + 0.32 * len(plotted)))
    positions = range(len(plotted))
    axes.barh(positions, ratios, color=colors, zorder=2)
    axes.set_yticks(list(positions), labels)
    axes.invert_yaxis()
    forward_count = len(results_of(plotted, "forward"))
    if 0 < forward_count < len(plotted):
        axes.axhline(forward_count - 0.5, color="grey", linewidth=0.8)
    for position, ratio in zip(positions, ratios):
        axes.text(ratio, position, f" {ratio:.2f}", va="center", fontsize=8, zorder=4,
                  bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 0.5})
    axes.axvline(1.0, color="black", linewidth=1, zorder=3, label="1.0: as fast as torch")
    axes.axvline(TORCH_LIMIT, color="tab:blue", linestyle="--", linewidth=1.5, zorder=3,
                 label=f"{TORCH_LIMIT} target (every other case)")
    axes.axvline(SMALL_TORCH_LIMIT, color="tab:purple", linestyle="--", linewidth=1.5, zorder=3,
                 label=f"{SMALL_TORCH_LIMIT} target (fwd {', '.join(case.label for case in SMALL_CASES)})")
    axes.set_xlim(0, max(ratios + [1.0]) * 1.12)
    axes.set_xlabel("ours time / torch time (lower is better; green: target met, red: not met)")
    axes.set_title(title, fontsize=9)
    axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    print(f"plot written to {path}", file=sys.stderr)
