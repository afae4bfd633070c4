"""Every chapter's figures in one folder, with a page that shows them all (`make plots`).

Runs each chapter's benchmark or series at a small size, draws its figures with the
chapter's plot script (plot_NN_*.py, the same code the notebooks call), checks that each
is a real picture, and writes OUT/index.html: every figure with a one-line caption saying
what to look at. It also writes OUT/figures.md, the same figures for the documentation
site's gallery page (docs/gallery.md: `make docs` after `make plots` shows them there).

    .venv/bin/python notebooks/gallery.py --bin build/default/bin --out build/default/plots
    .venv/bin/python notebooks/gallery.py --from results --out results   # CSVs you made

With --from DIR nothing is run: the CSVs already in DIR are plotted (a chapter whose CSVs
are missing is skipped and listed), so figures of a larger run of your own get the same
page; several --from folders are searched in turn (the test suite's: each chapter's
benchmark test writes its own), and --require-all makes a missing chapter an error. --readme-figures DIR also writes small copies of the README's figures into DIR.
"""
import argparse
import html
import importlib
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from plotting import check_png, shrink_png

HERE = Path(__file__).resolve().parent


@dataclass
class Figure:
    png: str
    caption: str  # one line: what to look at


@dataclass
class Chapter:
    number: str
    slug: str
    title: str
    runs: list  # argument lists, "{out}" replaced by the output folder
    csvs: list  # what the runs write, which the plot script reads
    figures: list = field(default_factory=list)


