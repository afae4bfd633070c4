#!/usr/bin/env python3
"""Runs every chapter program with random arguments, the way a careless user would.

    scripts/fuzz_args.py [--runs N] [--seed S] [--memory-gb G] [--jobs J] PROGRAM...
    scripts/fuzz_args.py --self-test     (the judge, on hand-made results)

Each run draws a few flags and a value for each from the tables below (valid values,
edges, values just outside the range, NaN, infinity, words where numbers belong, sizes
whose product no machine holds) and runs the program under a memory cap (like ulimit -v)
and a time limit, in a scratch folder. A run fails the test if it

  - dies of a signal, or is still running after the time limit (a hang);
  - exits with a code other than 0, 1 or 2;
  - exits 2 with anything but one line "<program>: error: ..." on stderr;
  - runs out of memory (std::bad_alloc, "cannot allocate"): the program must refuse
    what it cannot hold before it starts;
  - says "ok": true, or exits 0, while a result is NaN or infinite;
  - exits 1 without saying why.

Checked against: chapter 03 with its memory estimate returning 0 (caught: "--count
1073741824 ...: cannot allocate 4294967296 bytes"); a rank that crashes or hangs, and an
exit-2 message of two lines and the rest of judge()'s cases: --self-test.

No program runs the same argument list twice (a repeated draw is drawn again). The
draws depend on the seed alone, so a failure is reproduced by running the same command; each failure prints the command line that shows it. Every flag in a program's
--help must have values here, so a new flag cannot go untested.
"""

import argparse
import concurrent.futures
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

# In a flag's values: each value the program's --help lists for it ({a,b,c}), so that a
# list the program owns (chapter 04's schedules) is written once, there.
CHOICES = "<the values --help lists>"

# Flags every program has (launch.cpp). Values are strings, as on a command line.
COMMON = {
    "--ranks": ["1", "2", "3", "4", "7", "0", "-1", "1025", "abc", "", "2.5", "64"],
    "--backend": ["auto", "threads", "mpi", "nccl", "carrier-pigeon"],
    "--device": ["cpu", "cuda", "gpu"],
    "--seed": ["0", "1", "-1", "abc", "18446744073709551615", "18446744073709551616", "1e3", ""],
    "--timeout": ["1", "5", "0", "0.0001", "nan", "inf", "-inf", "-1", "1e9", "abc"],
    "--memory-limit": ["0", "0.001", "2", "-1", "nan", "inf", "1e7", "abc"],
    "--csv-dir": ["out", "out/deeper", "/dev/full", "/proc", "a-file", ""],
    "--flight-record": ["0", "1", "64", "-1", "abc", "1e9", "1000001"],
    "--flight-dir": ["flights", "/proc/flights", "a-file", ""],
    "--json": None,  # a flag without a value
    "-q": None,
    "--quiet": None,
    "-r": ["2", "0", "x"],
}

