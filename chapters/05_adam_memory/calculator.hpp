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

#include "shardlab/results.hpp"
#include "training.hpp"

namespace ch05 {

/// Bytes per device of one stage's model states, by kind.
struct StageMemory {
  int stage = 0;         ///< the ZeRO stage, 0-3
  double params = 0;     ///< the weights: 2 Psi (fp32: 4 Psi), / Nd at stage 3
  double grads = 0;      ///< the gradients: 2 Psi (fp32: 4 Psi), / Nd from stage 2
  double optimizer = 0;  ///< optimizer states: K Psi / (Nd or 1), master included
  /// All three together: the bytes per device of the model states.
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

/// What stage `stage` shards: "plain data parallel", "+ optimizer states sharded", ...
const char* stage_name(int stage);
/// Bytes as GB (1e9), 3 significant digits (4 from 100 GB), halves rounded up as the
/// paper's table rounds them: "120 GB", "41.3 GB", "0.234 GB".
std::string gb(double bytes);

/// The calculator's rows: each stage's bytes per device for Psi parameters on each of
/// `dps` devices of `device_gb` GB, as text ("31.4 GB"), and bytes_per_device exactly.
shardlab::Table zero_table(double psi, const std::vector<double>& dps, Precision precision,
                           double device_gb);

/// The paper's 7.5B model at Nd = 1, 4, ..., 1024, every stage (Table 1, as bars for the
/// notebook: 05_adam_memory_paper.csv).
shardlab::Table paper_table();

/// A model the reader knows, by name.
struct Preset {
  std::string name;    ///< what --preset calls it: "gpt2-1.5b", "llama-7b", ...
  double params;       ///< Psi: its parameters
  std::string source;  ///< where the parameter count comes from (paper, table)
};
/// Every model --preset can name.
const std::vector<Preset>& presets();
/// The presets' names, in presets() order.
std::vector<std::string> preset_names();
/// The preset called `name`, or nullptr.
const Preset* find_preset(const std::string& name);

}  // namespace ch05
