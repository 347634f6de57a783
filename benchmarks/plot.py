"""The PNG bar charts: ours/torch time ratios above, x floor (ours / a copy of the bytes) below,
one column of panels per thread count.

matplotlib is optional (python -m pip install -e ".[bench]"); nothing else in the package needs it.
"""

from __future__ import annotations

import sys

import layernorm

from . import peers
from .report import MISSING, cpu_model_name, floor_limit, results_of, torch_limit, turns_text
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
        sys.exit('--plot needs matplotlib: python -m pip install -e ".[bench]" (from the repository root)')


def plot_title(options):
    run = "quick run, " if options.settings is QUICK_SETTINGS else ""
    arrays = "fresh arrays, " if options.fresh else ""
    return (f"layernorm per call ({run}{arrays}best of {turns_text(options.settings)}): its time / torch's "
            f"and its time / the copy's\n"
            f"{cpu_model_name()}, simd {layernorm.simd_level()}, torch {peers.torch_version()}")


def draw_panel(axes, labels, ratios, limits, x_limit, one_text):
    """Horizontal bars of ratios (label -> ratio) in the order of labels, green where the ratio
    meets its case's limit (label -> limit, marked by a tick), red where not, grey where the
    case has no limit; n/a where a label has no ratio."""
    positions = range(len(labels))
    values = [ratios.get(label, 0.0) for label in labels]

    def color(label):
        if limits.get(label) is None:
            return "tab:gray"
        return "tab:green" if ratios.get(label, 0.0) <= limits[label] else "tab:red"

    axes.barh(positions, values, color=[color(label) for label in labels], zorder=2)
    tick_text = "target of the case"  # the legend's entry, on the first tick only
    for position, label in zip(positions, labels):
        text = f" {ratios[label]:.2f}" if label in ratios else f" {MISSING}"
        axes.text(ratios.get(label, 0.0), position, text, va="center", fontsize=8, zorder=4,
                  bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 0.5})
        if limits.get(label) is not None:
            axes.plot([limits[label]] * 2, [position - 0.45, position + 0.45], color="tab:blue", linewidth=2,
                      zorder=3, label=tick_text)
            tick_text = None
    axes.axvline(1.0, color="black", linewidth=1, zorder=3, label=one_text)
    axes.set_xlim(0, x_limit)


def draw_row(panels, plotted, thread_counts, quantity, peer, limit_of, one_text):
    """One row of panels, one per thread count: `quantity` (ours / peer's time) of the results
    plotted, each bar against its case's limit (limit_of)."""
    labels = list(dict.fromkeys(r.label for r in plotted))
    limits = {r.label: limit_of(r) for r in plotted}
    x_limit = max([r.ratio("ours", peer) for r in plotted] + [limit for limit in limits.values() if limit] + [1.0])
    forward_count = len({r.label for r in plotted if r.section == "forward"})
    for axes, threads in zip(panels, thread_counts):
        ratios = {r.label: r.ratio("ours", peer) for r in plotted if r.threads == threads}
        draw_panel(axes, labels, ratios, limits, x_limit * 1.15, one_text)
        axes.set_xlabel(f"{quantity} (lower is better)")
        if 0 < forward_count < len(labels):
            axes.axhline(forward_count - 0.5, color="grey", linewidth=0.8)
    panels[0].set_yticks(range(len(labels)), labels)
    panels[0].invert_yaxis()
    panels[-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)


def write_plot(path, results, options):
    """ours/torch and x floor per case for each thread count, forward cases above backward ones;
    a row only for a quantity some case has."""
    plt = import_pyplot()
    timed = results_of(results, "forward") + results_of(results, "backward")
    # (the out= case has no ours/torch: ours without an allocation against torch with one)
    rows = [row for row in (
        ([r for r in timed if r.ratio("ours", "torch") is not None and not r.case.use_out],
         "ours time / torch time", "torch", torch_limit, "1.0: as fast as torch"),
        ([r for r in timed if r.ratio("ours", "copy") is not None],
         "x floor: ours time / a copy's time", "copy", floor_limit, "1.0: the copy's time"),
    ) if row[0]]
    if not rows:
        print("no ratio was measured: no plot written", file=sys.stderr)
        return
    thread_counts = [threads for threads in options.thread_counts if any(r.threads == threads for r in timed)]
    label_counts = [len({r.label for r in row[0]}) for row in rows]
    figure, panels = plt.subplots(len(rows), len(thread_counts), sharey="row", squeeze=False, layout="constrained",
                                  figsize=(2.5 + 5 * len(thread_counts), 1.6 + 0.9 * len(rows) + 0.32 * sum(label_counts)),
                                  gridspec_kw={"height_ratios": label_counts})
    for axes, threads in zip(panels[0], thread_counts):
        axes.set_title(threads_text(threads), fontsize=9)
    for row_panels, (plotted, quantity, peer, limit_of, one_text) in zip(panels, rows):
        draw_row(row_panels, plotted, thread_counts, quantity, peer, limit_of, one_text)
    figure.suptitle(plot_title(options) + "\ngreen: target met, red: not met, grey: no target", fontsize=9)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    print(f"plot written to {path}", file=sys.stderr)