# Each chapter's own flags. Values that are valid but slow (a million steps) are left
# out: this looks for crashes and wrong verdicts, not for patience.
CHAPTERS = {
    "ch01": {
        "--rows": ["1", "2", "4", "17", "0", "-1", "4097", "abc", "1.5", "4096"],
        "--inner": ["1", "5", "33", "0", "-3", "4097", "", "1e2"],
        "--cols": ["1", "8", "3", "0", "4097", "nan", "100000"],
        "--benchmark": None,
        "--peak-tflops": ["0", "1", "100", "nan", "inf", "-1", "1e7", "abc"],
    },
    "ch02": {
        "--sync": ["none", "allreduce", "bucketed", "overlap", "sometimes", ""],
        "--steps": ["1", "2", "5", "0", "-1", "1000001", "abc"],
        "--batch": ["1", "3", "64", "0", "-5", "1048577", "x"],
        "--bucket-kb": ["0.001", "1", "64", "0", "-4", "nan", "inf", "1e9", "1048577"],
        "--accum-steps": ["1", "2", "3", "0", "4097", "abc"],
        "--lr": ["0", "0.05", "0.5", "1", "5", "10", "11", "nan", "inf", "-1"],
        "--in": ["1", "16", "64", "0", "65537", "abc", "65536"],
        "--hidden": ["1", "64", "200", "0", "65537", "-1", "65536"],
        "--benchmark": None,
        "--recompute": ["none", "selective", "full", "some", ""],
        "--trace": ["out/t.json", "/proc/t.json", "/dev/full", ""],
    },
    "ch03": {
        "--algo": ["naive", "ring", "pipelined", "recursive_doubling", "hierarchical", "native", "all", "carrier-pigeon"],
        "--count": ["0", "1", "2", "3", "7", "1000", "1000003", "1073741824", "1073741825", "-1", "abc"],
        "--benchmark": None,
        "-b": ["4", "1K", "64K", "64M", "4G", "0", "3", "abc", "1.5K", "5G"],
        "--minbytes": ["8", "1M"],
        "-e": ["4", "64K", "1M", "4G", "0", "1T", "abc"],
        "--maxbytes": ["16", "256K"],
        "-f": ["2", "3", "1024", "1", "nan", "inf", "1025", "abc"],
        "--stepfactor": ["4"],
        "-n": ["1", "2", "0", "100001", "abc"],
        "--iters": ["3"],
        "-w": ["0", "1", "-1", "x"],
        "--warmup_iters": ["2"],
        "--segment-kb": ["0.004", "1", "256", "1048576", "nan", "inf", "0", "-1"],
        "--ranks-per-node": ["1", "2", "3", "0", "1025", "abc"],
        "--link-gbit": ["1", "0.25", "0", "-1", "nan", "inf", "1e7", "abc"],
    },
    "ch04": {
        "--schedule": [CHOICES, "zigzag", ""],
        "-m": ["1", "3", "8", "0", "4097", "4096", "64"],
        "--microbatches": ["2", "abc"],
        "-v": ["1", "2", "3", "0", "65", "64"],
        "--chunks": ["2", "-1"],
        "-p": ["1", "2", "4", "0", "1025"],
        "--stages": ["3", "1024", "x"],
        "--simulate": None,
        "--fwd-cost": ["1", "0.5", "0", "nan", "inf", "-1", "1e6", "1e-7"],
        "--bwd-cost": ["2", "1", "0", "nan", "1e9"],
        "--wgrad-cost": ["0", "1", "-inf", "nan", "1e6"],
        "--layers": ["1", "2", "8", "0", "4097", "64"],
        "--width": ["1", "8", "64", "300", "0", "8193", "8192"],
        "--batch": ["1", "7", "64", "0", "1048577", "1048576"],
        "--trace": ["out/trace.json", "/dev/full/trace.json", "", "a-file", "/proc/trace.json"],
        "--benchmark": None,
        "--recompute": ["none", "selective", "full", "some", ""],
        "--trace": ["out/t.json", "/proc/t.json", "/dev/full", ""],
    },
    "ch05": {
        "--params": ["7.5B", "1e9", "350M", "1", "0", "-1", "nan", "inf", "1e17", "7.5X", "", "abc"],
        "--preset": ["gpt2-1.5b", "zero-7.5b", "gpt3-175b", "llama-65b", "zero-1t", "gpt5", ""],
        "--dp": ["1", "4", "64", "1024", "0", "-2", "nan", "inf", "1e10", "abc"],
        "--device-gb": ["80", "0.5", "0", "-1", "nan", "inf", "1e10"],
        "--table": None,
        "--precision": ["fp32", "mixed", "fp8", ""],
        "--train": None,
        "--stage": ["0", "1", "2", "3", "4", "-1", "x"],
        "--steps": ["1", "3", "0", "1001", "abc"],
        "--blocks": ["1", "2", "0", "1025", "x"],
        "--width": ["1", "8", "64", "0", "4097", "y"],
        "--batch": ["1", "7", "64", "0", "1048577", "1048576"],
        "--benchmark": None,
        "--recompute": ["none", "selective", "full", "some", ""],
        "--trace": ["out/t.json", "/proc/t.json", "/dev/full", ""],
    },
    "ch06": {
        "--to-half": ["1e-8", "65504", "65520", "0.1", "-0", "inf", "nan", "abc", "1e-8x", ""],
        "--scaler": ["none", "static", "dynamic", "fancy", ""],
        "--scale": ["2^16", "1024", "2^-3", "0", "-1", "inf", "nan", "2^200", "abc", "2^1.5"],
        "--init-scale": ["2^16", "1", "2^127", "2^128", "0", "-2", "x"],
        "--growth-factor": ["2", "1.5", "1", "0.5", "nan", "inf", "1e6"],
        "--backoff-factor": ["0.5", "0.99", "1", "0", "-1", "nan", "2"],
        "--growth-interval": ["1", "20", "2000", "0", "-1", "1000001", "x"],
        "--inject-overflow": ["1", "3,4", "0", "1,x", "999999", "", "2,2"],
        "--steps": ["1", "5", "60", "0", "100001", "x"],
        "--lr": ["3e-5", "1e-3", "0", "nan", "inf", "2"],
        "--target-scale": ["1e-4", "1", "1e-12", "0", "nan", "1e5"],
        "--batch": ["1", "7", "128", "0", "1048577", "x"],
        "--hidden": ["1", "64", "0", "4097", "x"],
        "--csv": None,
    },
    "ch07": {
        "--tokens": ["1", "3", "64", "0", "65537", "x", "65536"],
        "--hidden": ["1", "16", "0", "4097", "x"],
        "--ffn": ["1", "32", "0", "16385", "x"],
        "--experts": ["1", "2", "4", "8", "6", "0", "1025", "x"],
        "--top-k": ["1", "2", "3", "9", "0", "x"],
        "--capacity-factor": ["1", "1.25", "0.01", "0", "-1", "nan", "inf", "1e7"],
        "--aux-alpha": ["0", "0.01", "1", "-1", "nan", "inf", "1e4"],
        "--train": ["1", "5", "0", "100001", "x"],
        "--lr": ["0.01", "0", "nan", "2"],
        "--csv": None,
        "--benchmark": None,
        "--max-mib": ["1", "2", "0", "4097", "x"],
    },
    "ch08_hybrid_mesh": {
        "--dp": ["0", "1", "2", "4", "3", "-1", "1048577", "x", "1024"],
        "--tp": ["1", "2", "4", "8", "3", "0", "1048577", "x", "16"],
        "--pp": ["1", "2", "4", "3", "-1", "1048577", "x", "64"],
        "--microbatches": ["1", "2", "4", "8", "0", "4097", "x", "4096"],
        "--blocks": ["1", "2", "4", "8", "3", "0", "1025", "x"],
        "--ffn": ["1", "32", "64", "256", "0", "16385", "x"],
        "--steps": ["1", "2", "5", "0", "10001", "x"],
        "--lr": ["0.01", "1e-9", "1", "0", "1.5", "nan", "inf", "x"],
        "--sgd": None,
        "--schedule": [CHOICES, "interleaved", ""],
        "--hidden": ["16", "8", "32", "15", "0", "4097", "x"],
        "--batch": ["32", "8", "1", "64", "256", "2.5", "0", "65537", "x"],
        "--zero": ["0", "1", "2", "-1", "x"],
        # another program's flags: refused
        "--plan": None,
        "--layout": None,
        "--model": ["1t"],
    },
    "ch08_layout": {
        "--dp": ["1", "2", "6", "0", "-1", "1048577", "x", "1024"],
        "--tp": ["1", "2", "8", "16", "0", "1048577", "x"],
        "--pp": ["1", "2", "4", "64", "0", "1048577", "x"],
        "--cp": ["1", "2", "4", "0", "1048577", "x"],
        "--ep": ["1", "2", "8", "0", "1048577", "x"],
        "--gpus-per-node": ["8", "1", "4", "16", "0", "1048577", "x"],
        "--csv": None,
        "--plan": None,
        "--steps": ["4"],
    },
    "ch08_plan": {
        "--dp": ["1", "8", "64", "0", "-1", "1048577", "x"],
        "--tp": ["1", "8", "6", "7", "0", "1048577", "x"],
        "--pp": ["1", "16", "64", "5", "0", "1048577", "x"],
        "--microbatches": ["1", "8", "512", "0", "1048577", "x"],
        "--search": None,
        "--csv": None,
        "--sequence-parallel": None,
        "--model": ["gpt3-175b", "1.7b", "1t", "22b", "custom", "gpt5", ""],
        "--layers": ["1", "96", "100000", "0", "100001", "x"],
        "--hidden": ["16", "8", "32", "15", "0", "12288", "1000001", "x"],
        "--heads": ["1", "96", "100000", "0", "100001", "x"],
        "--seq": ["2048", "1", "2^27", "2^28", "0", "x"],
        "--vocab": ["51200", "1", "1e8", "1e9", "0", "x"],
        "--cluster": ["a100-80gb", "h100-80gb", "tpu-v5", ""],
        "--machine": ["/nonexistent", "a-file", "/proc", ""],
        "--overlap": None,
        "--gpus": ["1024", "3K", "2^12", "3072", "1", "0", "1e12", "2^24", "nan", "x"],
        "--tokens": ["300B", "1", "1e16", "1e17", "0", "nan", "x"],
        "--batch": ["1536", "8", "1", "2.5", "0", "x"],
        "--microbatch-size": ["1", "2", "4", "0", "1048577", "x"],
        "--achieved-tflops": ["140", "0.001", "1e6", "0", "1e7", "nan", "x"],
        "--gpu-memory-gb": ["80", "40", "0.001", "0", "1e7", "nan", "x"],
        "--gpus-per-node": ["8", "1", "4", "16", "0", "1048577", "x"],
        "--nics-per-node": ["8", "1", "2", "16", "0", "-1", "1048577", "1.5", "x"],
        "--top": ["20", "1", "0", "3", "-1", "1048577", "2.5", "x"],
        "--zero": ["0", "1", "2", "3", "4", "-1", "x"],
        "--recompute": ["none", "selective", "full", "some", ""],
        "--layout": None,
        "--cp": ["1", "2", "4", "3", "0", "1048577", "x"],
        "--ep": ["1", "2", "128", "3", "0", "1048577", "x"],
        "--experts": ["0", "8", "128", "3", "-1", "100001", "x"],
        "--top-k": ["1", "2", "129", "0", "x"],
        "--moe-every": ["1", "2", "0", "100001", "x"],
    },
    "ch09": {
        "--dp": ["0", "1", "2", "4", "3", "-1", "1048577", "x"],
        "--tp": ["1", "2", "4", "8", "3", "0", "1048577", "x"],
        "--pp": ["1", "2", "4", "3", "-1", "1048577", "x"],
        "--layers": ["1", "2", "4", "3", "0", "65", "x"],
        "--channels": ["8", "16", "32", "15", "0", "2049", "x"],
        "--heads": ["1", "2", "4", "8", "3", "0", "257", "x"],
        "--context": ["1", "8", "16", "0", "1025", "x"],
        "--batch": ["1", "8", "16", "2", "0", "4097", "2.5", "x"],
        "--microbatches": ["1", "2", "4", "0", "4097", "x"],
        "--steps": ["1", "2", "3", "0", "100001", "x"],
        "--lr": ["0.003", "1e-9", "10", "0", "11", "nan", "inf", "x"],
        "--clip": ["1", "0", "1e-9", "-1", "nan", "inf", "x"],
        "--schedule": [CHOICES, "interleaved", "naive", ""],
        "--chunks": ["1", "2", "4", "0", "65", "x"],
        "--zero": ["0", "1", "2", "-1", "x"],
        "--log-every": ["1", "10", "0", "x"],
        "--data": ["a-file", "/dev/null", "/nonexistent", "/proc", ""],
        "--save": ["out", "out/deeper", "/proc/ckpt", "/dev/full", ""],
        "--load": ["out", "/nonexistent", "/proc", "a-file", ""],
        "--sample": ["1", "8", "0", "-1", "100001", "x"],
        "--prompt": ["Rank ", "", "\u00e9t\u00e9"],
        "--temperature": ["0", "0.8", "100", "-1", "nan", "x"],
        "--top-k": ["0", "1", "5", "-1", "x"],
        "--no-reference": None,
        "--benchmark": None,
        "--recompute": ["none", "selective", "full", "some", ""],
        "--trace": ["out/t.json", "/proc/t.json", "/dev/full", ""],
        "--sequence-parallel": None,
        "--overlap": ["none", "pp,dp", "dp,,pp", "xp"],
        "--buckets": ["1", "64", "0", "x"],
        # Only the values refused at once: a whole calibration is not this test's work.
        "--calibrate": ["/proc/m.json", "/dev/full/m.json", ""],
        "--predict": ["/nonexistent", "a-file", "/proc", ""],
        "--mesh": ["auto", "manual", ""],
        "--precision": ["fp32", "fp16", "bf16", "fp8", ""],
        "--scaler": ["none", "static", "dynamic", "some", ""],
        "--init-scale": ["65536", "1e12", "0", "-1", "nan", "x"],
        "--cp": ["1", "2", "4", "8", "3", "0", "1048577", "x"],
        "--ep": ["1", "2", "4", "8", "3", "0", "1048577", "x"],
        "--experts": ["0", "2", "4", "8", "3", "-1", "257", "x"],
        "--moe-every": ["1", "2", "3", "0", "65", "x"],
        "--capacity-factor": ["1", "1.25", "0.01", "0", "-1", "nan", "inf", "x"],
        "--aux-alpha": ["0", "0.01", "1", "-1", "nan", "inf", "x"],
    },
    "ch10": {
        "--seq": ["96", "8", "16", "30", "0", "4096", "4097", "x"],
        "--heads": ["1", "4", "64", "0", "65", "x"],
        "--head-dim": ["1", "16", "256", "0", "257", "x"],
        "--split": ["zigzag", "plain", "striped", ""],
        "--benchmark": None,
    },
}
# Chapter 11 trains chapter 09's model: its mesh, model and training flags, and its own.
CHAPTERS["ch11"] = {flag: values for flag, values in CHAPTERS["ch09"].items()
                    if flag not in ("--save", "--load", "--sample", "--prompt", "--temperature",
                                    "--no-reference", "--benchmark", "--trace", "--calibrate",
                                    "--predict", "--mesh", "--log-every")}
