#include "planner.hpp"

#include <algorithm>
#include <climits>
#include <cmath>

#include "calculator.hpp"  // ch05::zero_memory, ch05::zero_comm_elements
#include "shardlab/check.hpp"

namespace ch08 {

using shardlab::require_usage;

namespace {

// Table 1's models all have s = 2048 and V = 51200 (Narayanan §5.1); its 1T row is `1t`.
ModelSpec table_1_row(std::string name, int heads, int hidden, int layers, int tp, int pp, int gpus,
                      std::int64_t batch, double tflops) {
  return {.name = std::move(name),
          .layers = layers,
          .hidden = hidden,
          .heads = heads,
          .source = "Narayanan et al. 2021, Table 1",
          .run = {.gpus = gpus,
                  .tp = tp,
                  .pp = pp,
                  .batch = batch,
                  .achieved_tflops = tflops,
                  .tokens = 300e9}};
}

std::string str(std::int64_t n) { return std::to_string(n); }

}  // namespace

// ---------------------------------------------------------------------------
// The model and the cluster

const std::vector<ModelSpec>& model_presets() {
  static const std::vector<ModelSpec> all = [] {
    std::vector<ModelSpec> v;
    // GPT-3's shape (Brown et al. 2020, Table 2.1) with Narayanan's vocabulary; the run is
    // Narayanan §5.1's estimate (1024 A100s at 140 TFLOP/s, B = 1536, 300B tokens: 34 days),
    // laid out as CS336 lecture 7 §5.1's example: dp 8 x tp 8 (a DGX node) x pp 16. No
    // layout of GPT-3's own training was published.
    v.push_back({.name = "gpt3-175b",
                 .layers = 96,
                 .hidden = 12288,
                 .heads = 96,
                 .source = "GPT-3 175B (Brown et al. 2020, Table 2.1), V as Narayanan et al.",
                 .run = {.gpus = 1024,
                         .tp = 8,
                         .pp = 16,
                         .batch = 1536,
                         .achieved_tflops = 140,
                         .tokens = 300e9}});
    // Narayanan et al. 2021, Table 1: heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s.
    v.push_back(table_1_row("1.7b", 24, 2304, 24, 1, 1, 32, 512, 137));
    v.push_back(table_1_row("3.6b", 32, 3072, 30, 2, 1, 64, 512, 138));
    v.push_back(table_1_row("7.5b", 32, 4096, 36, 4, 1, 128, 512, 142));
    v.push_back(table_1_row("18.4b", 48, 6144, 40, 8, 1, 256, 1024, 135));
    v.push_back(table_1_row("39.1b", 64, 8192, 48, 8, 2, 512, 1536, 138));
    v.push_back(table_1_row("76.1b", 80, 10240, 60, 8, 4, 1024, 1792, 140));
    v.push_back(table_1_row("145.6b", 96, 12288, 80, 8, 8, 1536, 2304, 148));
    v.push_back(table_1_row("310.1b", 128, 16384, 96, 8, 16, 1920, 2160, 155));
    v.push_back(table_1_row("529.6b", 128, 20480, 105, 8, 35, 2520, 2520, 163));
    // NVIDIA's 1T model: the 64 x 6 x 8 = 3072 layout so-large-lm §6 calls GPT-3's. §5.1's
    // estimate: 450B tokens on 3072 GPUs at 163 TFLOP/s, 84 days.
    v.push_back(table_1_row("1t", 160, 25600, 128, 8, 64, 3072, 3072, 163));
    v.back().source = "NVIDIA's 1T model: Narayanan et al. 2021, Table 1's last row (1008.0B)";
    v.back().run.tokens = 450e9;
    // Korthikanti et al. 2022, Table 3's smallest (8 GPUs, tp 8, B = 4, b = 4: one
    // microbatch of 4 sequences).
    v.push_back(
        {.name = "22b",
         .layers = 48,
         .hidden = 6144,
         .heads = 64,
         .source = "Korthikanti et al. 2022, Table 3",
         .run = {.gpus = 8, .tp = 8, .pp = 1, .batch = 4, .microbatch_size = 4, .tokens = 300e9}});
    return v;
  }();
  return all;
}

const ModelSpec* find_model(const std::string& name) {
  for (const ModelSpec& m : model_presets())
    if (m.name == name) return &m;
  return nullptr;
}

const std::vector<ClusterSpec>& cluster_presets() {
  static const std::vector<ClusterSpec> all = {
      // A100 SXM 80GB datasheet: 312 TFLOP/s dense bf16, NVLink 3 at 600 GB/s a GPU (both
      // directions together); DGX A100: 8 GPUs, 8 ConnectX-6 HDR InfiniBand at 200 Gb/s,
      // one a GPU = 25 GB/s. Achieved: Narayanan §5.1's 140 TFLOP/s for GPT-3.
      {.name = "a100-80gb",
       .gpu_memory_bytes = 80e9,
       .peak_tflops = 312,
       .achieved_tflops = 140,
       .gpus_per_node = 8,
       .nvlink_GBps = 300,
       .network_GBps = 25,
       .source = "DGX A100: 312 TFLOP/s bf16, NVLink 300 GB/s a direction, 8 x 200 Gb/s HDR"},
      // H100 SXM datasheet: 989 TFLOP/s dense bf16, NVLink 4 at 900 GB/s (both directions);
      // DGX H100: 8 ConnectX-7 NDR at 400 Gb/s = 50 GB/s a GPU. Achieved: Llama 3's 400
      // TFLOP/s a GPU on 16K H100s (Dubey et al. 2024, Table 4; the so-large-lm seed: > 400).
      {.name = "h100-80gb",
       .gpu_memory_bytes = 80e9,
       .peak_tflops = 989,
       .achieved_tflops = 400,
       .gpus_per_node = 8,
       .nvlink_GBps = 450,
       .network_GBps = 50,
       .source = "DGX H100: 989 TFLOP/s bf16, NVLink 450 GB/s a direction, 8 x 400 Gb/s NDR"},
  };
  return all;
}

const ClusterSpec* find_cluster(const std::string& name) {
  for (const ClusterSpec& c : cluster_presets())
    if (c.name == name) return &c;
  return nullptr;
}

// ---------------------------------------------------------------------------
// Narayanan et al. 2021 §5.1

double parameters(const ModelSpec& m) {
  const double l = m.layers, h = m.hidden, V = m.vocab, s = m.seq;
  return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h));  // eq. 2
}

