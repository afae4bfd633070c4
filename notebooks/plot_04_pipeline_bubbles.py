"""Chapter 04: pipeline timelines as Gantt charts, the bubble against the number of
microbatches, and the microbatches each stage holds.

Reads the CSVs written by `ch04_pipeline_bubbles --benchmark --csv-dir DIR` and saves
DIR/04_pipeline_bubbles_gantt.png, DIR/04_pipeline_bubbles_bubble.png and
DIR/04_pipeline_bubbles_memory.png.

    .venv/bin/python notebooks/plot_04_pipeline_bubbles.py results
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from plotting import save  # noqa: E402

COLORS = {"F": "#4c9bd6", "B": "#5cb85c", "W": "#f0ad4e"}


def in_order(names) -> list:
    """The schedules of a column, in the order the program wrote them (its registry's)."""
    return list(dict.fromkeys(names))


def _title(df) -> str:
    row = df.iloc[0]
    return f"{row['backend']} backend, {row['machine']}"


def gantt(csv_dir: Path) -> Path:
    ev = pd.read_csv(csv_dir / "04_pipeline_bubbles_events.csv")
    ev = ev[ev["source"] == "measured"]
    names = in_order(ev["schedule"])
    p = int(ev["stages"].iloc[0])
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 1.0 + (0.6 + 0.3 * p) * len(names)),
                             squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        rows = ev[ev["schedule"] == name]
        for _, e in rows.iterrows():
            # Odd chunks lighter, as in the Megatron-LM paper's interleaved figure.
            alpha = 1.0 if int(e["chunk"]) % 2 == 0 else 0.55
            ax.barh(int(e["stage"]), e["end_ms"] - e["start_ms"], left=e["start_ms"],
                    color=COLORS[e["kind"]], alpha=alpha, edgecolor="black", linewidth=0.3)
            if e["end_ms"] - e["start_ms"] > rows["end_ms"].max() / 40:
                ax.text((e["start_ms"] + e["end_ms"]) / 2, int(e["stage"]), str(int(e["microbatch"])),
                        ha="center", va="center", fontsize=7)
        m = int(rows["microbatches"].iloc[0])
        ax.set_title(f"{name} (m = {m})", fontsize=9, loc="left")
        ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
        ax.invert_yaxis()
        ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.suptitle(f"measured pipeline timelines, {p} stages; {_title(ev)}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97 - 0.2 / len(names)))
    fig.legend(handles, ["forward", "backward (B)", "weight gradient (W)"], fontsize=8,
               loc="upper center", ncol=3, frameon=False,
               bbox_to_anchor=(0.5, 0.985 - 0.12 / len(names)))
    return save(fig, csv_dir / "04_pipeline_bubbles_gantt.png", layout=False)


def bubble(csv_dir: Path) -> Path:
    df = pd.read_csv(csv_dir / "04_pipeline_bubbles.csv")
    p = int(df["stages"].iloc[0])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in in_order(df["schedule"]):
        rows = df[df["schedule"] == name]
        line, = ax.plot(rows["microbatches"], rows["measured_bubble"], marker="o", label=f"{name} measured")
        ax.plot(rows["microbatches"], rows["simulated_bubble"], linestyle=":", color=line.get_color(),
                label=f"{name} simulated (measured op costs)")
    m = sorted(df["microbatches"].unique())
    ax.plot(m, [(p - 1) / (x + p - 1) for x in m], color="black", linestyle="--",
            label="(p-1)/(m+p-1): GPipe, 1F1B")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("microbatches m")
    ax.set_ylabel("bubble: idle / total time")
    ax.set_title(f"the bubble shrinks with microbatches, {p} stages\n{_title(df)}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return save(fig, csv_dir / "04_pipeline_bubbles_bubble.png")


def memory(csv_dir: Path) -> Path:
    df = pd.read_csv(csv_dir / "04_pipeline_bubbles.csv")
    # The m of the timelines (the run's --microbatches).
    m = int(pd.read_csv(csv_dir / "04_pipeline_bubbles_events.csv")["microbatches"].max())
    rows = df[df["microbatches"] == m]
    if rows.empty:
        m = int(df["microbatches"].max())
        rows = df[df["microbatches"] == m]
    names = in_order(rows["schedule"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        peaks = [float(x) for x in rows[rows["schedule"] == name]["peak_in_flight"].iloc[0].split()]
        ax.bar([s + i * width for s in range(len(peaks))], peaks, width, label=name)
    p = int(rows["stages"].iloc[0])
    ax.set_xticks([s + 0.4 - width / 2 for s in range(p)], [f"stage {s}" for s in range(p)])
    ax.set_ylabel("microbatches held at once")
    ax.set_title(f"activation memory: microbatches in flight per stage, m = {m}\n{_title(df)}",
                 fontsize=10)
    ax.legend(fontsize=8)
    return save(fig, csv_dir / "04_pipeline_bubbles_memory.png")


def plot(csv_dir) -> list:
    csv_dir = Path(csv_dir)
    return [gantt(csv_dir), bubble(csv_dir), memory(csv_dir)]


if __name__ == "__main__":
    for path in plot(sys.argv[1] if len(sys.argv) > 1 else "results"):
        print(path)
