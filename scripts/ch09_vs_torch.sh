#!/usr/bin/env bash
# Chapter 09 next to PyTorch on this CPU, in one sitting: torch_baseline.py and ch09_gpt take
# turns, ROUNDS times each (default 3), on one thread (one device), then on two threads
# (PyTorch) against the default 8-rank mesh and against dp 2 (a rank a core); every line is
# one run's tokens/s.
#
#   scripts/ch09_vs_torch.sh [PYTHON_WITH_TORCH] [ROUNDS]
#
# PYTHON_WITH_TORCH defaults to .venv-torch/bin/python (the project does not install torch:
# python3 -m venv .venv-torch && .venv-torch/bin/pip install torch transformers). PyTorch's
# figure leaves its first step out; ch09_gpt's counts every step, the first included.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv-torch/bin/python}
rounds=${2:-3}
bin=build/default/bin/ch09_gpt
[[ -x "$python" ]] || { echo "ch09_vs_torch: error: no $python (see the header)" >&2; exit 2; }
[[ -x "$bin" ]] || { echo "ch09_vs_torch: error: no $bin (build first)" >&2; exit 2; }
rate() { "$@" --json --quiet | python3 -c "import json,sys; print(round(json.load(sys.stdin)['tokens_per_second']))"; }
torch_rate() { "$python" chapters/09_gpt/torch_baseline.py --steps 30 "$@" | sed -n 's/^\([0-9.]*\) tokens\/s.*/\1/p'; }
for ((i = 1; i <= rounds; i++)); do
  echo "1 thread   pytorch $(torch_rate --threads 1)   ch09 one device $(rate $bin --ranks 1 --tp 1 --pp 1 --no-reference --steps 30)"
done
for ((i = 1; i <= rounds; i++)); do
  echo "2 threads  pytorch $(torch_rate --threads 2)   ch09 8-rank mesh $(rate $bin --no-reference --steps 30)"
done
for ((i = 1; i <= rounds; i++)); do
  echo "2 threads  pytorch $(torch_rate --threads 2)   ch09 dp 2 $(rate $bin --ranks 2 --dp 2 --tp 1 --pp 1 --no-reference --steps 30)"
done
