"""The PNG bar chart of ours/torch time ratios, one panel per thread count.

matplotlib is optional (python -m pip install ".[bench]"); nothing else in the package needs it.
"""

from __future__ import annotations

import sys

import layernorm

from . import peers
from .report import MISSING, SMALL_CASES, SMALL_TORCH_LIMIT, TORCH_LIMIT, cpu_model_name, results_of, torch_limit, turns_text
from .timing import QUICK_SETTINGS, threads_text


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


def plot_title(options):
    run = "quick run, " if options.settings is QUICK_SETTINGS else ""
    arrays = "fresh arrays, " if options.fresh else ""
    return (f"layernorm time / torch time per call ({run}{arrays}best of {turns_text(options.settings)})\n"
            f"{cpu_model_name()}, simd {layernorm.simd_level()}, torch {peers.torch_version()}")


def draw_panel(axes, labels, ratios, limits, x_limit):
    """Horizontal bars of ratios (label -> ratio) in the order of labels, green where the ratio
    meets its limit (label -> limit), red where not; n/a where a label has no ratio."""
    positions = range(len(labels))
    values = [ratios.get(label, 0.0) for label in labels]
    colors = ["tab:green" if ratios.get(label, 0.0) <= limits[label] else "tab:red" for label in labels]
    axes.barh(positions, values, color=colors, zorder=2)
    for position, label in zip(positions, labels):
        text = f" {ratios[label]:.2f}" if label in ratios else f" {MISSING}"
        axes.text(ratios.get(label, 0.0), position, text, va="center", fontsize=8, zorder=4,
                  bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 0.5})
    axes.axvline(1.0, color="black", linewidth=1, zorder=3, label="1.0: as fast as torch")
    axes.axvline(TORCH_LIMIT, color="tab:blue", linestyle="--", linewidth=1.5, zorder=3,
                 label=f"{TORCH_LIMIT} target (every other case)")
    axes.axvline(SMALL_TORCH_LIMIT, color="tab:purple", linestyle="--", linewidth=1.5, zorder=3,
                 label=f"{SMALL_TORCH_LIMIT} target (fwd {', '.join(case.label for case in SMALL_CASES)})")
    axes.set_xlim(0, x_limit)


def write_plot(path, results, options):
    """One panel of ours/torch per case for each thread count, forward cases above backward ones."""
    plt = import_pyplot()
    # (the out= case is left out: ours without an allocation against torch with one)
    plotted = [r for r in results_of(results, "forward") + results_of(results, "backward")
               if r.ratio("ours", "torch") is not None and not r.case.use_out]
    if not plotted:
        print("no ours/torch ratio was measured: no plot written", file=sys.stderr)
        return
    labels = list(dict.fromkeys(r.label for r in plotted))
    limits = {r.label: torch_limit(r) for r in plotted}
    thread_counts = [threads for threads in options.thread_counts if any(r.threads == threads for r in plotted)]
    x_limit = max([r.ratio("ours", "torch") for r in plotted] + [1.0]) * 1.12

    figure, panels = plt.subplots(1, len(thread_counts), sharey=True, squeeze=False, layout="constrained",
                                  figsize=(2.5 + 5 * len(thread_counts), 1.6 + 0.32 * len(labels)))
    for axes, threads in zip(panels[0], thread_counts):
        ratios = {r.label: r.ratio("ours", "torch") for r in plotted if r.threads == threads}
        draw_panel(axes, labels, ratios, limits, x_limit)
        axes.set_title(threads_text(threads), fontsize=9)
        axes.set_xlabel("ours time / torch time (lower is better)")
    forward_count = len({r.label for r in plotted if r.section == "forward"})
    first = panels[0][0]
    first.set_yticks(range(len(labels)), labels)
    first.invert_yaxis()
    for axes in panels[0]:
        if 0 < forward_count < len(labels):
            axes.axhline(forward_count - 0.5, color="grey", linewidth=0.8)
    figure.suptitle(plot_title(options) + "\ngreen: target met, red: not met", fontsize=9)
    panels[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    print(f"plot written to {path}", file=sys.stderr)