double flops_per_iteration(const ModelSpec& m, double B) {
  const double l = m.layers, h = m.hidden, V = m.vocab, s = m.seq;
  return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));  // eq. 3
}

double training_seconds(double params, double tokens, double gpus, double flops_per_gpu,
                        bool recomputation) {
  return (recomputation ? 8 : 6) * tokens * params / (gpus * flops_per_gpu);  // eq. 4
}

double training_days(double params, double tokens, double gpus, double flops_per_gpu,
                     bool recomputation) {
  return training_seconds(params, tokens, gpus, flops_per_gpu, recomputation) / 86400;
}

// ---------------------------------------------------------------------------
// A layout and its memory

std::string recompute_name(Recompute r) {
  return r == Recompute::none ? "none" : r == Recompute::selective ? "selective" : "full";
}

Recompute parse_recompute(const std::string& name) {
  if (name == "none") return Recompute::none;
  if (name == "selective") return Recompute::selective;
  if (name == "full") return Recompute::full;
  throw shardlab::UsageError("--recompute " + name + ": none, selective or full");
}

void check_model(const ModelSpec& m) {
  for (const auto& [what, value] : {std::pair{"layers", m.layers},
                                    {"hidden size", m.hidden},
                                    {"heads", m.heads},
                                    {"sequence length", m.seq},
                                    {"vocabulary", m.vocab}})
    require_usage(value >= 1, "the model's " + std::string(what) + " is " + str(value) +
                                  ": it must be at least 1");
  require_usage(m.hidden % m.heads == 0, "the hidden size " + str(m.hidden) +
                                             " does not split into " + str(m.heads) +
                                             " heads: h must be a multiple of a");
}

void check_layout(const ModelSpec& m, const Layout& L, std::int64_t gpus) {
  for (const auto& [what, value] : {std::pair{"dp", L.dp},
                                    {"tp", L.tp},
                                    {"pp", L.pp},
                                    {"microbatches", L.microbatches},
                                    {"microbatch size", L.microbatch_size}})
    require_usage(value >= 1, std::string(what) + " is " + str(value) + ": it must be at least 1");
  require_usage(gpus >= 1 && gpus <= kMaxGpus,
                str(gpus) + " GPUs: a plan has 1 to " + str(kMaxGpus) + " (2^24)");
  require_usage(m.heads % L.tp == 0,
                "tp " + str(L.tp) + " does not divide the " + str(m.heads) + " heads");
  require_usage(m.hidden % L.tp == 0,
                "tp " + str(L.tp) + " does not divide the hidden size " + str(m.hidden));
  require_usage(m.layers % L.pp == 0,
                "pp " + str(L.pp) + " does not divide the " + str(m.layers) + " layers");
  require_usage(L.gpus() == gpus, "dp " + str(L.dp) + " x tp " + str(L.tp) + " x pp " + str(L.pp) +
                                      " = " + str(L.gpus()) + ", but there are " + str(gpus) +
                                      " GPUs");
  require_usage(L.zero >= 0 && L.zero <= 3,
                "ZeRO stage " + str(L.zero) + ": the stages are 0 to 3");
}

