#include "calculator.hpp"

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

const Preset* find_preset(const std::string& name) {
  for (const Preset& p : presets())
    if (p.name == name) return &p;
  return nullptr;
}

}  // namespace ch05
