"""Chapter 06: the gradients' magnitudes against fp16's range, the loss of fp32, fp16
without scaling and fp16 with loss scaling, and the loss scale over the steps.

Reads the CSVs written by `ch06_fp16_loss_scaling --csv --csv-dir DIR` and saves
DIR/06_fp16_loss_scaling_histogram.png, DIR/06_fp16_loss_scaling_loss.png and
DIR/06_fp16_loss_scaling_scale.png.

    .venv/bin/python notebooks/plot_06_fp16_loss_scaling.py results
"""
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from plotting import save  # noqa: E402

RUNS = {"fp32": ("fp32", "#333333"), "fp16_unscaled": ("fp16, no scaling", "#d9534f"),
        "fp16_scaled": ("fp16, loss scaling", "#4c9bd6")}


def histogram(csv_dir: Path) -> Path:
    df = pd.read_csv(csv_dir / "06_fp16_loss_scaling_histogram.csv")
    shift = math.log2(float(df["scale"].iloc[0]))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(df["log2_from"] + 0.5, df["count"], width=0.9, color="#888888", edgecolor="black", linewidth=0.4,
           label="step 1's gradients (fp32 run)")
    ax.axvspan(-62, -25, color="#d9534f", alpha=0.15, label="0 in fp16 (below 2^-25)")
    ax.axvspan(-25, -14, color="#f0ad4e", alpha=0.15, label="fp16 subnormal (2^-25 .. 2^-14)")
    ax.axvline(-25 - shift, color="#4c9bd6", linestyle="--",
               label=f"what the scale 2^{shift:.0f} lifts to 2^-25")
    ax.set_xlim(-62, 2)
    ax.set_xlabel("log2 |gradient|")
    ax.set_ylabel("values")
    ax.set_title("Gradient magnitudes against fp16's range")
    ax.legend(fontsize=8)
    return save(fig, csv_dir / "06_fp16_loss_scaling_histogram.png")


def losses(csv_dir: Path) -> Path:
    df = pd.read_csv(csv_dir / "06_fp16_loss_scaling.csv")
    fig, ax = plt.subplots(figsize=(8, 4))
    for run, (label, color) in RUNS.items():
        rows = df[df["run"] == run]
        ax.plot(rows["step"], rows["loss"], label=label, color=color)
        skipped = rows[rows["skipped"] == 1]
        if len(skipped):
            ax.scatter(skipped["step"], skipped["loss"], color=color, marker="x", zorder=3,
                       label=f"{label}: skipped steps")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("The same model trained three ways")
    ax.legend()
    return save(fig, csv_dir / "06_fp16_loss_scaling_loss.png")


def scale(csv_dir: Path) -> Path:
    df = pd.read_csv(csv_dir / "06_fp16_loss_scaling.csv")
    rows = df[df["run"] == "fp16_scaled"]
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.step(rows["step"], rows["scale"], where="post", color="#4c9bd6")
    skipped = rows[rows["skipped"] == 1]
    ax.scatter(skipped["step"], skipped["scale"], color="#d9534f", marker="x", zorder=3, label="skipped (inf/NaN)")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title("The loss scale over the steps")
    if len(skipped):
        ax.legend()
    return save(fig, csv_dir / "06_fp16_loss_scaling_scale.png")


def plot(csv_dir) -> list:
    csv_dir = Path(csv_dir)
    return [histogram(csv_dir), losses(csv_dir), scale(csv_dir)]


if __name__ == "__main__":
    for path in plot(sys.argv[1] if len(sys.argv) > 1 else "results"):
        print("wrote", path)