void check_cluster(const ClusterSpec& c) {
  for (const auto& [what, value] : {std::pair{"GPU memory", c.gpu_memory_bytes},
                                    {"peak TFLOP/s", c.peak_tflops},
                                    {"achieved TFLOP/s", c.achieved_tflops},
                                    {"NVLink GB/s", c.nvlink_GBps},
                                    {"network GB/s", c.network_GBps}})
    require_usage(std::isfinite(value) && value > 0,
                  "the cluster's " + std::string(what) + " must be a positive number");
  require_usage(c.gpus_per_node >= 1, "a node has at least 1 GPU");
}

double activation_bytes_per_layer(const ModelSpec& m, int b, int tp, bool sp, Recompute r) {
  const double s = m.seq, h = m.hidden, a = m.heads, t = tp;
  const double sbh = s * b * h, attention = 5 * a * s / h;  // Korthikanti eq. 1's two terms
  switch (r) {
    case Recompute::full:
      return sp ? 2 * sbh / t : 2 * sbh;
    case Recompute::selective:
      return sp ? sbh * 34 / t : sbh * (10 + 24 / t);
    case Recompute::none:
      break;
  }
  return sp ? sbh * (34 / t + attention / t) : sbh * (10 + 24 / t + attention / t);
}

double stage_parameters(const ModelSpec& m, int tp, int pp) {
  const double h = m.hidden, layer = 12 * h * h + 13 * h;
  return double(m.layers / pp) * layer / tp + double(m.vocab) * h / tp + double(m.seq) * h;
}

MemoryEstimate memory_per_gpu(const ModelSpec& m, const Layout& L, ch05::Precision precision) {
  const ch05::StageMemory states =
      ch05::zero_memory(stage_parameters(m, L.tp, L.pp), L.dp, L.zero, precision);
  MemoryEstimate e;
  e.params = states.params;
  e.grads = states.grads;
  e.optimizer = states.optimizer;
  const double in_flight = std::min(L.pp, L.microbatches);  // 1F1B's first stage
  e.activations =
      activation_bytes_per_layer(m, L.microbatch_size, L.tp, L.sequence_parallel, L.recompute) *
      double(m.layers / L.pp) * in_flight;
  return e;
}

// ---------------------------------------------------------------------------
// Communication and time

double ring_allreduce_bytes(double bytes, double n) {
  return n <= 1 ? 0.0 : 2 * (n - 1) / n * bytes;
}

NodeCrossings crosses_nodes(const Layout& L, int g) {
  // A tp group is t consecutive ranks starting at a multiple of t, a dp group's ranks lie
  // in a block of d t consecutive ones, a pp group spans every rank; all of them stay in
  // nodes of g exactly when the first node boundary (g) is a boundary of theirs too.
  const std::int64_t n = L.gpus(), block = std::int64_t{L.dp} * L.tp;
  const bool one_node = n <= g;
  NodeCrossings c;
  c.tp = L.tp > 1 && !one_node && g % L.tp != 0;
  c.dp = L.dp > 1 && !one_node && g % block != 0;
  c.pp = L.pp > 1 && !one_node;
  return c;
}

double step_flops(const ModelSpec& m, double B, Recompute r) {
  if (r == Recompute::full) return flops_per_iteration(m, B);
  // Without the second forward: 72 for 96 on the layers; the output layer 6 B s h V either
  // way. Selective recomputes the attention's QK^T and softmax x V: 4 B s^2 h a layer.
  const double l = m.layers, h = m.hidden, V = m.vocab, s = m.seq;
  const double layers = 72 * B * s * l * h * h * (1 + s / (6 * h)), output = 6 * B * s * h * V;
  return layers + output + (r == Recompute::selective ? 4 * B * s * s * h * l : 0.0);
}

