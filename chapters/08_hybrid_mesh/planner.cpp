// Chapter 08's planner: a model's training on a cluster on paper (planner.hpp).
#include "planner.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <tuple>

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
          .run = {.mesh = {.pp = pp, .dp = gpus / (tp * pp), .tp = tp},
                  .batch = batch,
                  .achieved_tflops = tflops,
                  .tokens = 300e9}};
}

std::string str(std::int64_t n) { return std::to_string(n); }

}  // namespace

// ---------------------------------------------------------------------------
// The model and the cluster

namespace {

// GPT-3's shape (Brown et al. 2020, Table 2.1) with Narayanan's vocabulary; the run is
// Narayanan §5.1's estimate (1024 A100s at 140 TFLOP/s, B = 1536, 300B tokens: 34 days), laid
// out as CS336 lecture 7 §5.1's example: dp 8 x tp 8 (a DGX node) x pp 16. No layout of
// GPT-3's own training was published.
ModelSpec gpt3_preset() {
  return {.name = "gpt3-175b",
          .layers = 96,
          .hidden = 12288,
          .heads = 96,
          .source = "GPT-3 175B (Brown et al. 2020, Table 2.1), V as Narayanan et al.",
          .run = {.mesh = {.pp = 16, .dp = 8, .tp = 8},
                  .batch = 1536,
                  .achieved_tflops = 140,
                  .tokens = 300e9}};
}

// Narayanan et al. 2021, Table 1, every row, and Korthikanti et al. 2022's 22B.
void add_table_presets(std::vector<ModelSpec>& v) {
  // heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s
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
  // Korthikanti et al. 2022, Table 3's smallest (8 GPUs, tp 8, B = 4, b = 4: one microbatch
  // of 4 sequences).
  v.push_back({.name = "22b",
               .layers = 48,
               .hidden = 6144,
               .heads = 64,
               .source = "Korthikanti et al. 2022, Table 3",
               .run = {.mesh = {.pp = 1, .dp = 1, .tp = 8},
                       .batch = 4,
                       .microbatch_size = 4,
                       .tokens = 300e9}});
}

// DeepSpeed-MoE's GPT-3-style MoE models (Rajbhandari et al. 2022 give them as 13B
// and 52B; their text: 128 experts on every other feed-forward layer, 12 MoE layers, top-1,
// 300B tokens on 128 A100s); the base models' 24 layers, 1024 or 2048 wide, 16 heads, and the
// batch and sequence of Megatron-DeepSpeed's examples_deepspeed/MoE scripts
// (ds_pretrain_gpt_350M_MoE128.sh, ds_pretrain_gpt_1.3B_MoE128.sh: 2048 tokens, B 256 and
// 512); V GPT-2's 50257 padded to a multiple of 128. Laid out as Table 6 lays 1.3B+MoE-128
// out: EP degree 128, MP 1, every expert on a GPU of its own.
void add_moe_presets(std::vector<ModelSpec>& v) {
  for (auto [name, hidden, batch, printed] :
       {std::tuple{"350m-moe128", 1024, 256, "13B"}, std::tuple{"1.3b-moe128", 2048, 512, "52B"}})
    v.push_back({.name = name,
                 .layers = 24,
                 .hidden = hidden,
                 .heads = 16,
                 .vocab = 50304,
                 .source = std::string("DeepSpeed-MoE (Rajbhandari et al. 2022): ") + printed +
                           ", 128 experts in every other layer, top-1",
                 .run = {.mesh = {.dp = 1, .ep = 128}, .batch = batch, .tokens = 300e9},
                 .experts = 128,
                 .top_k = 1,
                 .moe_every = 2});
}

}  // namespace

