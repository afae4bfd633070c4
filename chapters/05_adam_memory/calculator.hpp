// Chapter 05's calculator: the memory of a model's states per device under ZeRO, from the
// paper's formulas (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
// Trillion Parameter Models", SC 2020, §3.1 and §5, Figure 1 and Table 1).
//
// Psi = parameters, Nd = data-parallel degree, K = the optimizer's bytes per parameter:
// 12 for mixed-precision Adam (fp32 master weights, m, v), 8 for fp32 Adam (m and v; the
// weights themselves are the fp32 copy). Weights and gradients take 2 bytes each in mixed
// precision, 4 in fp32. GB = 1e9 bytes, as the paper writes it.
#pragma once

#include <string>
#include <vector>

#include "training.hpp"

namespace ch05 {

/// Bytes per device of one stage's model states, by kind.
struct StageMemory {
  int stage = 0;
  double params = 0, grads = 0, optimizer = 0;  // optimizer: K Psi / (Nd or 1), master included
  double total() const { return params + grads + optimizer; }
};

/// Stage 0 (plain data parallel): (2 + 2 + K) Psi. Stage 1 (optimizer states partitioned):
/// 2 Psi + 2 Psi + K Psi / Nd. Stage 2 (and gradients): 2 Psi + (2 + K) Psi / Nd. Stage 3
/// (and parameters): (2 + 2 + K) Psi / Nd. (fp32: 4, 4 and K = 8.)
StageMemory zero_memory(double psi, double nd, int stage, Precision precision);

/// Elements each rank sends and receives per step (§7): 2 Psi for stages 0-2 (a
/// reduce-scatter and an all-gather of Psi, (Nd - 1) / Nd Psi each), 3 Psi for stage 3 (the
/// parameters are gathered twice: forward and backward).
double zero_comm_elements(double psi, double nd, int stage);

/// A model the reader knows, by name.
struct Preset {
  std::string name;
  double params;
  std::string source;
};
const std::vector<Preset>& presets();
/// The preset called `name`, or nullptr.
const Preset* find_preset(const std::string& name);

}  // namespace ch05
