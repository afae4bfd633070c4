#!/usr/bin/env python3
"""The summary of scripts/gpu_proof.sh, from the JSON its runs wrote into BUILD: one line
per number, "FAILED: ..." for one that disproves the GPU path."""
import json, os, sys
build = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(build, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
g = load("sgemm.json")
if g and g.get("gemm"):
    best = max(g["gemm"], key=lambda r: r.get("tflops", 0))
    frac = best.get("fraction_of_peak", 0)
    print(f"SGEMM n={best['size']}: {best['tflops']:.2f} TFLOP/s = {frac:.2f} of the FP32 peak "
          f"{g.get('peak_tflops', 0):.1f} TFLOP/s ({g.get('gemm_device', '')})")
    if frac > 1:
        print("FAILED: SGEMM above the FP32 peak: TF32 (or another reduced precision) is in use")
for name, what in (("allreduce.json", "threads, 2 ranks on one GPU"),
                   ("allreduce_nccl.json", "NCCL, one rank per GPU")):
    a = load(name)
    if not a:
        continue
    rows = a.get("benchmark", [])
    largest = max((r["bytes"] for r in rows), default=0)
    at = {r["algorithm"]: r for r in rows if r["bytes"] == largest}
    if "native" in at and "memcpy" in at:
        n, m = at["native"]["busbw_GBps"], at["memcpy"]["busbw_GBps"]
        print(f"device allreduce ({what}) at {largest >> 20} MiB: busbw {n:.1f} GB/s, "
              f"device-to-device copy {m:.1f} GB/s, ratio {n / m if m else 0:.2f}")
gpu, cpu = load("ch02_gpu.json"), load("ch02_cpu.json")
if gpu and cpu:
    div = max(r.get("replica_max_divergence", 0) for r in gpu.get("result", [{}]))
    lg, lc = gpu.get("losses", []), cpu.get("losses", [])
    rel = max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(lg, lc)), default=float("nan"))
    print(f"ch02 on the GPU: replicas diverge by {div:g}; loss curve vs the CPU run: max "
          f"relative difference {rel:.3g} over {min(len(lg), len(lc))} steps")
    if div != 0:
        print("FAILED: ch02's replicas diverged on the GPU")