const std::vector<ModelSpec>& model_presets() {
  static const std::vector<ModelSpec> all = [] {
    std::vector<ModelSpec> v{gpt3_preset()};
    add_table_presets(v);
    add_moe_presets(v);
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
      // one a GPU = 25 GB/s, 200 GB/s a node. Achieved: Narayanan §5.1's 140 TFLOP/s for GPT-3.
      {.name = "a100-80gb",
       .gpu_memory_bytes = 80e9,
       .peak_tflops = 312,
       .achieved_tflops = 140,
       .gpus_per_node = 8,
       .nvlink_GBps = 300,
       .network_GBps = 25,
       .nics_per_node = 8,
       .source = "DGX A100: 312 TFLOP/s bf16, NVLink 300 GB/s a direction, 8 x 200 Gb/s HDR"},
      // H100 SXM datasheet: 989 TFLOP/s dense bf16, NVLink 4 at 900 GB/s (both directions);
      // DGX H100: 8 ConnectX-7 NDR at 400 Gb/s = 50 GB/s a GPU, 400 GB/s a node. Achieved:
      // Llama 3's 400 TFLOP/s a GPU on 16K H100s (Dubey et al. 2024, Table 4; the so-large-lm
      // seed: > 400).
      {.name = "h100-80gb",
       .gpu_memory_bytes = 80e9,
       .peak_tflops = 989,
       .achieved_tflops = 400,
       .gpus_per_node = 8,
       .nvlink_GBps = 450,
       .network_GBps = 50,
       .nics_per_node = 8,
       .source = "DGX H100: 989 TFLOP/s bf16, NVLink 450 GB/s a direction, 8 x 400 Gb/s NDR"},
  };
  return all;
}

const ClusterSpec* find_cluster(const std::string& name) {
  for (const ClusterSpec& c : cluster_presets())
    if (c.name == name) return &c;
  return nullptr;
}

int ModelSpec::moe_layers(int first, int count) const {
  if (experts == 0) return 0;
  int n = 0;
  for (int i = first; i < first + count; ++i) n += i % moe_every == 0;
  return n;
}

// ---------------------------------------------------------------------------
// Narayanan et al. 2021 §5.1

namespace {
/// A MoE layer's MLP's parameters, 8 h^2 + 5 h (c_fc and c_proj, with their biases).
double mlp_parameters(double h) { return 8 * h * h + 5 * h; }
}  // namespace

double parameters(const ModelSpec& m) {
  const double l = m.layers, h = m.hidden, V = m.vocab, s = m.seq;
  const double dense = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h));  // eq. 2
  return dense + m.moe_layers(0, m.layers) * ((m.experts - 1) * mlp_parameters(h) + h * m.experts);
}

double active_parameters(const ModelSpec& m) {
  if (m.experts == 0) return parameters(m);
  ModelSpec k = m;
  k.experts = m.top_k;  // the same model with k experts a MoE layer: their router aside
  return parameters(k) + m.moe_layers(0, m.layers) * double(m.hidden) * (m.experts - m.top_k);
}

double flops_per_iteration(const ModelSpec& m, double B) {
  const double l = m.layers, h = m.hidden, V = m.vocab, s = m.seq;
  const double dense = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));  // eq. 3
  // A MoE layer's k MLPs a token: the MLP's 16 B s h^2 forward, times 4 (eq. 3's count).
  return dense + m.moe_layers(0, m.layers) * (m.top_k - 1) * 64 * B * s * h * h;
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
  require_usage(m.experts >= 0 && m.moe_every >= 1, "the experts and --moe-every must be positive");
  require_usage(m.experts == 0 || (m.top_k >= 1 && m.top_k <= m.experts),
                "--top-k " + str(m.top_k) + ": a token goes to 1 to the " + str(m.experts) +
                    " experts there are");
}

void check_layout(const ModelSpec& m, const Layout& L, std::int64_t gpus) {
  for (const auto& [what, value] :
       {std::pair{"microbatches", L.microbatches}, {"microbatch size", L.microbatch_size}})
    require_usage(value >= 1, std::string(what) + " is " + str(value) + ": it must be at least 1");
  require_usage(gpus >= 1 && gpus <= kMaxGpus,
                str(gpus) + " GPUs: a plan has 1 to " + str(kMaxGpus) + " (2^24)");
  check_mesh_size(L.mesh, double(kMaxGpus));
  require_usage(m.heads % L.mesh.tp == 0,
                "tp " + str(L.mesh.tp) + " does not divide the " + str(m.heads) + " heads");
  require_usage(m.hidden % L.mesh.tp == 0,
                "tp " + str(L.mesh.tp) + " does not divide the hidden size " + str(m.hidden));
  require_usage(m.layers % L.mesh.pp == 0,
                "pp " + str(L.mesh.pp) + " does not divide the " + str(m.layers) + " layers");
  require_usage(m.seq % L.mesh.cp == 0,
                "cp " + str(L.mesh.cp) + " does not divide the sequence of " + str(m.seq));
  require_usage(L.mesh.ep == 1 || (m.experts > 0 && m.experts % L.mesh.ep == 0),
                "ep " + str(L.mesh.ep) +
                    (m.experts > 0 ? " does not divide the " + str(m.experts) + " experts"
                                   : " splits experts: a dense model has none"));
  require_usage(L.gpus() == gpus,
                mesh_name(L.mesh) + " = " + str(L.gpus()) + " GPUs, but there are " + str(gpus));
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
  require_usage(c.nics_per_node >= 1, "a node has at least 1 network card");
}

