"""Chapter 02: step time split into making the batch, compute and communication wait.

Reads the CSV written by `ch02_gradient_allreduce --benchmark --csv-dir DIR` and saves
DIR/02_gradient_allreduce.png.

    .venv/bin/python notebooks/plot_02_gradient_allreduce.py results
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from plotting import save  # noqa: E402


def plot(csv_dir) -> Path:
    csv_dir = Path(csv_dir)
    df = pd.read_csv(csv_dir / "02_gradient_allreduce.csv")
    # A bucket plan ("[b2 W2] [b1] [W1]") one bucket per line, so that the labels fit.
    labels = [s if pd.isna(plan) else s + "\n" + plan.replace("] [", "]\n[")
              for s, plan in zip(df["sync"], df["plan"])]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    ax.bar(labels, df["batch_ms"], label="making the batch")
    ax.bar(labels, df["compute_ms"], bottom=df["batch_ms"], label="compute")
    ax.bar(labels, df["comm_wait_ms"], bottom=df["batch_ms"] + df["compute_ms"],
           label="waiting on communication")
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel("ms per step (slowest rank)")
    ranks, backend = int(df["ranks"].iloc[0]), df["backend"].iloc[0]
    grad_mib = df["grad_bytes"].iloc[0] / 2**20
    ax.set_title(f"Data-parallel step, {ranks} ranks ({backend}), {grad_mib:.2f} MiB of gradients, "
                 f"mean of {int(df['steps'].iloc[0])} steps\n{df['machine'].iloc[0]}", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, frameon=False)
    return save(fig, csv_dir / "02_gradient_allreduce.png")


if __name__ == "__main__":
    print(plot(Path(sys.argv[1] if len(sys.argv) > 1 else "results")))