int tp_allreduces_per_layer(const Layout& L) {
  // Sequence parallelism's backward all-gathers the input of QKV's and fc1's
  // column-parallel products again (Megatron-LM keeps the rank's n/t rows): two
  // all-gathers, one allreduce's worth.
  return (L.recompute == Recompute::full ? 6 : 4) + (L.sequence_parallel ? 1 : 0);
}

StepEstimate step_time(const ModelSpec& m, const ClusterSpec& c, const Layout& L) {
  StepEstimate e;
  const double n = double(L.gpus()), X = c.achieved_tflops * 1e12;
  e.flops = step_flops(m, double(L.batch()), L.recompute);
  e.compute_s = e.flops / (n * X);
  e.bubble_fraction = double(L.pp - 1) / L.microbatches;
  e.bubble_s = e.bubble_fraction * e.compute_s;

  const double bsh_bytes = 2.0 * m.seq * L.microbatch_size * m.hidden;  // fp16 on the wire
  const double m_ = L.microbatches, layers = m.layers / L.pp;
  const NodeCrossings crossing = crosses_nodes(L, c.gpus_per_node);
  auto cost = [&](int size, double bytes, bool crosses) {
    AxisCost a{.size = size, .bytes = size > 1 ? bytes : 0.0, .crosses_nodes = crosses};
    a.link_GBps = crosses ? c.network_GBps : c.nvlink_GBps;
    a.seconds = a.bytes / (a.link_GBps * 1e9);
    return a;
  };
  const int allreduces = tp_allreduces_per_layer(L);
  e.tp = cost(L.tp, layers * m_ * allreduces * ring_allreduce_bytes(bsh_bytes, L.tp), crossing.tp);
  e.dp = cost(L.dp, 2.0 * ch05::zero_comm_elements(stage_parameters(m, L.tp, L.pp), L.dp, L.zero),
              crossing.dp);
  const int directions = L.pp == 2 ? 1 : 2;  // an inner stage sends both ways
  e.pp = cost(L.pp, m_ * directions * bsh_bytes / (L.sequence_parallel ? L.tp : 1), crossing.pp);
  return e;
}

// ---------------------------------------------------------------------------
// The search

std::vector<Candidate> search(const ModelSpec& m, const ClusterSpec& c, const SearchSpec& spec) {
  check_model(m);
  check_cluster(c);
  require_usage(spec.gpus >= 1 && spec.gpus <= kMaxGpus,
                str(spec.gpus) + " GPUs: a plan has 1 to " + str(kMaxGpus) + " (2^24)");
  require_usage(spec.batch >= 1 && spec.batch <= INT_MAX,
                "a batch of " + str(spec.batch) + " sequences: 1 to 2^31 - 1");
  require_usage(spec.microbatch_size >= 1, "the microbatch size must be at least 1");
  require_usage(spec.zero >= 0 && spec.zero <= 3,
                "ZeRO stage " + str(spec.zero) + ": the stages are 0 to 3");
  std::vector<Candidate> found;
  for (std::int64_t tp = 1; tp <= std::min<std::int64_t>(spec.gpus, m.heads); ++tp) {
    if (spec.gpus % tp || m.heads % tp || m.hidden % tp) continue;
    for (std::int64_t pp = 1; pp <= std::min<std::int64_t>(spec.gpus / tp, m.layers); ++pp) {
      if ((spec.gpus / tp) % pp || m.layers % pp) continue;
      const std::int64_t dp = spec.gpus / tp / pp, per_step = dp * spec.microbatch_size;
      if (spec.batch % per_step) continue;  // B = d m b
      Candidate k;
      k.layout = {.dp = int(dp),
                  .tp = int(tp),
                  .pp = int(pp),
                  .microbatches = int(spec.batch / per_step),
                  .microbatch_size = spec.microbatch_size,
                  .zero = spec.zero,
                  .recompute = spec.recompute,
                  .sequence_parallel = spec.sequence_parallel};
      k.step = step_time(m, c, k.layout);
      k.memory = memory_per_gpu(m, k.layout);
      k.fits = k.memory.total() <= c.gpu_memory_bytes;
      k.crossings = crosses_nodes(k.layout, c.gpus_per_node);
      found.push_back(k);
    }
  }
  std::stable_sort(found.begin(), found.end(), [](const Candidate& x, const Candidate& y) {
    return x.step.total_s() < y.step.total_s();
  });
  return found;
}

}  // namespace ch08
