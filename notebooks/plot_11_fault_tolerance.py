"""Chapter 11: the waste of a run with failures against its checkpoint interval, measured,
beside Young's first-order formula (the overhead x = delta/T + (T/2 + R)/M per second of
work, x/(1+x) of the wall time) and its minimum sqrt(2 delta M).

Reads the CSV written by `ch11_fault_tolerance --sweep --csv-dir DIR` (11_fault_tolerance.csv:
interval_steps, rounds, waste, waste_min, waste_max, formula, step_s, checkpoint_s,
restart_s, mtbf_steps) and saves DIR/11_fault_tolerance_waste.png.

    .venv/bin/python notebooks/plot_11_fault_tolerance.py results
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from plotting import save  # noqa: E402


def plot(csv_dir) -> list:
    csv_dir = Path(csv_dir)
    df = pd.read_csv(csv_dir / "11_fault_tolerance.csv").sort_values("interval_steps")
    step, delta = df["step_s"].iloc[0], df["checkpoint_s"].iloc[0]
    restart, mtbf_steps = df["restart_s"].iloc[0], df["mtbf_steps"].iloc[0]
    mtbf = mtbf_steps * step
    k = np.linspace(0.5, max(df["interval_steps"].max(), 2) * 1.1, 200)
    t = k * step
    overhead = delta / t + (t / 2 + restart) / mtbf  # per second of useful work
    formula = overhead / (1 + overhead)               # its share of the wall time
    young = np.sqrt(2 * delta * mtbf) / step

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(k, formula, color="tab:orange",
            label="formula: x/(1+x), x = delta/T + (T/2 + R)/M (measured delta, R, step)")
    ax.errorbar(df["interval_steps"], df["waste"],
                yerr=[df["waste"] - df["waste_min"], df["waste_max"] - df["waste"]],
                fmt="o", color="tab:blue", capsize=3,
                label=f"measured: mean of {int(df['rounds'].iloc[0])} runs (bars: least, most)")
    ax.axvline(young, color="tab:gray", linestyle="--",
               label=f"Young's interval sqrt(2 delta M) = {young:.2g} steps")
    ax.set_xlabel("checkpoint interval (steps)")
    ax.set_ylabel("waste (one less the goodput)")
    ax.set_ylim(0, min(1, max(df["waste_max"].max(), formula.min() * 2) * 1.15))
    ax.set_title(f"failures every {mtbf_steps:g} steps on average: too many checkpoints cost "
                 "time, too few lose work", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    return [save(fig, csv_dir / "11_fault_tolerance_waste.png")]


if __name__ == "__main__":
    for path in plot(sys.argv[1] if len(sys.argv) > 1 else "results"):
        print(path)