CHAPTERS["ch11"].update({
    "--inject": ["none", "kill@1@1", "hang@0@1", "stall@1@1", "kill@7@0", "kill@8@1", "kill@1@99", "nan@1@1",
                 "flip@2@0", "slow@3@2", "slow@3@0.5", "nap@1@1", "kill@-1@1", "kill@1", ""],
    "--check-every": ["0", "1", "3", "-1", "x"],
    "--checkpoint-every": ["0", "1", "2", "-1", "100001", "x", "auto", ""],
    "--mtbf-steps": ["0", "2", "8", "-1", "x", "nan"],
    "--checkpoint-dir": ["out/ckpt", "/proc/ckpt", "/dev/full", ""],
    "--compare-flights": ["flights", "/nonexistent", "a-file", ""],
    "--plan": None,
    "--elastic": None,
    "--async-checkpoints": None,
    "--memory-checkpoints": None,
    "--processes": ["0", "-1", "x", "4097", ""],  # refused: a valid one would start mpirun
    "--mpirun": ["mpirun", ""],
    "--save": ["out/final", "/proc/final", ""],
    "--sweep": None,
    "--intervals": ["1", "1,4", "0", "x", "", "2,100001"],
    "--rounds": ["1", "2", "0", "-1", "x"],
})

# Pairs whose product is what matters: drawn together, so that a large value meets
# another large one (refused) or a small one (fast), never a slow middle.
PAIRS = {
    "ch02": [("--in", "--hidden", [("65536", "65536"), ("65536", "1"), ("1", "65536"),
                                   ("4096", "4096"), ("16", "64")])],
    "ch01": [("--rows", "--cols", [("4096", "4096"), ("4096", "1")])],
    "ch07": [("--tokens", "--hidden", [("65536", "4096"), ("65536", "1"), ("64", "4096"), ("64", "16")])],
    "ch05": [("--width", "--blocks", [("4096", "1024"), ("4096", "1"), ("1", "1024"), ("64", "4"),
                                      ("16", "64")])],
    # --dp x --pp (x --tp 2) ranks: 2^21 (refused), 2^16 (a --layout of a few seconds), small.
    "ch08_hybrid_mesh": [("--batch", "--microbatches", [("4096", "4096"), ("64", "64"),
                                                        ("2", "1"), ("256", "8")]),
                         ("--hidden", "--ffn", [("4097", "16384"), ("16", "16385"),
                                                ("32", "32")])],
    # --dp x --pp (x --tp) ranks: 2^21 (refused), 2^16 (a layout of a few seconds), small.
    "ch08_layout": [("--dp", "--pp", [("1024", "1024"), ("256", "128"), ("64", "16"),
                                      ("2", "2"), ("1", "1")])],
    # T^2 x heads x head-dim: 4096^2 x 4 x 256 products is refused before the ranks start;
    # 4096^2 x 4 x 1 runs in seconds.
    "ch10": [("--seq", "--head-dim", [("4096", "256"), ("16", "256"), ("4096", "1")])],
    "ch08_plan": [("--gpus", "--tokens", [("16777216", "1e16"), ("1", "1"), ("3072", "450B")])],
}

