#!/usr/bin/env python3
"""ShardLab's host GEMM next to numpy's BLAS (OpenBLAS), one thread each, in one sitting.

    scripts/gemm_vs_numpy.py [--bin build/default/bin] [--rounds 3] [--markdown]

Each round runs chapter 01's GEMM benchmark (`ch01_matmul_split --ranks 1 --benchmark
--json`: n x n x n at n = 256, 512, 1024, and the capstone's products, M = 1024 by N, K in
{128, 384, 512} in a Linear's three forms), then times numpy's matmul on the same shapes
and forms; the two take turns, so that a slow spell of a shared machine hits both. Every
figure is the best over the rounds (each round already the best of three inside it), in
GFLOP/s = 2 M N K / t, and the ratio is ShardLab's over numpy's.

numpy runs on one thread (OPENBLAS_NUM_THREADS=1 and its siblings, set before numpy
loads); which OpenBLAS kernel it picked is printed when threadpoolctl is installed.
Exit 0 with the table; exit 2 when the program or numpy is missing.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"

# (label, M, N, K, transpose_a, transpose_b) as ch01's gemm_bench.cpp names its forms.
FORMS = {"x@W": (False, False), "dy@W^T": (False, True), "x^T@dy": (True, False)}


def numpy_gflops(np, m, n, k, ta, tb, seconds=0.15):
    """Best of three rounds of numpy's matmul, GFLOP/s."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
    a_op, b_op = (a.T if ta else a), (b.T if tb else b)
    out = np.empty((m, n), dtype=np.float32)
    flops = 2.0 * m * n * k
    iterations = max(1, int(1e8 / flops))
    best = float("inf")
    for _ in range(3):
        np.matmul(a_op, b_op, out=out)
        start = time.perf_counter()
        for _ in range(iterations):
            np.matmul(a_op, b_op, out=out)
        best = min(best, (time.perf_counter() - start) / iterations)
    return flops / best * 1e-9


def shardlab_round(program):
    """One run of ch01's benchmark: {(M, N, K, form): GFLOP/s}, and the kernel's name."""
    with tempfile.TemporaryDirectory() as scratch:
        run = subprocess.run([program, "--ranks", "1", "--benchmark", "--json", "--quiet",
                              "--csv-dir", scratch], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"gemm_vs_numpy: {program} failed (exit {run.returncode}): "
                 f"{run.stderr.strip()[-300:]}")
    result = json.loads(run.stdout)
    found = {}
    for row in result["gemm_gflops"]:
        n = int(row["n"])
        found[(n, n, n, "x@W")] = float(row["blocked_gflops"])
    for row in result["gemm_shapes"]:
        found[(int(row["M"]), int(row["N"]), int(row["K"]), row["form"])] = float(row["gflops"])
    return found, result.get("gemm_kernel", "?")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", default="build/default/bin", help="the programs' folder")
    parser.add_argument("--rounds", type=int, default=3, help="turns each (default 3)")
    parser.add_argument("--markdown", action="store_true", help="the table as Markdown")
    args = parser.parse_args()
    program = os.path.join(args.bin, "ch01_matmul_split")
    if not os.access(program, os.X_OK):
        print(f"gemm_vs_numpy: error: no {program} (build first, or give --bin)", file=sys.stderr)
        sys.exit(2)
    try:
        import numpy as np
    except ImportError:
        print("gemm_vs_numpy: error: numpy is not installed (scripts/setup.sh makes .venv)",
              file=sys.stderr)
        sys.exit(2)
    blas = "numpy " + np.__version__
    try:
        from threadpoolctl import threadpool_info
        info = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        if info:
            blas += ", {} {} ({} kernel, {} thread)".format(
                info[0].get("internal_api"), info[0].get("version"),
                info[0].get("architecture"), info[0].get("num_threads"))
    except ImportError:
        pass

    ours, theirs, kernel = {}, {}, "?"
    for _ in range(args.rounds):
        found, kernel = shardlab_round(program)
        for key, value in found.items():
            ours[key] = max(ours.get(key, 0.0), value)
        for key in found:
            m, n, k, form = key
            ta, tb = FORMS[form]
            theirs[key] = max(theirs.get(key, 0.0), numpy_gflops(np, m, n, k, ta, tb))

    rows = [(key, ours[key], theirs[key], ours[key] / theirs[key]) for key in ours]
    print(f"ShardLab's host GEMM ({kernel} kernel) vs {blas}; one thread each, "
          f"best of {args.rounds} alternating rounds, GFLOP/s")
    if args.markdown:
        print("\n| M x N x K | form | ShardLab | numpy | ratio |\n|---|---|---|---|---|")
    else:
        print(f"{'M x N x K':>16}  {'form':<7} {'shardlab':>9} {'numpy':>9} {'ratio':>6}")
    for (m, n, k, form), mine, numpy_value, ratio in rows:
        shape = f"{m} x {n} x {k}"
        if args.markdown:
            print(f"| {shape} | `{form}` | {mine:.1f} | {numpy_value:.1f} | {ratio:.2f} |")
        else:
            print(f"{shape:>16}  {form:<7} {mine:9.1f} {numpy_value:9.1f} {ratio:6.2f}")
    worst = min(rows, key=lambda r: r[3])
    print(f"\nlowest ratio {worst[3]:.2f} ({worst[0][0]} x {worst[0][1]} x {worst[0][2]} "
          f"{worst[0][3]}); median {sorted(r[3] for r in rows)[len(rows) // 2]:.2f}")


if __name__ == "__main__":
    main()
