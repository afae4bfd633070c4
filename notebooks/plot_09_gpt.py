"""Chapter 09: the GPT's loss curve on every mesh shape of the ranks, and the tokens per
second each shape trains at (CS336's "compare the strategies' throughput").

Reads the CSVs written by `ch09_gpt --benchmark --csv-dir DIR` (09_gpt_loss.csv: mesh,
step, loss; 09_gpt_throughput.csv: mesh, pp, dp, ep, cp, tp, tokens_per_second, ...) and saves
DIR/09_gpt_loss.png and DIR/09_gpt_throughput.png.

    .venv/bin/python notebooks/plot_09_gpt.py results
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from plotting import save  # noqa: E402


def plot_loss(loss, csv_dir):
    """One line per mesh shape: every shape trains the same model on the same batches, so
    the lines lie on top of each other (they part only in the last bits)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for mesh, rows in loss.groupby("mesh", sort=False):
        ax.plot(rows["step"], rows["loss"], marker="o", markersize=3, label=mesh)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title("the same model on every mesh shape")
    ax.legend(fontsize=8)
    return save(fig, Path(csv_dir) / "09_gpt_loss.png")


def plot_throughput(rate, csv_dir):
    """Tokens per second per mesh shape, fastest first."""
    rate = rate.sort_values("tokens_per_second", ascending=False)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.barh(rate["mesh"], rate["tokens_per_second"], color="#4c9bd6")
    ax.invert_yaxis()
    ax.set_xlabel("tokens per second")
    ax.set_ylabel("mesh")
    ax.set_title("throughput of each way to cut the model")
    return save(fig, Path(csv_dir) / "09_gpt_throughput.png")


def plot(csv_dir) -> list:
    csv_dir = Path(csv_dir)
    loss = pd.read_csv(csv_dir / "09_gpt_loss.csv")
    rate = pd.read_csv(csv_dir / "09_gpt_throughput.csv")
    if loss.empty or rate.empty:
        raise ValueError(f"{csv_dir}: the benchmark's CSVs hold no rows")
    return [plot_loss(loss, csv_dir), plot_throughput(rate, csv_dir)]


if __name__ == "__main__":
    for path in plot(sys.argv[1] if len(sys.argv) > 1 else "results"):
        print("wrote", path)