# Flags added where a run did not draw them (under either spelling): chapter 09 trains
# for minutes by default, chapter 03's benchmark times 20 iterations of every size up to
# 64 MiB, chapter 07's all-to-alls up to 256 MiB and chapter 04's a model 256 wide: the
# benchmark modes' sizes are the machine's business, not the flags' (those drawn stay).
FILL = {"ch09": [(("--steps",), "2")],
        "ch11": [(("--steps",), "2"), (("--rounds",), "1"), (("--intervals",), "1,2")],
        "ch03": [(("-n", "--iters"), "2"), (("-w", "--warmup_iters"), "1"),
                 (("-e", "--maxbytes"), "1M")],
        "ch04": [(("--width",), "64")],
        "ch07": [(("--max-mib",), "1")]}

# Redraws before a program's runs give up looking for an argument list not yet run.
REDRAWS = 50

TIME_LIMIT_S = 60


def help_flags(program):
    """The flags a program's --help lists (both spellings where it has two), each with the
    values it lists for it ({a,b,c}; empty where it lists none)."""
    out = subprocess.run([program, "--help"], capture_output=True, text=True, timeout=30).stdout
    flags = {}
    for line in out.splitlines():
        m = re.match(r"\s+(-[^\s]+)", line)
        if not m:
            continue
        listed = re.search(r":\{([^}]*)\}", line)
        for flag in m.group(1).split(","):
            if flag not in ("-h", "--help", "--version"):
                flags[flag] = listed.group(1).split(",") if listed else []
    return flags


