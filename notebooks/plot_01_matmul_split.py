"""Chapter 01: one device's GEMM throughput against n, next to the device's peak.

Reads the CSV written by `ch01_matmul_split --benchmark --csv-dir DIR` (case, size, tflops,
peak_tflops, ...: on the host the reference loop and the blocked kernel, on a GPU cuBLAS)
and saves DIR/01_matmul_split.png.

    .venv/bin/python notebooks/plot_01_matmul_split.py results
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from plotting import save  # noqa: E402

NAMES = {"cpu_reference": "reference loop (the textbook i-k-j order)",
         "cpu_blocked": "blocked kernel (the same bits, cache-sized tiles)",
         "cublas_sgemm": "cuBLAS SGEMM"}


def plot(csv_dir) -> Path:
    csv_dir = Path(csv_dir)
    df = pd.read_csv(csv_dir / "01_matmul_split.csv")
    fig, ax = plt.subplots(figsize=(7, 4))
    for case, rows in df.groupby("case", sort=False):
        ax.plot(rows["size"], rows["tflops"] * 1e3, marker="o", label=NAMES.get(case, case))
    peak = float(df["peak_tflops"].iloc[0])
    if peak > 0:
        ax.axhline(peak * 1e3, color="grey", linestyle="--", label=f"peak {peak:g} TFLOP/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(df["size"].unique(), [str(n) for n in df["size"].unique()])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("n (an n x n by n x n product, FP32)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"One device's matmul, {df['backend'].iloc[0]}\n{df['machine'].iloc[0]}",
                 fontsize=10)
    ax.legend(fontsize=8)
    return save(fig, csv_dir / "01_matmul_split.png")


if __name__ == "__main__":
    print(plot(Path(sys.argv[1] if len(sys.argv) > 1 else "results")))
