#include "calculator.hpp"

#include "shardlab/format.hpp"

namespace ch05 {

StageMemory zero_memory(double psi, double nd, int stage, Precision precision) {
  const bool mixed = precision == Precision::mixed;
  const double w = mixed ? 2 : 4, K = mixed ? 12 : 8;
  StageMemory m;
  m.stage = stage;
  m.params = w * psi / (stage >= 3 ? nd : 1);
  m.grads = w * psi / (stage >= 2 ? nd : 1);
  m.optimizer = K * psi / (stage >= 1 ? nd : 1);
  return m;
}

double zero_comm_elements(double psi, double nd, int stage) {
  const double one = (nd - 1) / nd * psi;  // one reduce-scatter or all-gather
  return (stage == 3 ? 3 : 2) * one;
}

const char* stage_name(int stage) {
  static const char* names[] = {"plain data parallel", "+ optimizer states sharded",
                                "+ gradients sharded", "+ parameters sharded"};
  return names[stage];
}

std::string gb(double bytes) {
  const double g = bytes / 1e9 * (1 + 1e-12);  // halves round up, as the paper's table: 41.3
  return shardlab::format_number(g, g >= 100 ? 4 : 3) + " GB";
}

shardlab::Table zero_table(double psi, const std::vector<double>& dps, Precision precision,
                           double device_gb) {
  shardlab::Table t({"Nd", "stage", "sharded", "params", "grads", "optimizer", "per device", "fits",
                     "comm per step", "bytes_per_device"});
  const double w = precision == Precision::mixed ? 2 : 4;  // bytes of a value on the wire
  for (double nd : dps)
    for (int stage = 0; stage <= 3; ++stage) {
      const StageMemory m = zero_memory(psi, nd, stage, precision);
      t.add({nd, stage, stage_name(stage), gb(m.params), gb(m.grads), gb(m.optimizer),
             gb(m.total()), m.total() <= device_gb * 1e9 ? "yes" : "no",
             gb(w * zero_comm_elements(psi, nd, stage)) +
                 (stage == 3 ? " (3 Psi (Nd-1)/Nd)" : " (2 Psi (Nd-1)/Nd)"),
             m.total()});
    }
  return t;
}

shardlab::Table paper_table() {
  shardlab::Table paper(
      {"stage", "dp", "params_bytes", "grads_bytes", "optimizer_bytes", "total_bytes"});
  for (double nd : {1, 4, 16, 64, 256, 1024})
    for (int stage = 0; stage <= 3; ++stage) {
      const StageMemory m = zero_memory(7.5e9, nd, stage, Precision::mixed);
      paper.add({stage, nd, m.params, m.grads, m.optimizer, m.total()});
    }
  return paper;
}

const std::vector<Preset>& presets() {
  static const std::vector<Preset> all = {
      {"gpt2-1.5b", 1.5e9, "GPT-2 XL (Radford et al. 2019); ZeRO §3.1 takes it as 1.5B: 24 GB"},
      {"zero-7.5b", 7.5e9, "ZeRO's Figure 1 and Table 1 example"},
      {"llama-7b", 6.7e9, "LLaMA (Touvron et al. 2023), Table 2"},
      {"llama-13b", 13.0e9, "LLaMA, Table 2"},
      {"llama-33b", 32.5e9, "LLaMA, Table 2"},
      {"llama-65b", 65.2e9, "LLaMA, Table 2"},
      {"llama2-70b", 70e9, "Llama 2 (Touvron et al. 2023), Table 1"},
      {"zero-128b", 128e9, "ZeRO's Table 1"},
      {"gpt3-175b", 175e9, "GPT-3 (Brown et al. 2020), Table 2.1"},
      {"zero-1t", 1e12, "ZeRO's Table 1"},
  };
  return all;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const Preset& p : presets()) names.push_back(p.name);
  return names;
}

const Preset* find_preset(const std::string& name) {
  for (const Preset& p : presets())
    if (p.name == name) return &p;
  return nullptr;
}

}  // namespace ch05
