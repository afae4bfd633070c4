#!/usr/bin/env bash
# gpu_proof.sh: proves the GPU path on a machine with one NVIDIA GPU or more, in about
# ten minutes, and prints a short summary at the end.
#   1. builds for this machine's GPU (build/gpu-proof, CMAKE_CUDA_ARCHITECTURES=native)
#   2. ctest -L gpu: every chapter with --device cuda and, with 2+ GPUs, --backend nccl,
#      their numbers checked; fails if a test skips for want of a GPU on a machine that
#      has one (only the tests that need more GPUs than there are may skip)
#   3. every chapter's default run with --device cuda
#   4. compute-sanitizer memcheck and racecheck on the device kernels, where installed
#   5. the summary: SGEMM over the device's FP32 peak (above 1 means TF32 crept in), the
#      device allreduce's busbw against a device-to-device copy, chapter 02's replicas'
#      divergence and its loss curve's difference to the CPU's
# Without a GPU it says so in its last line and exits 1 within seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
build=build/gpu-proof
summary=()
failed=0
note() { summary+=("$*"); }
bad() { summary+=("FAILED: $*"); failed=1; }
finish() {
  printf '\n== gpu_proof summary\n'
  printf '  %s\n' "${summary[@]}"
  if ((failed)); then echo "gpu_proof: FAILED (logs in $build/)"; exit 1; fi
  echo "gpu_proof: passed"
  exit 0
}

if ! ls /dev/nvidia[0-9]* > /dev/null 2>&1 || ! command -v nvidia-smi > /dev/null; then
  echo "gpu_proof: no NVIDIA GPU here (no /dev/nvidia0 or no nvidia-smi): nothing was run"
  exit 1
fi
gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ')
if ((gpus == 0)); then
  echo "gpu_proof: nvidia-smi lists no GPU: nothing was run"
  exit 1
fi
command -v python3 > /dev/null || { echo "gpu_proof: needs python3 for the summary"; exit 1; }
note "$gpus GPU(s): $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"

# 1. Build.
mkdir -p "$build"
echo "== building ($build, native CUDA architecture)"
if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSHARDLAB_TESTS=ON \
      -DCMAKE_CUDA_ARCHITECTURES=native > "$build/configure.log" 2>&1 ||
   ! grep -q "CUDA ON" "$build/configure.log"; then
  tail -5 "$build/configure.log"
  echo "gpu_proof: configure failed or found no CUDA ($build/configure.log)"
  exit 1
fi
if ! cmake --build "$build" -j"$(nproc)" > "$build/build.log" 2>&1; then
  grep -E "error" "$build/build.log" | head -10
  echo "gpu_proof: the build failed ($build/build.log)"
  exit 1
fi
bin=$build/bin

# 2. The GPU tests.
echo "== ctest -L gpu"
ctest --test-dir "$build" -L gpu --output-on-failure > "$build/gpu_tests.log" 2>&1
tests_rc=$?
passed=$(grep -cE "Test +#[0-9]+: .* Passed" "$build/gpu_tests.log")
skipped=$(grep -cE "\*\*\*Skipped|Skipped " "$build/gpu_tests.log")
if grep -q "skipped: no CUDA device" "$build/gpu_tests.log"; then
  bad "a GPU test skipped for want of a CUDA device on a machine with $gpus GPU(s)"
fi
if ((tests_rc != 0)); then
  bad "ctest -L gpu: $(grep -E 'tests passed|tests failed' "$build/gpu_tests.log")"
else
  note "ctest -L gpu: $passed passed, $skipped skipped (need more GPUs than $gpus)"
fi

# 3. Every chapter's default run on the GPU.
for program in "$bin"/ch0*; do
  name=$(basename "$program")
  if timeout 300 "$program" --device cuda --quiet > "$build/$name.log" 2>&1; then
    note "$name --device cuda: ok"
  else
    bad "$name --device cuda (see $build/$name.log)"
  fi
done

# 4. compute-sanitizer on the kernels (the elementwise, cast, gather and reduction cases).
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null)
if [[ -n "$sanitizer" ]]; then
  for tool in memcheck racecheck; do
    if timeout 300 "$sanitizer" --tool "$tool" --error-exitcode 9 "$bin/test_cuda" \
         "--test-case=*elementwise*,*casts*,*gather*,*layers*" > "$build/$tool.log" 2>&1; then
      note "compute-sanitizer $tool: no errors"
    else
      bad "compute-sanitizer $tool (see $build/$tool.log)"
    fi
  done
else
  note "compute-sanitizer: not installed, not run"
fi

# 5. The numbers.
"$bin/ch01_matmul_split" --device cuda --benchmark --json --quiet > "$build/sgemm.json" 2>&1 ||
  bad "ch01 --benchmark --device cuda (see $build/sgemm.json)"
"$bin/ch03_ring_allreduce" --device cuda --ranks 2 -b 1M -e 64M --json --quiet \
  > "$build/allreduce.json" 2>&1 || bad "ch03 --device cuda (see $build/allreduce.json)"
if ((gpus >= 2)); then
  "$bin/ch03_ring_allreduce" --backend nccl --ranks "$gpus" -b 1M -e 256M --json --quiet \
    > "$build/allreduce_nccl.json" 2>&1 || bad "ch03 --backend nccl (see $build/allreduce_nccl.json)"
fi
"$bin/ch02_gradient_allreduce" --device cuda --ranks 2 --json --quiet > "$build/ch02_gpu.json" 2>&1 ||
  bad "ch02 --device cuda (see $build/ch02_gpu.json)"
"$bin/ch02_gradient_allreduce" --ranks 2 --json --quiet > "$build/ch02_cpu.json" 2>&1 ||
  bad "ch02 on the CPU (see $build/ch02_cpu.json)"
while IFS= read -r line; do
  [[ "$line" == FAILED:* ]] && bad "${line#FAILED: }" || note "$line"
done < <(python3 scripts/gpu_summary.py "$build")
finish
