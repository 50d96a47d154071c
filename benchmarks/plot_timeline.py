#!/usr/bin/env python3
"""Draws the timeline overlap_bench writes: one row per resource (backward, CPU
update, SSD read, SSD write), a bar per busy interval, time from the step's start.

    python3 benchmarks/plot_timeline.py TIMELINE.json OUT.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROWS = [("backward", "backward (GPU wait)", "tab:blue"),
        ("update", "CPU update", "tab:orange"),
        ("ssd_read", "SSD read", "tab:green"),
        ("ssd_write", "SSD write", "tab:red")]


def main(argv):
    if len(argv) != 3:
        sys.exit(__doc__)
    with open(argv[1]) as f:
        timeline = json.load(f)
    t0 = timeline["step_start_us"]
    t1 = timeline["step_end_us"]
    fig, ax = plt.subplots(figsize=(12, 3.2))
    for row, (event, label, color) in enumerate(ROWS):
        spans = [((e["start_us"] - t0) / 1e3, (e["end_us"] - e["start_us"]) / 1e3)
                 for e in timeline["events"] if e["event"] == event]
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.3)
    ax.axvline((t1 - t0) / 1e3, color="black", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(ROWS)))
    ax.set_yticklabels([label for _, label, _ in ROWS])
    ax.invert_yaxis()
    ax.set_xlim(left=min(0, min(((e["start_us"] - t0) / 1e3 for e in timeline["events"]), default=0)))
    ax.set_xlabel("ms since the step's first backward wait (dashed: EndStep returned)")
    ax.set_title("fuyou overlapped step: {} layers, {:.1f} ms backward each".format(
        timeline["layers"], timeline["layer_ms"]))
    fig.tight_layout()
    fig.savefig(argv[2], dpi=120)


if __name__ == "__main__":
    main(sys.argv)
