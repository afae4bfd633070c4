"""Chapter 08: a 3-D mesh's ranks as a grid coloured by group, one panel per axis, the nodes
outlined; and the planner's search, every (dp, tp, pp, m) as step time against memory per
GPU, with the GPU's memory drawn as a line.

Reads the CSVs written by `ch08_layout --pp P --dp D --tp T --csv --csv-dir DIR`
and `ch08_plan --search --csv --csv-dir DIR`, and saves
DIR/08_hybrid_mesh_mesh.png and DIR/08_hybrid_mesh_search.png.

    .venv/bin/python notebooks/plot_08_hybrid_mesh.py results
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.collections import LineCollection  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from plotting import save  # noqa: E402

# 20 colours, cycled: neighbouring groups never share one (a group's id is one more than its
# neighbour's along the row), and group g and g + 20 are far apart in the grid.
GROUP_COLORS = ListedColormap(plt.get_cmap("tab20").colors)
FITS = {True: "#4c9bd6", False: "#d9534f"}
MAX_STAGES_SHOWN = 8
DEFAULT_GPU_MEMORY_GB = 80.0  # the planner's default cluster, a100-80gb (ch08_plan --json)


def mesh_sizes(df):
    """pp, dp, tp: the mesh's sizes, from the coordinates the layout lists."""
    return tuple(int(df[axis].max()) + 1 for axis in ("pp", "dp", "tp"))


def mesh_grid(df):
    """The mesh as a pp x (dp * tp) grid of rows: row = pp stage, column = dp_i * tp + tp_i.

    Returns (rank, node, group) arrays of that shape; group[axis] is the id of the rank's
    group along the axis: tp groups share (pp, dp), dp groups share (pp, tp), pp groups share
    (dp, tp). Every cell is filled by exactly one rank or the layout is not a mesh."""
    pp, dp, tp = mesh_sizes(df)
    if len(df) != pp * dp * tp:
        raise ValueError(f"{len(df)} ranks in the layout, but pp x dp x tp = {pp * dp * tp}")
    row = df["pp"].to_numpy()
    col = df["dp"].to_numpy() * tp + df["tp"].to_numpy()
    rank = np.full((pp, dp * tp), -1)
    node = np.full((pp, dp * tp), -1)
    rank[row, col] = df["rank"].to_numpy()
    node[row, col] = df["node"].to_numpy()
    if (rank < 0).any():
        raise ValueError("the layout leaves a (pp, dp, tp) coordinate without a rank")
    stage = np.arange(pp)[:, None]
    dp_i, tp_i = np.divmod(np.arange(dp * tp)[None, :], tp)
    group = {"tp": np.broadcast_to(stage * dp + dp_i, rank.shape),
             "dp": np.broadcast_to(stage * tp + tp_i, rank.shape),
             "pp": np.broadcast_to(dp_i * tp + tp_i, rank.shape)}
    return rank, node, group


def node_edges(node):
    """Segments between neighbouring cells on different nodes, and around the grid."""
    rows, cols = node.shape
    segments = []
    for r, c in zip(*np.nonzero(node[:, 1:] != node[:, :-1])):
        segments.append([(c + 0.5, r - 0.5), (c + 0.5, r + 0.5)])
    for r, c in zip(*np.nonzero(node[1:, :] != node[:-1, :])):
        segments.append([(c - 0.5, r + 0.5), (c + 0.5, r + 0.5)])
    left, right, top, bottom = -0.5, cols - 0.5, -0.5, rows - 0.5
    segments += [[(left, top), (right, top)], [(right, top), (right, bottom)],
                 [(right, bottom), (left, bottom)], [(left, bottom), (left, top)]]
    return segments


