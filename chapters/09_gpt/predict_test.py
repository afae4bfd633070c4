"""Chapter 09's machine profile and prediction, end to end, on a small model and 2 ranks:

    python3 predict_test.py CH09_GPT CH08_PLAN SCRATCH

--calibrate writes a profile with every field chapter 08 reads, a cost for every shard of
the meshes of the ranks, and the collectives' fits; --benchmark --predict reads it back and
puts a finite prediction beside every mesh (how close it comes is a benchmark's question,
not this test's: timings are never asserted here); ch08_plan --machine plans on it; a
profile without a cost a mesh needs ends the run naming that cost; --mesh auto trains on the
mesh the benchmark's prediction puts first. The wrong versions this
catches (each seen failing): a profile written without the ranks' layout
(ranks_per_machine) or its core groups, a cost key that the prediction spells another way than the
calibration, the prediction's columns missing from the CSV.
"""
import csv
import json
import math
import os
import subprocess
import sys

ch09, ch08_plan, scratch = sys.argv[1:4]
os.makedirs(scratch, exist_ok=True)
profile = os.path.join(scratch, "machine.json")
model = ["--ranks", "2", "--layers", "2", "--channels", "64", "--batch", "8"]
failures = []


def run(args, timeout=120):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


done = run([ch09, *model, "--calibrate", profile, "--quiet"])
if done.returncode != 0:
    sys.exit(f"--calibrate exited {done.returncode}: {done.stderr}")
m = json.load(open(profile))
for key in ("cpu", "cores", "clock_ghz", "fp32_lanes", "fma_units", "memory_bytes",
            "gemm_gflops", "triad_GBps", "ranks", "ranks_per_host", "ranks_per_machine"):
    if key not in m:
        failures.append(f"the profile has no '{key}'")
if m.get("ranks") != 2 or m.get("ranks_per_machine") != 2:
    failures.append(f"2 ranks on one machine, the profile says {m.get('ranks')} and "
                    f"{m.get('ranks_per_machine')}")
for op in ("allreduce", "sendrecv", "alltoall"):
    fit = m.get("links", {}).get(op, {}).get("2")
    if not fit or not fit["beta_GBps"] > 0 or fit["alpha_us"] < 0:
        failures.append(f"links.{op}.2 is {fit}")
costs = m.get("costs_s", {})
# The meshes of 2 ranks (tp 2, cp 2, dp 2, pp 2; 2 microbatches of 8 / replicas sequences):
# rows 256 with tp 2 or pp 2, 128 with dp 2 or cp 2 (T = 64).
for shard in ("r256 t2 c1", "r128 t1 c2", "r128 t1 c1", "r256 t1 c1"):
    for what in ("attention_forward", "mlp_backward_input", "last_stage_backward_weight",
                 "first_stage_forward", "core_attention_forward"):
        if not costs.get(f"{what} {shard}", 0) > 0:
            failures.append(f"no positive cost '{what} {shard}'")
# Both ranks are threads of one process: one group, on the CPUs this process may use.
cpus = len(os.sched_getaffinity(0))
if m.get("core_group") != [0, 0] or m.get("group_cores") != [cpus]:
    failures.append(f"2 threads on {cpus} CPUs: core_group {m.get('core_group')}, "
                    f"group_cores {m.get('group_cores')} (expected [0, 0] and [{cpus}])")
if not costs.get("sharing", 0) >= 1:
    failures.append(f"sharing {costs.get('sharing')}: at least 1")

results = os.path.join(scratch, "results")
done = run([ch09, *model, "--benchmark", "--predict", profile, "--steps", "2", "--json",
            "--csv-dir", results])
if done.returncode != 0:
    failures.append(f"--benchmark --predict exited {done.returncode}: {done.stderr[-500:]}")
else:
    p = json.loads(done.stdout)["prediction"]
    if p["meshes"] != 4 or not all(math.isfinite(p[k]) for k in ("median_error", "max_error")):
        failures.append(f"the prediction's summary: {p}")
    if not -1 <= p["spearman"] <= 1:
        failures.append(f"Spearman's rho {p['spearman']}")
    rows = list(csv.DictReader(open(os.path.join(results, "09_gpt_throughput.csv"))))
    if len(rows) != 4:
        failures.append(f"{len(rows)} rows in 09_gpt_throughput.csv, not 4")
    for row in rows:
        if not float(row.get("predicted_ms") or 0) > 0:
            failures.append(f"{row['mesh']}: predicted_ms {row.get('predicted_ms')}")

    # --mesh auto trains on the mesh the same prediction ranks first.
    fastest = min(rows, key=lambda row: float(row["predicted_ms"]))["mesh"]
    done = run([ch09, *model, "--mesh", "auto", "--predict", profile, "--steps", "1",
                "--no-reference", "--json", "--quiet"])
    chosen = json.loads(done.stdout).get("mesh_auto") if done.returncode == 0 else done.stderr
    if chosen != fastest:
        failures.append(f"--mesh auto trained on {chosen!r}, the fastest predicted is {fastest!r}")

done = run([ch08_plan, "--machine", profile, "--model", "custom", "--layers", "2", "--hidden",
            "64", "--heads", "4", "--seq", "64", "--vocab", "256", "--gpus", "2", "--tp", "2",
            "--pp", "1", "--batch", "8", "--overlap", "--json"])
if done.returncode != 0:
    failures.append(f"ch08_plan --machine exited {done.returncode}: {done.stderr}")
elif json.loads(done.stdout)["step_time_s"] <= 0:
    failures.append("ch08_plan --machine: no step time")

# A profile of another model: the first cost a mesh needs, by name, exit 1.
del costs["attention_forward r256 t2 c1"]
m["costs_s"] = costs
broken = os.path.join(scratch, "other.json")
json.dump(m, open(broken, "w"))
done = run([ch09, *model, "--benchmark", "--predict", broken, "--steps", "2"])
if done.returncode != 1 or "attention_forward r256 t2 c1" not in done.stderr:
    failures.append(f"a missing cost: exit {done.returncode}, {done.stderr[-300:]!r}")

for f in failures:
    print("FAIL", f)
print(f"predict_test: {len(failures)} failures")
sys.exit(1 if failures else 0)
