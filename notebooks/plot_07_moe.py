"""Chapter 07: tokens per expert with and without the load-balancing loss, the dropped
choices against the capacity factor, and the all-to-all's bus bandwidth.

Reads the CSVs written by `ch07_moe --train STEPS --csv --csv-dir DIR` and
`ch07_moe --benchmark --csv-dir DIR`, and saves DIR/07_moe_tokens.png,
DIR/07_moe_capacity.png and DIR/07_moe_alltoall.png.

    .venv/bin/python notebooks/plot_07_moe.py results
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from plotting import save  # noqa: E402

COLORS = {"without": "#d9534f", "with": "#4c9bd6"}


def tokens(csv_dir: Path) -> Path:
    df = pd.read_csv(csv_dir / "07_moe_training.csv")
    last = int(df["step"].max())
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, aux in zip(axes, ["without", "with"]):
        for step, alpha, label in [(1, 0.35, "step 1"), (last, 1.0, f"step {last}")]:
            rows = df[(df["aux"] == aux) & (df["step"] == step)]
            ax.bar(rows["expert"] + (0.2 if step == last else -0.2), rows["tokens"], width=0.4,
                   color=COLORS[aux], alpha=alpha, edgecolor="black", linewidth=0.4, label=label)
        ax.set_title(f"{aux} the aux loss")
        ax.set_xlabel("expert")
        ax.legend()
    axes[0].set_ylabel("tokens kept (choices)")
    fig.suptitle("Tokens per expert, from a router that starts out preferring expert 0")
    return save(fig, csv_dir / "07_moe_tokens.png")


def capacity(csv_dir: Path) -> Path:
    df = pd.read_csv(csv_dir / "07_moe_capacity.csv")
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for aux, rows in df.groupby("aux"):
        ax.plot(rows["capacity_factor"], 100 * rows["dropped_fraction"], marker="o", color=COLORS[aux],
                label=f"router trained {aux} the aux loss")
    ax.set_xlabel("capacity factor")
    ax.set_ylabel("choices dropped (%)")
    ax.set_title("Dropped tokens against capacity")
    ax.legend()
    return save(fig, csv_dir / "07_moe_capacity.png")


def alltoall(csv_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    # One CSV per backend (threads, mpi, nccl): their runs side by side.
    for path in sorted(csv_dir.glob("07_moe_alltoall_*.csv")):
        df = pd.read_csv(path)
        for (case, ranks), rows in df.groupby(["algorithm", "ranks"]):
            ax.plot(rows["bytes"] / 2**20, rows["busbw_GBps"], marker="o", label=f"{case}, {ranks} ranks")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("MiB per rank")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("All-to-all, busbw = algbw x (N-1)/N")
    ax.legend(fontsize=8)
    return save(fig, csv_dir / "07_moe_alltoall.png")


def plot(csv_dir) -> list:
    csv_dir = Path(csv_dir)
    return [tokens(csv_dir), capacity(csv_dir), alltoall(csv_dir)]


if __name__ == "__main__":
    for path in plot(sys.argv[1] if len(sys.argv) > 1 else "results"):
        print("wrote", path)
