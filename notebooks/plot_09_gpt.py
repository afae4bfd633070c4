"""Chapter 09: the GPT's loss curve on every mesh shape of the ranks, and the tokens per
second each shape trains at (CS336's "compare the strategies' throughput").

Reads the CSVs written by `ch09_gpt --benchmark --csv-dir DIR` (09_gpt_loss.csv: mesh,
step, loss; 09_gpt_throughput.csv: mesh, pp, dp, ep, cp, tp, tokens_per_second, ...) and saves
DIR/09_gpt_loss.png and DIR/09_gpt_throughput.png (and DIR/09_gpt_predicted.png, with
--predict's columns); and, where `scripts/cluster.sh --csv-dir DIR overlap` wrote
09_gpt_overlap.csv, DIR/09_gpt_overlap.png.

    .venv/bin/python notebooks/plot_09_gpt.py results
    .venv/bin/python notebooks/plot_09_gpt.py --predicted OUT.png "LABEL=DIR" ...
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


def plot_overlap(sweep, csv_dir):
    """scripts/cluster.sh overlap's sweep against a rank's tokens: left, the step with and
    without overlap beside compute, communication and their max; right, the communication
    left exposed with overlap beside what the overlap condition predicts (max(0, comm -
    backward); under ZeRO-1 the reduce-scatter's half against the backward and the
    all-gather's against the forward), whose knee is where a rank's backward lasts as long
    as the allreduce."""
    zero = "zero" in sweep and bool(sweep["zero"].iloc[0])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    x = sweep["tokens_per_rank"]
    knee = sweep["knee_tokens"].iloc[0]
    left.plot(x, sweep["step_none_ms"], marker="o", label="step, --overlap none")
    left.plot(x, sweep["step_all_ms"], marker="o", label="step, --overlap all")
    left.plot(x, sweep["max_ms"], linestyle="--", color="grey", label="max(compute, comm)")
    left.plot(x, sweep["compute_ms"], linestyle=":", label="compute")
    alone = "reduce-scatter and all-gather" if zero else "the allreduce"
    left.plot(x, sweep["comm_ms"], linestyle=":", label=f"comm ({alone} alone)")
    left.set_ylabel("ms a step")
    left.set_title("the step")
    if "predicted_exposed_ms" in sweep:
        predicted = sweep["predicted_exposed_ms"]
    else:  # a table from before the column
        predicted = (sweep["comm_ms"] - sweep["backward_ms"]).clip(lower=0)
    formula = ("max(0, comm/2 - backward) + max(0, comm/2 - forward)" if zero
               else "max(0, comm - backward)")
    right.plot(x, sweep["exposed_all_ms"], marker="o", label="exposed, measured (--overlap all)")
    right.plot(x, predicted, marker="s", linestyle="--", label=formula)
    right.set_ylabel("ms of communication the rank waited for")
    right.set_title("what overlap cannot hide")
    for ax in (left, right):
        ax.axvline(knee, color="black", linewidth=0.8)
        ax.text(knee, ax.get_ylim()[1] * 0.97, f" knee {knee:.0f}", fontsize=8, va="top")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank and step")
    left.legend(fontsize=8, loc="upper left")
    right.legend(fontsize=8, loc="center right")
    fig.suptitle(f"dp 2{' with ZeRO-1' if zero else ''} across a "
                 f"{sweep['link_gbit'].iloc[0]:g} Gbit/s link (knee: a rank's "
                 "tokens T = 2(d-1)/d C/busbw)")
    return save(fig, Path(csv_dir) / "09_gpt_overlap.png")


def plot_predicted(frames: dict, path):
    """Each mesh's measured step against the one `--predict` put beside it, one marker per
    set of runs (a dict label -> the throughput CSV's rows), on the diagonal where they
    agree, with the band of 15 % either side."""
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    top = 0.0
    for label, rate in frames.items():
        ax.scatter(rate["step_ms"], rate["predicted_ms"], label=label, zorder=3)
        for _, row in rate.iterrows():
            short = "x".join(str(row[a]) for a in ("pp", "dp", "ep", "cp", "tp"))
            ax.annotate(short, (row["step_ms"], row["predicted_ms"]), fontsize=6,
                        xytext=(3, -8), textcoords="offset points")
        top = max(top, rate["step_ms"].max(), rate["predicted_ms"].max())
    line = [0, top * 1.1]
    ax.plot(line, line, color="black", linewidth=1, label="predicted = measured")
    ax.fill_between(line, [0.85 * x for x in line], [1.15 * x for x in line], color="grey",
                    alpha=0.2, label="within 15 %")
    ax.set_xlim(0, top * 1.1)
    ax.set_ylim(0, top * 1.1)
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms), from the machine's profile")
    ax.set_title("every mesh (pp x dp x ep x cp x tp), measured and predicted")
    ax.legend(fontsize=8)
    return save(fig, Path(path))


def plot(csv_dir) -> list:
    csv_dir = Path(csv_dir)
    loss = pd.read_csv(csv_dir / "09_gpt_loss.csv")
    rate = pd.read_csv(csv_dir / "09_gpt_throughput.csv")
    if loss.empty or rate.empty:
        raise ValueError(f"{csv_dir}: the benchmark's CSVs hold no rows")
    out = [plot_loss(loss, csv_dir), plot_throughput(rate, csv_dir)]
    if "predicted_ms" in rate:  # ch09_gpt --benchmark --predict FILE
        out.append(plot_predicted({"measured, --predict": rate}, csv_dir / "09_gpt_predicted.png"))
    if (csv_dir / "09_gpt_overlap.csv").exists():  # scripts/cluster.sh --csv-dir DIR overlap
        out.append(plot_overlap(pd.read_csv(csv_dir / "09_gpt_overlap.csv"), csv_dir))
    return out


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--predicted":  # OUT.png LABEL=DIR ...
        sets = dict(arg.split("=", 1) for arg in sys.argv[3:])
        print("wrote", plot_predicted(
            {label: pd.read_csv(Path(d) / "09_gpt_throughput.csv") for label, d in sets.items()},
            sys.argv[2]))
    else:
        for path in plot(sys.argv[1] if len(sys.argv) > 1 else "results"):
            print("wrote", path)