double activation_bytes_per_layer(const ModelSpec& m, int b, int tp, bool sp, Recompute r, int cp) {
  const double s = m.seq, h = m.hidden, a = m.heads, t = tp;
  // Korthikanti eq. 1's two terms; under cp a GPU's tokens are s/c of each sequence's.
  const double sbh = s * b * h / cp, attention = 5 * a * s / h;
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

namespace {

/// One GPU's share of an MLP (8 h^2 + 5 h): fc1's weight and bias and fc2's weight split
/// over t, fc2's bias whole (added once, after the row-parallel sum).
double mlp_share(double h, double t) { return (8 * h * h + 4 * h) / t + h; }

/// One GPU's share of a layer's attention and its two norms (4 h^2 + 8 h): the QKV
/// weight and bias and the projection's weight over t; the projection's bias and the
/// norms' 4 h whole on every tp rank.
double attention_share(double h, double t) { return (4 * h * h + 3 * h) / t + 5 * h; }

}  // namespace

double stage_parameters(const ModelSpec& m, int tp, int pp) {
  const double h = m.hidden, t = tp;
  const int layers = m.layers / pp, moe = m.moe_layers(0, layers);
  // A MoE layer's dense part: the layer less its MLP, and the router (whole).
  // With one stage, the first is the last: the final norm's 2 h, whole, too.
  return double(layers - moe) * (attention_share(h, t) + mlp_share(h, t)) +
         moe * (attention_share(h, t) + h * m.experts) + double(m.vocab) * h / t +
         double(m.seq) * h + (pp == 1 ? 2 * h : 0.0);
}

double expert_parameters(const ModelSpec& m, int tp, int pp, int ep) {
  return double(m.moe_layers(0, m.layers / pp)) * (m.experts / ep) * mlp_share(m.hidden, tp);
}

MemoryEstimate memory_per_gpu(const ModelSpec& m, const Layout& L, ch05::Precision precision) {
  // The dense weights over their replicas (d e c), the experts over theirs (d c).
  const ch05::StageMemory states =
      ch05::zero_memory(stage_parameters(m, L.mesh.tp, L.mesh.pp),
                        int(product(L.mesh, kReplicaAxes)), L.zero, precision);
  const ch05::StageMemory experts =
      ch05::zero_memory(expert_parameters(m, L.mesh.tp, L.mesh.pp, L.mesh.ep),
                        int(product(L.mesh, kExpertReplicaAxes)), L.zero, precision);
  MemoryEstimate e;
  e.params = states.params + experts.params;
  e.grads = states.grads + experts.grads;
  e.optimizer = states.optimizer + experts.optimizer;
  const double in_flight = std::min(L.mesh.pp, L.microbatches);  // 1F1B's first stage
  const int layers = m.layers / L.mesh.pp;
  // A MoE layer keeps its experts' products for each of a token's k choices: k - 1 more
  // MLPs' 16 s b h / t (its fc1's output, GELU's; not recomputed under full recompute).
  const double moe =
      L.recompute == Recompute::full
          ? 0.0
          : (m.top_k - 1) * 16.0 * m.seq * L.microbatch_size * m.hidden / L.mesh.cp / L.mesh.tp;
  e.activations = (activation_bytes_per_layer(m, L.microbatch_size, L.mesh.tp, L.sequence_parallel,
                                              L.recompute, L.mesh.cp) *
                       layers +
                   moe * m.moe_layers(0, layers)) *
                  in_flight;
  return e;
}

// ---------------------------------------------------------------------------
// Communication and time

double ring_allreduce_bytes(double bytes, double n) {
  return n <= 1 ? 0.0 : 2 * (n - 1) / n * bytes;
}

NodeCrossings crosses_nodes(const Layout& L, int g) {
  // A tp group is t consecutive ranks starting at a multiple of t, a cp group's ranks lie in
  // a block of c t consecutive ones, an ep group's in e c t, a dp group's in d e c t, and a
  // pp group spans every rank; all of them stay in nodes of g exactly when the first node
  // boundary (g) is a boundary of their blocks too.
  const std::int64_t n = L.gpus();
  const bool one_node = n <= g;
  auto crosses = [&](int size, std::int64_t block) {
    return size > 1 && !one_node && g % block != 0;
  };
  NodeCrossings c;
  std::int64_t block = 1;  // the ranks of the axes faster than this one, times its own
  for (auto axis = std::rbegin(kAxes); axis != std::rend(kAxes); ++axis) {
    block *= L.mesh.size(*axis);
    c[*axis] = crosses(L.mesh.size(*axis), block);
  }
  // dp's groups are the replicas, d e c of them in a block of d e c t ranks.
  c[Axis::dp] = crosses(int(product(L.mesh, kReplicaAxes)), block / L.mesh.pp);
  return c;
}

namespace {

/// An axis's groups as ranks `stride` apart, `size` of them (dp's: the replicas, d e c at
/// stride t).
struct Strided {
  std::int64_t stride = 1;
  std::int64_t size = 1;
};
Strided strided(const MeshShape& mesh, Axis axis) {
  if (axis == Axis::dp) return {mesh.tp, std::int64_t(product(mesh, kReplicaAxes))};
  const std::vector<Axis> faster(std::begin(kAxes) + index_of(axis) + 1, std::end(kAxes));
  return {std::int64_t(product(mesh, faster)), mesh.size(axis)};
}

/// cross_node_share, given whether the axis crosses nodes.
double share_across(const MeshShape& mesh, Axis axis, int g, bool crosses) {
  if (!crosses) return 0.0;
  const auto [st, s] = strided(mesh, axis);
  // pp sends point to point; a group with a node to each member, or one that does not tile
  // the nodes: all of it.
  if (axis == Axis::pp || st % g == 0 || g % st != 0 || (st * s) % g != 0) return 1.0;
  const double members = double(g / st);  // of a group, on each of its s st / g nodes
  return axis == Axis::ep ? (double(s) - members) / double(s - 1) : double(st) / g;
}

}  // namespace

double cross_node_share(const Layout& L, Axis axis, int g) {
  return share_across(L.mesh, axis, g, crosses_nodes(L, g)[axis]);
}

double step_flops(const ModelSpec& m, double B, Recompute r) {
  if (r == Recompute::full) return flops_per_iteration(m, B);
  // Without the second forward: 72 for 96 on the layers; the output layer 6 B s h V either
  // way. Selective recomputes the attention's QK^T and softmax x V: 4 B s^2 h a layer.
  const double l = m.layers, h = m.hidden, V = m.vocab, s = m.seq;
  const double layers = 72 * B * s * l * h * h * (1 + s / (6 * h)), output = 6 * B * s * h * V;
  const double moe = m.moe_layers(0, m.layers) * (m.top_k - 1) * 48 * B * s * h * h;
  return layers + output + moe + (r == Recompute::selective ? 4 * B * s * s * h * l : 0.0);
}

int tp_allreduces_per_layer(const Layout& L) {
  // Sequence parallelism's backward all-gathers the input of QKV's and fc1's
  // column-parallel products again (Megatron-LM keeps the rank's n/t rows): two
  // all-gathers, one allreduce's worth.
  return (L.recompute == Recompute::full ? 6 : 4) + (L.sequence_parallel ? 1 : 0);
}

double hidden_seconds(Axis axis, double seconds, double compute_s, double backward_s,
                      const Layout& L, int local_experts) {
  if (!L.overlap || seconds <= 0) return 0;
  switch (axis) {
    case Axis::dp: {
      const double all_but_one = 1 - 1.0 / std::max(1, L.buckets);
      if (L.zero == 0 || L.zero == 3) return std::min(seconds * all_but_one, backward_s);
      // The reduce-scatter under the backward (not under sequence parallelism, whose
      // norms' gradients are summed over tp after it), the all-gather under the forward
      // (2N and 4N FLOPs a token: half the backward's time).
      const bool after_tp = L.sequence_parallel && L.mesh.tp > 1;
      return (after_tp ? 0.0 : std::min(seconds / 2 * all_but_one, backward_s)) +
             std::min(seconds / 2 * all_but_one, backward_s / 2);
    }
    case Axis::tp:
      return std::min(seconds / 2, compute_s);
    case Axis::pp:
      return std::min(seconds * (1 - 1.0 / std::max(1, L.microbatches)), compute_s);
    case Axis::cp:
      return std::min(seconds, compute_s);
    case Axis::ep:
      return std::min(seconds * (1 - 1.0 / std::max(1, local_experts)), compute_s);
  }
  return 0;
}

StepEstimate step_time(const ModelSpec& m, const ClusterSpec& c, const Layout& L) {
  StepEstimate e;
  const double n = double(L.gpus()), X = c.achieved_tflops * 1e12;
  e.flops = step_flops(m, double(L.batch()), L.recompute);
  e.compute_s = e.flops / (n * X);
  // More ranks on a node than it has cores: they take turns.
  const double on_a_node = std::min<double>(n, c.gpus_per_node);
  if (c.cores_per_node > 0 && on_a_node > c.cores_per_node)
    e.compute_s *= on_a_node / c.cores_per_node;
  e.bubble_fraction = double(L.mesh.pp - 1) / L.microbatches;
  e.bubble_s = e.bubble_fraction * e.compute_s;

  // fp16 on the wire; a GPU's tokens, s/c of each sequence's
  const double bsh_bytes = 2.0 * m.seq / L.mesh.cp * L.microbatch_size * m.hidden;
  const double m_ = L.microbatches, layers = m.layers / L.mesh.pp;
  const double moe_layers = m.moe_layers(0, m.layers / L.mesh.pp);
  const NodeCrossings crossing = crosses_nodes(L, c.gpus_per_node);
  auto cost = [&](Axis axis, double bytes) {
    const int size = axis == Axis::dp ? int(product(L.mesh, kReplicaAxes)) : L.mesh.size(axis);
    AxisCost& a = e.axes[axis];
    a = {.size = size, .bytes = size > 1 ? bytes : 0.0, .crosses_nodes = crossing[axis]};
    a.cross_share = share_across(L.mesh, axis, c.gpus_per_node, a.crosses_nodes);
    // The crossing share on the GPU's part of the node's NICs, the rest on NVLink, together.
    a.seconds = std::max(a.cross_share * a.bytes / (c.network_GBps * 1e9),
                         (1 - a.cross_share) * a.bytes / (c.nvlink_GBps * 1e9));
    a.busbw_GBps = a.seconds > 0 ? a.bytes / a.seconds / 1e9 : 0.0;
    const bool ring = axis == Axis::tp || axis == Axis::cp || axis == Axis::dp;
    a.one_ring_s = ring && a.crosses_nodes ? a.bytes / (c.nic_GBps() * 1e9) : a.seconds;
  };
  // Half of a layer's allreduces are the MLP's: a MoE layer's k times (its experts' rows).
  const double allreduces =
      tp_allreduces_per_layer(L) / 2.0 * (2 * layers + moe_layers * (m.top_k - 1));
  cost(Axis::tp, m_ * allreduces * ring_allreduce_bytes(bsh_bytes, L.mesh.tp));
  const int replicas = int(product(L.mesh, kReplicaAxes));
  cost(
      Axis::dp,
      2.0 * (ch05::zero_comm_elements(stage_parameters(m, L.mesh.tp, L.mesh.pp), replicas, L.zero) +
             ch05::zero_comm_elements(expert_parameters(m, L.mesh.tp, L.mesh.pp, L.mesh.ep),
                                      int(product(L.mesh, kExpertReplicaAxes)), L.zero)));
  const int directions = L.mesh.pp == 2 ? 1 : 2;  // an inner stage sends both ways
  cost(Axis::pp, m_ * directions * bsh_bytes / (L.sequence_parallel ? L.mesh.tp : 1));
  // cp: the ring's blocks of keys or values, s/c b h/t; forward 2 (c - 1) (twice with
  // recomputation), backward 4 (c - 1) + 2.
  const double block = bsh_bytes / L.mesh.tp, c1 = L.mesh.cp - 1;
  const double forwards = L.recompute == Recompute::none ? 1 : 2;
  cost(Axis::cp, layers * m_ * block * (forwards * 2 * c1 + 4 * c1 + 2));
  // ep: a GPU's k b s/c choices, (e - 1)/e of them leaving, to the expert and back, forward
  // and backward (full recompute: the forward again).
  const double passes = L.recompute == Recompute::full ? 6 : 4;
  cost(Axis::ep, moe_layers * m_ * passes * m.top_k * bsh_bytes * (L.mesh.ep - 1) / L.mesh.ep);
  // The overlap's share of each axis, together never more than the computation.
  double room = e.compute_s;
  const double backward_s = e.compute_s * 2 / 3 / m_;  // the last microbatch's backward
  const int local_experts = m.experts > 0 ? std::max(1, m.experts / L.mesh.ep) : 1;
  for (Axis axis : kAxes) {
    AxisCost& a = e.axes[axis];
    a.hidden_s =
        std::min(room, hidden_seconds(axis, a.seconds, e.compute_s, backward_s, L, local_experts));
    room -= a.hidden_s;
  }
  return e;
}

// ---------------------------------------------------------------------------
// The search

namespace {

/// The divisors of n, ascending (trial division up to sqrt(n)).
std::vector<std::int64_t> divisors(std::int64_t n) {
  std::vector<std::int64_t> low, high;
  for (std::int64_t d = 1; d * d <= n; ++d)
    if (n % d == 0) {
      low.push_back(d);
      if (d != n / d) high.push_back(n / d);
    }
  low.insert(low.end(), high.rbegin(), high.rend());
  return low;
}

/// The degrees of `n` GPUs the model allows: t dividing a and h, c cutting s into 2c
/// whole chunks (chapter 10's zigzag), e dividing E, p dividing l; d what is left.
template <class Visit>
void each_mesh(const ModelSpec& m, std::int64_t n, Visit visit) {
  for (std::int64_t tp : divisors(n)) {
    if (m.heads % tp || m.hidden % tp) continue;
    for (std::int64_t cp : divisors(n / tp)) {
      if (cp > 1 && m.seq % (2 * cp) != 0) continue;
      for (std::int64_t ep : divisors(n / tp / cp)) {
        if (ep > 1 && (m.experts == 0 || m.experts % ep)) continue;
        for (std::int64_t pp : divisors(n / tp / cp / ep)) {
          if (m.layers % pp) continue;
          visit(MeshShape{.pp = int(pp),
                          .dp = int(n / tp / cp / ep / pp),
                          .ep = int(ep),
                          .cp = int(cp),
                          .tp = int(tp)});
        }
      }
    }
  }
}

}  // namespace

std::vector<Candidate> search(const ModelSpec& m, const ClusterSpec& c, const SearchSpec& spec,
                              SearchCount* counted) {
  check_model(m);
  check_cluster(c);
  require_usage(spec.gpus >= 1 && spec.gpus <= kMaxGpus,
                str(spec.gpus) + " GPUs: a plan has 1 to " + str(kMaxGpus) + " (2^24)");
  require_usage(spec.batch >= 1 && spec.batch <= INT_MAX,
                "a batch of " + str(spec.batch) + " sequences: 1 to 2^31 - 1");
  require_usage(spec.microbatch_size >= 1, "the microbatch size must be at least 1");
  require_usage(spec.zero >= 0 && spec.zero <= 3,
                "ZeRO stage " + str(spec.zero) + ": the stages are 0 to 3");
  // The fastest `keep` so far, a heap with the slowest of them on top; equal times in the
  // order the search met them.
  struct Found {
    Candidate k;
    std::int64_t order;
  };
  auto faster = [](const Found& x, const Found& y) {
    return std::pair{x.k.step.total_s(), x.order} < std::pair{y.k.step.total_s(), y.order};
  };
  std::vector<Found> found;
  SearchCount count;
  std::int64_t fastest_order = 0;
  each_mesh(m, spec.gpus, [&](const MeshShape& mesh) {
    const std::int64_t per_step = std::int64_t{mesh.dp} * mesh.ep * spec.microbatch_size;
    if (spec.batch % per_step) return;  // B = d e m b
    Found f{.k = {}, .order = count.layouts++};
    Candidate& k = f.k;
    k.layout = {.mesh = mesh,
                .microbatches = int(spec.batch / per_step),
                .microbatch_size = spec.microbatch_size,
                .zero = spec.zero,
                .recompute = spec.recompute,
                .sequence_parallel = spec.sequence_parallel,
                .overlap = spec.overlap};
    k.step = step_time(m, c, k.layout);
    k.memory = memory_per_gpu(m, k.layout);
    k.fits = k.memory.total() <= c.gpu_memory_bytes;
    k.crossings = crosses_nodes(k.layout, c.gpus_per_node);
    count.fit += k.fits;
    if (k.fits && (!count.fastest || faster(f, {*count.fastest, fastest_order}))) {
      count.fastest = std::make_shared<const Candidate>(k);
      fastest_order = f.order;
    }
    if (spec.keep != 0 && found.size() == spec.keep) {
      if (!faster(f, found.front())) return;
      std::pop_heap(found.begin(), found.end(), faster);
      found.pop_back();
    }
    found.push_back(std::move(f));
    std::push_heap(found.begin(), found.end(), faster);
  });
  std::sort_heap(found.begin(), found.end(), faster);
  std::vector<Candidate> out;
  for (Found& f : found) out.push_back(std::move(f.k));
  if (counted) *counted = count;
  return out;
}

}  // namespace ch08