def table_for(program):
    name = os.path.basename(program)
    chapter = name if name in CHAPTERS else name[:4]  # a chapter's second program: its own
    if chapter not in CHAPTERS:
        sys.exit(f"fuzz_args.py: no values for {name}: add its flags to CHAPTERS")
    table = dict(COMMON)
    table.update(CHAPTERS[chapter])
    listed = help_flags(program)
    missing = sorted(set(listed) - set(table))
    if missing:
        sys.exit(f"fuzz_args.py: {name} has flags without values here: {' '.join(missing)}")
    for flag, values in table.items():
        if values and CHOICES in values:
            if not listed.get(flag):
                sys.exit(f"fuzz_args.py: {name}'s --help lists no values for {flag}")
            table[flag] = [v for v in values if v != CHOICES] + listed[flag]
    return table, PAIRS.get(chapter, [])


def draw(rng, table, pairs, scratch):
    """A random argument list."""
    args = []
    flags = sorted(table)
    for flag in rng.sample(flags, rng.randint(1, 4)):
        values = table[flag]
        if values is None:
            args.append(flag)
            continue
        value = rng.choice(values)
        if flag in ("--csv-dir", "--trace") and value.split("/")[0] in ("out", "a-file"):
            value = os.path.join(scratch, value)
        args += [flag, value]
    if pairs and rng.random() < 0.3:
        a, b, choices = rng.choice(pairs)
        va, vb = rng.choice(choices)
        args += [a, va, b, vb]
    if rng.random() < 0.5 and "--json" not in args:
        args.append("--json")
    return args