# Each chapter's benchmark at a size that runs in seconds on two cores. The notebooks name
# the larger runs the chapters' READMEs discuss.
CHAPTERS = [
    Chapter("01", "01_matmul_split", "one matmul, split three ways",
            [["ch01_matmul_split", "--benchmark", "--csv-dir", "{out}"]],
            ["01_matmul_split.csv"],
            [Figure("01_matmul_split.png",
                    "The matmul every split ends in, on one core: the blocked kernel gives "
                    "the reference loop's bits several times faster (GFLOP/s against n).")]),
    Chapter("02", "02_gradient_allreduce", "gradient AllReduce",
            [["ch02_gradient_allreduce", "--benchmark", "--ranks", "2", "--in", "1024",
              "--hidden", "4096", "--batch", "4", "--steps", "10", "--csv-dir", "{out}"]],
            ["02_gradient_allreduce.csv"],
            [Figure("02_gradient_allreduce.png",
                    "A data-parallel step of each sync mode, split into making the batch, "
                    "compute and waiting on communication: every mode sends the same bytes; "
                    "the green part is what it leaves in the way.")]),
    Chapter("03", "03_ring_allreduce", "ring-AllReduce",
            [["ch03_ring_allreduce", "--ranks", "4", "-b", "1K", "-e", "16M", "-f", "4", "-n",
              "5", "-w", "1", "--csv-dir", "{out}"]],
            ["03_ring_allreduce.csv"],
            [Figure("03_ring_allreduce_algbw.png",
                    "Algorithm bandwidth against message size: small messages pay every "
                    "step's latency, so the bandwidth climbs with the size."),
             Figure("03_ring_allreduce_busbw.png",
                    "Bus bandwidth, algbw × 2(N−1)/N, comparable across rank counts, next to "
                    "each rank copying the same bytes (dashed): the ceiling of one machine.")]),
    Chapter("04", "04_pipeline_bubbles", "pipeline bubbles",
            [["ch04_pipeline_bubbles", "--ranks", "2", "--benchmark", "--width", "256",
              "--batch", "256", "--microbatches", "8", "--csv-dir", "{out}"]],
            ["04_pipeline_bubbles.csv", "04_pipeline_bubbles_events.csv"],
            [Figure("04_pipeline_bubbles_gantt.png",
                    "Every schedule's measured timeline, one row per stage, each op with its "
                    "microbatch: the white gaps are the bubble."),
             Figure("04_pipeline_bubbles_bubble.png",
                    "The bubble against the number of microbatches m: measured (solid) and "
                    "simulated (dotted) next to (p−1)/(m+p−1) (dashed)."),
             Figure("04_pipeline_bubbles_memory.png",
                    "Microbatches whose activations each stage holds at once: GPipe all m, "
                    "1F1B p − s, whatever m is.")]),
    Chapter("05", "05_adam_memory", "Adam's memory and ZeRO",
            [["ch05_adam_memory", "--train", "--ranks", "4", "--benchmark", "--csv-dir",
              "{out}"]],
            ["05_adam_memory.csv", "05_adam_memory_paper.csv", "05_adam_memory_time.csv"],
            [Figure("05_adam_memory_bytes.png",
                    "Model states per rank for each ZeRO stage and data-parallel degree: the "
                    "ledger's bytes (plain) equal the paper's formula (hatched)."),
             Figure("05_adam_memory_paper.png",
                    "ZeRO's Table 1 from its formula: the 7.5B model's 120 GB per device "
                    "against Nd, stage by stage (1.88 GB at stage 3 on 64)."),
             Figure("05_adam_memory_time.png",
                    "Each stage's step time over plain data parallelism's, in one run: ranks "
                    "as threads on a tiny model, so mostly noise here (the README says why).")]),
    Chapter("06", "06_fp16_loss_scaling", "fp16 and loss scaling",
            [["ch06_fp16_loss_scaling", "--csv", "--csv-dir", "{out}", "--inject-overflow",
              "100,101,102", "--growth-interval", "50"]],
            ["06_fp16_loss_scaling.csv", "06_fp16_loss_scaling_histogram.csv"],
            [Figure("06_fp16_loss_scaling_histogram.png",
                    "Step 1's gradients against fp16's range: most lie below 2^−25 and "
                    "become zero in fp16; the scale 2^16 lifts the dashed line to 2^−25."),
             Figure("06_fp16_loss_scaling_loss.png",
                    "The loss in fp32, in fp16 unscaled and in fp16 with the dynamic scale: "
                    "the scaled run lies on fp32's, the unscaled one stops improving."),
             Figure("06_fp16_loss_scaling_scale.png",
                    "The dynamic loss scale: halved at each overflow (three injected at "
                    "step 100, those steps skipped), doubled after 50 good steps in a row.")]),
    Chapter("07", "07_moe", "Mixture-of-Experts",
            [["ch07_moe", "--ranks", "4", "--train", "300", "--csv", "--csv-dir", "{out}"],
             ["ch07_moe", "--ranks", "4", "--benchmark", "--max-mib", "16", "--csv-dir",
              "{out}"]],
            ["07_moe_training.csv", "07_moe_capacity.csv", "07_moe_alltoall_threads.csv"],
            [Figure("07_moe_tokens.png",
                    "Tokens each expert keeps, from a router that starts out preferring "
                    "expert 0: without the aux loss only two experts get any (up to their "
                    "capacity; the rest are dropped); with it every expert gets a share."),
             Figure("07_moe_capacity.png",
                    "Choices dropped against the capacity factor, on a batch neither router "
                    "saw: the one trained with the aux loss drops far fewer at every factor."),
             Figure("07_moe_alltoall.png",
                    "The all-to-all's bus bandwidth, algbw × (N−1)/N, against the size per "
                    "rank: the backend's against the pairwise exchange built on send and "
                    "receive.")]),
    Chapter("08", "08_hybrid_mesh", "the hybrid mesh",
            [["ch08_layout", "--pp", "4", "--dp", "2", "--tp", "2",
              "--gpus-per-node", "8", "--csv", "--csv-dir", "{out}"],
             ["ch08_plan", "--search", "--csv", "--csv-dir", "{out}"]],
            ["08_hybrid_mesh_layout.csv", "08_hybrid_mesh_search.csv"],
            [Figure("08_hybrid_mesh_mesh.png",
                    "pp × dp × tp = 4 × 2 × 2 on nodes of 8, one panel per axis, a group per "
                    "colour: tp and dp groups are close ranks inside a node, pp groups cross "
                    "the node boundary."),
             Figure("08_hybrid_mesh_search.png",
                    "Every (dp, tp, pp, m) of GPT-3 on 1024 GPUs, step time against memory "
                    "per GPU: the fastest that fits (star) is not the fastest of all, and tp "
                    "across nodes (triangles) costs twice the time or more.")]),
    Chapter("09", "09_gpt", "a GPT trained with everything",
            [["ch09_gpt", "--benchmark", "--ranks", "4", "--steps", "6", "--csv-dir", "{out}"]],
            ["09_gpt_loss.csv", "09_gpt_throughput.csv"],
            [Figure("09_gpt_loss.png",
                    "The same GPT on every mesh of 4 ranks over the five axes, from the same "
                    "weights on the same batches: the loss curves lie on top of each other."),
             Figure("09_gpt_throughput.png",
                    "Tokens per second of each mesh shape, ranks as threads on this "
                    "machine: ratios within one run, not a forecast for GPUs.")]),
    Chapter("10", "10_ring_attention", "ring attention",
            [["ch10_ring_attention", "--ranks", "4", "--seq", "512", "--benchmark",
              "--csv-dir", "{out}"]],
            ["10_ring_attention.csv"],
            [Figure("10_ring_attention_work.png",
                    "The score entries each rank of a ring of 4 computes: the plain split's "
                    "last rank about seven times its first's, the zigzag's all equal."),
             Figure("10_ring_attention_time.png",
                    "Forward and backward of the slowest rank against the ring's size: the "
                    "ring runs at that rank's pace (threads on this machine).")]),
    Chapter("11", "11_fault_tolerance", "training through failures",
            [["ch11_fault_tolerance", "--sweep", "--steps", "12", "--rounds", "1",
              "--intervals", "1,4", "--csv-dir", "{out}"]],
            ["11_fault_tolerance.csv"],
            [Figure("11_fault_tolerance_waste.png",
                    "The waste of a run with failures against its checkpoint interval: "
                    "measured, and Young's formula with its minimum.")]),
]

