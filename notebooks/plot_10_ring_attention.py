"""Chapter 10: the causal work of each rank of the ring, zigzag against the plain split,
and the forward and backward time of rings of 1, 2, 4, ... ranks.

Reads the CSV written by `ch10_ring_attention --benchmark --csv-dir DIR` (10_ring_attention.csv:
split, cp, rank, scores, seconds) and saves DIR/10_ring_attention_work.png and
DIR/10_ring_attention_time.png.

    .venv/bin/python notebooks/plot_10_ring_attention.py results
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from plotting import save  # noqa: E402

COLOURS = {"zigzag": "tab:blue", "plain": "tab:orange"}


def plot(csv_dir) -> list:
    csv_dir = Path(csv_dir)
    df = pd.read_csv(csv_dir / "10_ring_attention.csv")
    cp = int(df["cp"].max())
    ring = df[df["cp"] == cp]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.4
    for i, (split, rows) in enumerate(ring.groupby("split", sort=False)):
        ax.bar(rows["rank"] + (i - 0.5) * width, rows["scores"], width, label=split,
               color=COLOURS.get(split))
    ax.set_xlabel("rank of the ring")
    ax.set_ylabel("score entries computed (causal work)")
    ax.set_xticks(range(cp))
    ax.set_title(f"ring attention on {cp} ranks: the plain split's last rank does the most; "
                 "the zigzag's are equal", fontsize=10)
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    written = [save(fig, csv_dir / "10_ring_attention_work.png")]

    fig, ax = plt.subplots(figsize=(8, 4.5))
    slowest = df.groupby(["split", "cp"], sort=False)["seconds"].max().reset_index()
    for split, rows in slowest.groupby("split", sort=False):
        ax.plot(rows["cp"], rows["seconds"] * 1e3, marker="o", label=split,
                color=COLOURS.get(split))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cp (ranks in the ring)")
    ax.set_ylabel("forward + backward, slowest rank (ms)")
    ax.set_title("the ring runs at its slowest rank's pace (ranks as threads on this machine: "
                 "ratios within one run)", fontsize=10)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    written.append(save(fig, csv_dir / "10_ring_attention_time.png"))
    return written


if __name__ == "__main__":
    for path in plot(sys.argv[1] if len(sys.argv) > 1 else "results"):
        print(path)