def fill(name, args):
    """args with FILL's flags added where neither spelling of one was drawn."""
    for spellings, value in FILL.get(name[:4], []):
        if not any(s in args for s in spellings):
            args = args + [spellings[-1], value]
    return args


def non_finite(value):
    """Whether a parsed JSON value holds a null (how a NaN or infinity is written)."""
    if value is None:
        return True
    if isinstance(value, dict):
        return any(non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(non_finite(v) for v in value)
    return False


def judge(name, args, rc, out, err):
    """What is wrong with one run, or None."""
    text = out + err
    if rc is None:
        return f"still running after {TIME_LIMIT_S} s"
    if rc < 0:
        return f"killed by signal {-rc}"
    if rc not in (0, 1, 2):
        return f"exit code {rc}"
    if re.search(r"bad_alloc|cannot allocate|terminate called|Sanitizer|Segmentation", text):
        return "ran out of memory or crashed: " + text.strip().splitlines()[-1]
    if rc == 2:
        lines = err.splitlines()
        if len(lines) != 1 or not lines[0].startswith(name + ": error: "):
            return "exit 2 without exactly one line '" + name + ": error: ...' on stderr"
    if rc == 1 and not err.strip():
        return "exit 1 without a message"
    if "--json" in args and out.strip():
        try:
            result = json.loads(out)
        except json.JSONDecodeError:
            return "--json printed something that is not JSON"
        if result.get("ok") is True and rc != 0:
            return f'"ok": true but exit {rc}'
        if rc == 0 and result.get("ok") is not True:
            return 'exit 0 without "ok": true'
        if rc == 0 and non_finite(result):
            return 'exit 0 with a NaN or infinite value (null) in the JSON'
    elif rc == 0 and re.search(r"(?<![\w.])-?(nan|inf)(?![\w.])", text, re.IGNORECASE):
        return "exit 0 while printing nan or inf"
    return None


def self_test():
    """judge() on hand-made results: each bad one is named, the good ones pass."""
    n = "chNN_demo"
    bad = [((n, [], -11, "", ""), "killed by signal 11"),
           ((n, [], None, "", ""), "still running"),
           ((n, [], 3, "", "x"), "exit code 3"),
           ((n, [], 2, "", n + ": error: one\nand two\n"), "exactly one line"),
           ((n, [], 2, "", "error: no program name\n"), "exactly one line"),
           ((n, [], 1, "", ""), "without a message"),
           ((n, [], 1, "", n + ": cannot allocate 4096 bytes\n"), "out of memory"),
           ((n, [], 1, "", "terminate called after throwing\n"), "out of memory or crashed"),
           ((n, ["--json"], 0, '{"ok": true, "diff": null}', ""), "NaN or infinite"),
           ((n, ["--json"], 1, '{"ok": true}', "x"), '"ok": true but exit 1'),
           ((n, ["--json"], 0, '{"ok": false}', ""), 'without "ok": true'),
           ((n, ["--json"], 0, "not json", ""), "not JSON"),
           ((n, [], 0, "max abs diff nan\n", ""), "nan or inf"),
           ((n, [], 0, "loss -inf\n", ""), "nan or inf")]
    good = [(n, [], 0, "max abs diff 0 (bitwise), info, 1e-9\n", ""),
            (n, [], 2, "", n + ": error: --rows: 'nan' is not a finite number\n"),
            (n, [], 1, "", n + ": verification failed: training diverged\n"),
            (n, ["--json"], 0, '{"ok": true, "x": [1.5, 2]}', "")]
    wrong = [f"{case}: expected '{want}', got {judge(*case)!r}"
             for case, want in bad if want not in (judge(*case) or "")]
    wrong += [f"{case}: expected no complaint, got {judge(*case)!r}"
              for case in good if judge(*case) is not None]
    for w in wrong:
        print("FAIL", w)
    print(f"self-test: {len(bad)} bad and {len(good)} good results, {len(wrong)} judged wrongly")
    return 1 if wrong else 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("programs", nargs="+")
    parser.add_argument("--runs", type=int, default=50, help="runs per program")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--memory-gb", type=float, default=3.0, help="address-space cap per run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    options = parser.parse_args()

    cap = int(options.memory_gb * 2**30)

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = dict(os.environ)
    env.pop("SHARDLAB_MEMORY_LIMIT_GIB", None)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    failures, codes, started, slowest = [], {0: 0, 1: 0, 2: 0}, time.monotonic(), []
    # The argument lists first, each in a scratch folder of its own (the same draws, in the
    # same order, however many run at once), then --jobs runs at a time, judged in order.
    jobs = []  # (program, name, args, scratch)
    for program in options.programs:
        program = os.path.abspath(program)
        name = os.path.basename(program)
        table, pairs = table_for(program)
        rng = random.Random(f"{options.seed}/{name}")
        seen = set()  # argument lists already run: the same draw twice tests nothing new
        for run in range(options.runs):
            scratch = tempfile.mkdtemp(prefix="shardlab-fuzz-")
            open(os.path.join(scratch, "a-file"), "w").close()
            for _ in range(REDRAWS):
                args = fill(name, draw(rng, table, pairs, scratch))
                key = tuple(a.replace(scratch, "SCRATCH") for a in args)
                if key not in seen:
                    break
            else:
                shutil.rmtree(scratch, ignore_errors=True)
                break  # the table holds no new list worth the search
            seen.add(key)
            jobs.append((program, name, args, scratch))

    def execute(job):
        program, name, args, scratch = job
        began = time.monotonic()
        try:
            p = subprocess.run([program] + args, cwd=scratch, env=env, preexec_fn=limit,
                               capture_output=True, text=True, errors="replace",
                               timeout=TIME_LIMIT_S)
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc = None
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return rc, out, err, time.monotonic() - began

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, options.jobs)) as pool:
        results = list(pool.map(execute, jobs))
    for (program, name, args, scratch), (rc, out, err, seconds) in zip(jobs, results):
        codes[rc] = codes.get(rc, 0) + 1
        problem = judge(name, args, rc, out, err)
        shown = " ".join(repr(a) if a == "" or " " in a else a for a in args)
        slowest.append((seconds, f"{name} {shown} (exit {rc})"))
        if problem:
            failures.append(f"{name} {shown}: {problem}")
            print(f"FAIL {name} {shown}\n     {problem}", flush=True)
    total = sum(codes.values())
    for seconds, run in sorted(slowest, reverse=True)[:3]:
        print(f"slow: {seconds:.1f} s  {run}")
    print(f"{total} runs of {len(options.programs)} programs in {time.monotonic() - started:.0f} s "
          f"(seed {options.seed}, {options.memory_gb:g} GiB cap): exit 0: {codes.get(0, 0)}, "
          f"exit 1: {codes.get(1, 0)}, exit 2: {codes.get(2, 0)}; {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