def mesh(csv_dir: Path) -> Path:
    df = pd.read_csv(csv_dir / "08_hybrid_mesh_layout.csv")
    pp, dp, tp = mesh_sizes(df)
    rank, node, group = mesh_grid(df)
    per_node = int(df.groupby("node").size().max())
    # A big mesh (GPT-3's 64 stages) repeats its first stages' pattern: those are drawn.
    shown = min(pp, MAX_STAGES_SHOWN)
    rank, node = rank[:shown], node[:shown]
    group = {axis: ids[:shown] for axis, ids in group.items()}
    rows, cols = rank.shape
    # Cells square, the grid about 4.5 inches on its longer side (at most 14 wide); a grid
    # much wider than tall stacks its three panels instead of setting them side by side.
    stacked = cols > 2 * rows
    cell = min(0.6, 11.0 / cols) if stacked else min(4.5 / max(rows, cols), 14.0 / cols)
    width, height = max(2.5, cols * cell), max(0.8, rows * cell)
    if stacked:
        fig, axes = plt.subplots(3, 1, figsize=(max(9.0, width + 1.2), 3 * (height + 0.9) + 1.0))
    else:
        fig, axes = plt.subplots(1, 3, figsize=(3 * width + 1.2, height + 1.6))
    digits = len(str(int(rank.max())))
    fontsize = min(8.0, cell * 72 / (0.7 * digits + 0.6))
    for ax, axis in zip(axes, ("tp", "dp", "pp")):
        ids = group[axis]
        ax.imshow(ids % GROUP_COLORS.N, cmap=GROUP_COLORS, vmin=0, vmax=GROUP_COLORS.N - 1,
                  interpolation="nearest", aspect="equal")
        if fontsize >= 4:
            for (r, c), value in np.ndenumerate(rank):
                ax.text(c, r, str(value), ha="center", va="center", fontsize=fontsize)
            # Thin white lines between cells, so the ranks read one by one.
            ax.set_xticks(np.arange(cols + 1) - 0.5, minor=True)
            ax.set_yticks(np.arange(rows + 1) - 0.5, minor=True)
            ax.grid(which="minor", color="white", linewidth=0.6)
            ax.tick_params(which="minor", length=0)
        ax.add_collection(LineCollection(node_edges(node), colors="black",
                                         linewidths=min(2.0, cell * 72 / 8)))
        size = {"tp": tp, "dp": dp, "pp": pp}[axis]
        count = {"tp": pp * dp, "dp": pp * tp, "pp": dp * tp}[axis]
        ax.set_title(f"{axis} groups: {count} of {size} rank{'s' if size > 1 else ''}", fontsize=9)
        ax.set_xlabel(f"dp replica x tp rank (column = dp_i x {tp} + tp_i)", fontsize=8)
        ax.set_ylabel("pipeline stage (pp)", fontsize=8)
        ax.set_yticks(range(0, rows, max(1, rows // 8)))
        every = max(1, dp // 12)
        ax.set_xticks([d * tp for d in range(0, dp, every)])
        ax.set_xticklabels([f"dp {d}" for d in range(0, dp, every)], fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    part = "" if shown == pp else f"\nstages 0-{shown - 1} of {pp} shown: the others repeat them"
    fig.suptitle(f"The mesh pp x dp x tp = {pp} x {dp} x {tp}: {pp * dp * tp} ranks, {per_node} "
                 f"a node (black lines: node boundaries){part}\ncolour = the rank's group "
                 "along each axis; the numbers are the ranks", fontsize=10)
    return save(fig, csv_dir / "08_hybrid_mesh_mesh.png")


def gpu_memory_gb(df) -> float:
    """The GPU's memory in GB (1e9 bytes): from the CSV where it says, else the default's."""
    for column, unit in (("gpu_memory_gb", 1.0), ("gpu_memory_bytes", 1e9)):
        if column in df.columns and df[column].notna().any():
            return float(df[column].dropna().iloc[0]) / unit
    return DEFAULT_GPU_MEMORY_GB


def _as_bool(column):
    return column.astype(str).str.lower().isin(["true", "1"])


def _name(row) -> str:
    return (f"dp {int(row['dp'])} x tp {int(row['tp'])} x pp {int(row['pp'])}, "
            f"m = {int(row['microbatches'])}")


def search(csv_dir: Path) -> Path:
    df = pd.read_csv(csv_dir / "08_hybrid_mesh_search.csv")
    df["fits"] = _as_bool(df["fits"])
    df["tp_crosses_nodes"] = _as_bool(df["tp_crosses_nodes"])
    limit = gpu_memory_gb(df)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for fits in (True, False):
        for crosses, marker in ((False, "o"), (True, "^")):
            rows = df[(df["fits"] == fits) & (df["tp_crosses_nodes"] == crosses)]
            if rows.empty:
                continue
            label = ("fits" if fits else "does not fit") + (", tp across nodes" if crosses else "")
            ax.scatter(rows["memory_gb"], rows["step_time_s"], marker=marker, s=36,
                       facecolor=FITS[fits] if fits else "none", edgecolor=FITS[fits],
                       linewidth=1.2, label=label, zorder=3)
    ax.axvline(limit, color="black", linestyle="--", linewidth=1.2,
               label=f"GPU memory, {limit:g} GB")
    ax.axvspan(limit, max(limit, df["memory_gb"].max()) * 1.5, color="#d9534f", alpha=0.07)
    ax.set_xscale("log")
    fitting = df[df["fits"]]
    if not fitting.empty:
        best = fitting.loc[fitting["step_time_s"].idxmin()]
        ax.scatter([best["memory_gb"]], [best["step_time_s"]], marker="*", s=260,
                   color="#f0ad4e", edgecolor="black", zorder=4, label="fastest that fits")
        ax.annotate(f"{_name(best)}\n{best['step_time_s']:.1f} s a step, "
                    f"{best['memory_gb']:.1f} GB a GPU",
                    (best["memory_gb"], best["step_time_s"]), xytext=(0.03, 0.6),
                    textcoords="axes fraction", fontsize=8,
                    arrowprops={"arrowstyle": "->", "linewidth": 0.8})
    fastest = df.loc[df["step_time_s"].idxmin()]
    if not fastest["fits"]:
        ax.annotate(f"fastest of all: {_name(fastest)}\n"
                    f"needs {fastest['memory_gb']:.1f} GB",
                    (fastest["memory_gb"], fastest["step_time_s"]), xytext=(0.58, 0.6),
                    textcoords="axes fraction", fontsize=8,
                    arrowprops={"arrowstyle": "->", "linewidth": 0.8})
    gpus = int((df["dp"] * df["tp"] * df["pp"]).iloc[0])
    ax.set_xlabel("memory per GPU (GB, log scale)")
    ax.set_ylabel("step time (s)")
    ax.set_title(f"Every (dp, tp, pp, m) of {gpus} GPUs: {int(df['fits'].sum())} of {len(df)} fit",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    return save(fig, csv_dir / "08_hybrid_mesh_search.png")


def plot(csv_dir) -> list:
    csv_dir = Path(csv_dir)
    return [mesh(csv_dir), search(csv_dir)]


if __name__ == "__main__":
    for path in plot(sys.argv[1] if len(sys.argv) > 1 else "results"):
        print("wrote", path)
