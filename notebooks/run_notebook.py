"""Executes a notebook's code cells in order, in one namespace, headlessly, the way its
kernel would run them top to bottom, and checks the pictures it was to save.

    .venv/bin/python notebooks/run_notebook.py NOTEBOOK.ipynb --results DIR --expect a.png,b.png

SHARDLAB_RESULTS is DIR (where the notebooks read their CSVs and save their figures), the
working folder the notebook's own, matplotlib's backend Agg. No Jupyter kernel is started:
starting a kernel for each of the eleven notebooks was most of their time in the suite (4.4 s each alone, now 1.1). A
cell's last expression is evaluated but not shown; IPython's magics are not understood (the
notebooks use none). Exit 0 when every cell ran and every expected picture is a real one
(plotting.check_png), 1 otherwise, naming the cell or the picture.
"""
import argparse
import json
import os
import sys
import traceback


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebook")
    parser.add_argument("--results", required=True)
    parser.add_argument("--expect", default="", help="PNG files (comma-separated) it must save")
    args = parser.parse_args()
    results = os.path.abspath(args.results)
    expect = [os.path.join(results, name) for name in args.expect.split(",") if name]
    for path in expect:
        if os.path.exists(path):
            os.remove(path)
    os.environ["SHARDLAB_RESULTS"] = results
    os.environ["MPLBACKEND"] = "Agg"
    notebook = os.path.abspath(args.notebook)
    here = os.path.dirname(notebook)
    os.chdir(here)
    sys.path.insert(0, here)
    with open(notebook, encoding="utf-8") as f:
        cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
    namespace = {"__name__": "__main__"}
    for number, cell in enumerate(cells, 1):
        source = "".join(cell["source"])
        try:
            exec(compile(source, f"{args.notebook} (code cell {number})", "exec"), namespace)
        except Exception:  # noqa: BLE001  (the notebook's own failure, reported as such)
            traceback.print_exc()
            print(f"notebook: {args.notebook}: code cell {number} failed", file=sys.stderr)
            return 1
    from plotting import check_png

    for path in expect:
        if not os.path.exists(path):
            print(f"notebook: {args.notebook} ran but did not write {path}", file=sys.stderr)
            return 1
        try:
            width, height = check_png(path)
        except ValueError as e:
            print(f"notebook: {args.notebook} wrote a bad image: {e}", file=sys.stderr)
            return 1
        print(f"notebook: {os.path.basename(path)} {width} x {height}")
    print(f"notebook: {os.path.basename(args.notebook)}: {len(cells)} code cells ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
