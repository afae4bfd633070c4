"""Chapter 05: where each byte of the model states goes, by ZeRO stage and data-parallel
degree — measured by the memory ledger next to the paper's formula — the paper's 7.5B
example (ZeRO Table 1) as bars, and the step time of each stage against plain data
parallelism, with and without stage 3's prefetch.

Reads the CSVs written by `ch05_adam_memory --train --benchmark --csv-dir DIR` and saves
DIR/05_adam_memory_bytes.png, DIR/05_adam_memory_paper.png and DIR/05_adam_memory_time.png.

    .venv/bin/python notebooks/plot_05_adam_memory.py results
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from plotting import save  # noqa: E402

CATEGORIES = ["params", "grads", "master", "optimizer"]
COLORS = {"params": "#4c9bd6", "grads": "#5cb85c", "master": "#f0ad4e", "optimizer": "#d9534f"}
STAGES = ["0: plain DP", "1: +opt", "2: +grads", "3: +params"]


def _stacked(ax, x, frame, width, hatch=None, label=True, categories=CATEGORIES):
    bottom = [0.0] * len(x)
    for cat in categories:
        values = list(frame[cat])
        ax.bar(x, values, width, bottom=bottom, color=COLORS[cat], hatch=hatch, edgecolor="black",
               linewidth=0.4, label=cat if label else None)
        bottom = [b + v for b, v in zip(bottom, values)]


def bytes_by_stage(csv_dir: Path) -> Path:
    df = pd.read_csv(csv_dir / "05_adam_memory.csv")
    wide = df.pivot_table(index=["source", "dp", "stage"], columns="category", values="bytes").reset_index()
    dps = sorted(wide["dp"].unique())
    fig, axes = plt.subplots(1, len(dps), figsize=(4.2 * len(dps), 4), sharey=True, squeeze=False)
    for ax, dp in zip(axes[0], dps):
        for i, source in enumerate(["measured", "formula"]):
            rows = wide[(wide["dp"] == dp) & (wide["source"] == source)].sort_values("stage")
            x = [s + (i - 0.5) * 0.38 for s in rows["stage"]]
            _stacked(ax, x, rows, 0.36, hatch=None if source == "measured" else "//",
                     label=(dp == dps[0] and i == 0))
        ax.set_xticks(range(4), STAGES, rotation=20)
        ax.set_title(f"Nd = {dp} ranks (left: measured, right: formula)")
        ax.set_ylabel("bytes per rank")
    axes[0][0].legend()
    p = int(df["params"].iloc[0])
    fig.suptitle(f"Model states per rank, {df['precision'].iloc[0]} precision, Psi = {p:,} parameters")
    return save(fig, csv_dir / "05_adam_memory_bytes.png")


def paper(csv_dir: Path) -> Path:
    df = pd.read_csv(csv_dir / "05_adam_memory_paper.csv")
    dps = sorted(df["dp"].unique())
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.2
    for s in range(4):
        rows = df[df["stage"] == s].sort_values("dp")
        frame = pd.DataFrame({"params": rows["params_bytes"] / 1e9, "grads": rows["grads_bytes"] / 1e9,
                              "optimizer": rows["optimizer_bytes"] / 1e9})
        x = [i + (s - 1.5) * width for i in range(len(dps))]
        _stacked(ax, x, frame, width * 0.95, label=(s == 0), categories=["params", "grads", "optimizer"])
        for xi, total in zip(x, rows["total_bytes"] / 1e9):
            # Rounded half up, as the paper's table: 41.25 -> 41.3.
            ax.text(xi, total, f"{total * (1 + 1e-12):.3g}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(dps)), [f"Nd = {int(d)}\n(stages 0 1 2 3)" for d in dps])
    ax.set_ylabel("GB per device (1e9 bytes)")
    ax.set_title("ZeRO Table 1: the 7.5B model, mixed precision (optimizer = fp32 master + m + v, K = 12)")
    ax.legend()
    return save(fig, csv_dir / "05_adam_memory_paper.png")


def step_time(csv_dir: Path) -> Path:
    df = pd.read_csv(csv_dir / "05_adam_memory_time.csv")
    fig, ax = plt.subplots(figsize=(7, 4))
    for (stage, prefetch), rows in df.groupby(["stage", "prefetch"]):
        label = f"stage {stage}" + (" without prefetch" if stage == 3 and not prefetch else "")
        ax.plot(rows["dp"], rows["vs_plain_dp"], marker="o", linestyle="--" if not prefetch else "-",
                label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("data-parallel ranks Nd")
    ax.set_ylabel("step time / plain data parallel")
    row = df.iloc[0]
    ax.set_title(f"Step time per ZeRO stage ({row['backend']} backend, {row['machine']})", fontsize=9)
    ax.legend()
    return save(fig, csv_dir / "05_adam_memory_time.png")


def plot(csv_dir) -> list:
    csv_dir = Path(csv_dir)
    return [bytes_by_stage(csv_dir), paper(csv_dir), step_time(csv_dir)]


if __name__ == "__main__":
    for path in plot(sys.argv[1] if len(sys.argv) > 1 else "results"):
        print("wrote", path)