# The README's figures (small copies, committed as docs/images/readme_NAME: the site
# finds images by their file name, and the gallery's copies have the plain one).
README_FIGURES = ["04_pipeline_bubbles_gantt.png", "06_fp16_loss_scaling_loss.png",
                  "09_gpt_loss.png"]

FONTS = ('"Noto Sans", "Noto Sans CJK SC", "Source Han Sans SC", "PingFang SC", '
         '"Microsoft YaHei", "WenQuanYi Micro Hei", sans-serif')


def run_chapter(chapter, bin_dir, out):
    """Runs the chapter's benchmark commands; returns the seconds they took."""
    start = time.monotonic()
    for args in chapter.runs:
        program = Path(bin_dir) / args[0]
        if not program.exists():
            raise SystemExit(f"gallery: {program} not found: build first (make)")
        cmd = [str(program)] + [a.replace("{out}", str(out)) for a in args[1:]]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise SystemExit(f"gallery: chapter {chapter.number}: '{' '.join(cmd)}' failed "
                             f"({done.returncode})\n{tail}")
    return time.monotonic() - start


def draw_chapter(chapter, out):
    """Draws the chapter's figures with its plot script and checks each (a bad one ends the
    run)."""
    module = importlib.import_module(f"plot_{chapter.slug}")
    written = module.plot(out)
    written = {Path(p).name for p in (written if isinstance(written, list) else [written])}
    for figure in chapter.figures:
        if figure.png not in written:
            raise SystemExit(f"gallery: plot_{chapter.slug}.py did not write {figure.png}")
        check_png(out / figure.png)


def index_html(drawn, skipped):
    """The standalone page: every figure, its chapter and its caption."""
    parts = ['<!DOCTYPE html>', '<html lang="en">', '<head>', '<meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             '<title>ShardLab — every figure</title>',
             '<style>',
             f'body {{ font-family: {FONTS}; max-width: 72rem; margin: 2rem auto; '
             'padding: 0 1rem; color: #222; line-height: 1.5; }',
             'figure { margin: 0 0 2.5rem 0; }',
             'img { max-width: 100%; border: 1px solid #ddd; }',
             'figcaption { margin-top: .4rem; }',
             'h2 { border-bottom: 1px solid #ddd; padding-bottom: .2rem; margin-top: 2.5rem; }',
             '</style>', '</head>', '<body>',
             '<h1>ShardLab — every figure</h1>',
             "<p>Each chapter's benchmark or series at a small size on this machine "
             "(<code>make plots</code>). Under each figure: what to look at. The chapter "
             "READMEs explain them; the notebooks in <code>notebooks/</code> draw them from "
             "larger runs.</p>"]
    for chapter in drawn:
        parts.append(f'<h2 id="ch{chapter.number}">Chapter {chapter.number} — '
                     f'{html.escape(chapter.title)}</h2>')
        for figure in chapter.figures:
            parts += ['<figure>', f'<img src="{figure.png}" alt="{html.escape(figure.caption)}">',
                      f'<figcaption>{html.escape(figure.caption)}</figcaption>', '</figure>']
    if skipped:
        parts.append('<p>Not drawn yet: chapters '
                     + ", ".join(c.number for c in skipped) + '.</p>')
    parts += ['</body>', '</html>', '']
    return "\n".join(parts)


