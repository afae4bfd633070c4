"""Chapter 03: algbw and busbw against message size, one line per algorithm, with a copy
of the same size on every rank (memcpy) as the reference.

Reads the CSV written by `ch03_ring_allreduce -b ... -e ... --csv-dir DIR` and saves
DIR/03_ring_allreduce_algbw.png and DIR/03_ring_allreduce_busbw.png.

    .venv/bin/python notebooks/plot_03_ring_allreduce.py results
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from plotting import save  # noqa: E402

STYLE = {
    "naive": dict(marker="v"),
    "ring": dict(marker="o"),
    "pipelined": dict(marker="s"),
    "recursive_doubling": dict(marker="^"),
    "native": dict(marker="D", linewidth=2.5),
    "memcpy": dict(color="black", linestyle="--", linewidth=1.5),
}


def plot(csv_dir) -> list:
    csv_dir = Path(csv_dir)
    df = pd.read_csv(csv_dir / "03_ring_allreduce.csv")
    ranks, backend = int(df["ranks"].iloc[0]), df["backend"].iloc[0]
    machine, timing = df["machine"].iloc[0], df["rounds_x_iterations"].iloc[0]
    written = []
    for column, label in [("algbw_GBps", "algbw = S / t"), ("busbw_GBps", "busbw = algbw x 2(N-1)/N")]:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, rows in df.groupby("algorithm", sort=False):
            line = name if name != "memcpy" else "memcpy (each rank copies S bytes)"
            ax.plot(rows["bytes"], rows[column], label=line, **STYLE.get(name, {}))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(f"{label} (GB/s)")
        ax.set_title(f"allreduce, {ranks} ranks, {backend} backend\n{machine}; best of {timing} "
                     "iterations", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        written.append(save(fig, csv_dir / f"03_ring_allreduce_{column.split('_')[0]}.png"))
    return written


if __name__ == "__main__":
    for path in plot(sys.argv[1] if len(sys.argv) > 1 else "results"):
        print(path)