def figures_md(drawn, skipped):
    """The figures as Doxygen markdown, for the site's gallery page (docs/gallery.md, whose
    marker line scripts/snippets.py replaces with this)."""
    lines = []
    for chapter in drawn:
        lines += [f"## Chapter {chapter.number}: {chapter.title} {{#gallery_ch{chapter.number}}}",
                  "", f"From @ref ch{chapter.number}.", ""]
        for figure in chapter.figures:
            lines += [f'\\image html {figure.png} "{figure.caption}"', ""]
    if skipped:
        lines += ["Not drawn yet: chapters "
                  + ", ".join(c.number for c in skipped) + ".", ""]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", default="build/default/bin", help="the chapter programs")
    parser.add_argument("--out", default="build/default/plots", help="where figures go")
    parser.add_argument("--from", dest="sources", metavar="DIR", action="append",
                        help="plot the CSVs already in DIR instead of running anything "
                             "(repeatable: each chapter's from the first DIR holding them)")
    parser.add_argument("--require-all", action="store_true",
                        help="fail (exit 1) when a chapter has no figures")
    parser.add_argument("--only", metavar="NN", action="append",
                        help="only this chapter (repeatable)")
    parser.add_argument("--readme-figures", metavar="DIR",
                        help="also write small copies of the README's figures into DIR")
    args = parser.parse_args()

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sources = [Path(s).resolve() for s in args.sources or []]
    chapters = [c for c in CHAPTERS if not args.only or c.number in args.only]
    if args.only and not chapters:
        print(f"gallery: no chapter {', '.join(args.only)} (01 to {CHAPTERS[-1].number})",
              file=sys.stderr)
        return 2
    fresh = []  # drawn and checked now
    for chapter in chapters:
        if sources:
            holding = [d for d in sources if all((d / c).exists() for c in chapter.csvs)]
            if not holding:
                print(f"skip chapter {chapter.number}: no folder given holds "
                      f"{', '.join(chapter.csvs)}")
                continue
            source = holding[0]
            if source != out:
                for csv in chapter.csvs:
                    shutil.copy(source / csv, out / csv)
            how = "from " + str(source)
        else:
            how = f"ran in {run_chapter(chapter, args.bin, out):.1f} s"
        draw_chapter(chapter, out)
        fresh.append(chapter)
        print(f"chapter {chapter.number}: {len(chapter.figures)} figures ({how})")
    # The pages show every chapter whose figures are in OUT (drawn now or by an earlier
    # run: --only redraws one chapter and keeps the others, checked here).
    drawn, skipped = [], []
    for chapter in CHAPTERS:
        if chapter in fresh:
            drawn.append(chapter)
            continue
        try:
            for figure in chapter.figures:
                check_png(out / figure.png)
            drawn.append(chapter)
        except (OSError, ValueError):
            skipped.append(chapter)
    (out / "index.html").write_text(index_html(drawn, skipped), encoding="utf-8")
    (out / "figures.md").write_text(figures_md(drawn, skipped), encoding="utf-8")
    print(f"gallery: {out / 'index.html'}")
    if args.readme_figures:
        target = Path(args.readme_figures)
        target.mkdir(parents=True, exist_ok=True)
        for name in README_FIGURES:
            if (out / name).exists():
                shrink_png(out / name, target / f"readme_{name}")
                print(f"wrote {target / f'readme_{name}'}")
    missing = [c.number for c in chapters if c not in fresh]
    if args.require_all and missing:  # drawn now, not left from an earlier run
        print(f"gallery: no figures drawn for chapter(s) {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
