// Chapter 09's machine profile and its predictions: see calibrate.hpp.
#include "calibrate.hpp"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "attention_and_loss.hpp"
#include "gpt.hpp"
#include "measurements.hpp"  // benchmark_meshes
#include "shardlab/bench.hpp"
#include "shardlab/check.hpp"
#include "shardlab/format.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/timer.hpp"
#include "tensor_parallel.hpp"

namespace ch09 {

using ch08::Axis;
using ch08::LinkFit;
using ch08::MachineProfile;
using shardlab::Communicator;
using shardlab::Context;
using shardlab::format_number;
using shardlab::Shape;
using shardlab::Stopwatch;
using shardlab::Table;
using shardlab::Tensor;
namespace nn = shardlab::nn;

Shard shard_of(const TrainConfig& c) {
  const std::int64_t sequences =
      std::max<std::int64_t>(1, c.batch / (c.replicas() * c.microbatches));
  return {.rows = sequences * c.model.context / c.mesh.cp, .tp = c.mesh.tp, .cp = c.mesh.cp};
}

std::string cost_key(const std::string& what, const Shard& s) {
  return what + " r" + std::to_string(s.rows) + " t" + std::to_string(s.tp) + " c" +
         std::to_string(s.cp);
}

namespace {

// ---------------------------------------------------------------------------
// Timing on one core

/// Seconds one call of `f` takes: the best of 3 rounds of enough calls for 5 ms.
template <class F>
double seconds_of(F&& f) {
  f();  // warm: caches, packing buffers, the allocator
  Stopwatch once;
  f();
  const int calls = std::clamp(int(0.005 / std::max(once.seconds(), 1e-7)), 1, 2000);
  double best = std::numeric_limits<double>::infinity();
  for (int round = 0; round < 3; ++round) {
    Stopwatch w;
    for (int i = 0; i < calls; ++i) f();
    best = std::min(best, w.seconds() / calls);
  }
  return best;
}

/// Seconds one call of `f` takes with every rank of `world` calling it at once: the best
/// of 3 rounds of `calls` calls between two barriers, the slowest rank's (to the last
/// rank's end: a rank the cores take up late is counted).
template <class F>
double seconds_together(Communicator& world, int calls, F&& f) {
  double best = std::numeric_limits<double>::infinity();
  for (int round = 0; round < 3; ++round) {
    world.barrier();
    Stopwatch w;
    for (int i = 0; i < calls; ++i) f();
    world.barrier();
    best = std::min(best, world.agree(w.seconds() / calls, shardlab::ReduceOp::max));
  }
  return best;
}

/// F alone, F + B, F + B + W of `layer` on `x`, each timed by `time(call)`, taken apart:
/// {F, B, W} seconds.
template <class Time>
std::array<double, 3> pass_costs(nn::Layer& layer, const Tensor& x, Time&& time) {
  const Tensor dy = shardlab::randn(x.shape()[0], layer.forward(x).out.shape()[1], 7);
  const double f = time([&] { (void)layer.forward(x); });
  const double fb = time([&] {
    nn::Forward out = layer.forward(x);
    (void)layer.backward_input(dy, out.saved);
  });
  const double fbw = time([&] {
    nn::Forward out = layer.forward(x);
    (void)layer.backward_input(dy, out.saved);
    layer.backward_weight(out.saved);
  });
  return {f, std::max(fb - f, 0.0), std::max(fbw - fb, 0.0)};
}

/// pass_costs on one core.
std::array<double, 3> layer_costs(nn::Layer& layer, const Tensor& x) {
  return pass_costs(layer, x, [](auto&& call) { return seconds_of(call); });
}

void put(MachineProfile& m, const std::string& what, const Shard& s, std::array<double, 3> fbw) {
  m.costs[cost_key(what + "_forward", s)] = std::max(fbw[0], 1e-9);
  m.costs[cost_key(what + "_backward_input", s)] = std::max(fbw[1], 1e-9);
  m.costs[cost_key(what + "_backward_weight", s)] = std::max(fbw[2], 1e-9);
}

/// The attention's core on one core (nn::CausalSelfAttention over the shard's heads and
/// T/c tokens): what selective recomputation runs again.
void core_costs(MachineProfile& m, const GptShape& g, const Shard& s) {
  nn::CausalSelfAttention core(g.heads / s.tp, g.context / s.cp);
  put(m, "core_attention", s, layer_costs(core, shardlab::randn(s.rows, 3 * g.channels / s.tp, 4)));
  const std::int64_t C = g.channels, t = s.tp;
  for (auto [n, k] : {std::pair{3 * C / t, C}, {C, C / t}, {4 * C / t, C}, {C, 4 * C / t}}) {
    const Tensor a = shardlab::randn(s.rows, k, 5), b = shardlab::randn(k, n, 6);
    Tensor out = shardlab::empty(Shape{s.rows, n});
    const double sec = seconds_of([&] { shardlab::matmul_into(out, a, b); });
    m.gemm.push_back({int(s.rows), int(n), int(k), 2.0 * double(s.rows * n * k) / sec / 1e9});
  }
}

/// Chapter 09's own layers at one shard's shapes, on groups of ranks as the mesh makes
/// them (tp groups of t, cp rings of c; every rank at once, as training runs them): a
/// block's attention half (its cp ring inside) and MLP half (their tp sums inside), the
/// first stage's embedding, the last stage's LayerNorm, tied head and loss; each forward,
/// input gradient and weight gradient, the slowest rank's time. Stored as one rank's work
/// on a core: wall x min(R, cores) / R (the ranks' turns) over the sharing already counted.
void layer_costs_on_groups(Context& ctx, MachineProfile& m, const TrainConfig& c, const Shard& s) {
  Communicator& world = ctx.comm();
  const int R = world.size(), r = world.rank();
  if (R % (s.tp * s.cp)) return;
  auto tp = world.split(r / s.tp, r);
  auto cp = world.split((r / (s.tp * s.cp)) * s.tp + r % s.tp, r);
  const GptShape& g = c.model;
  const BlockOptions blocks{.tp = {.chunks = kTpParts, .overlap = c.overlap[Axis::tp]},
                            .context = s.cp > 1 ? c.context.get() : nullptr,
                            .cp = s.cp > 1 ? cp.get() : nullptr};
  nn::ParameterStore store;
  nn::Residual attention = parallel_attention(store, *tp, "h.0", g, 0, blocks);
  nn::Residual mlp(ch08::parallel_mlp(store, *tp, mlp_spec("h.0", g, 0), blocks.tp));
  std::vector<std::int64_t> positions;
  if (s.cp > 1) positions = c.context->positions(g.context, s.cp, cp->rank());
  VocabParallelEmbedding embed(store, *tp, g, false, positions);
  nn::LayerNorm ln_f(store, "ln_f", g.channels);
  TiedHead head(*tp, embed.wte(), blocks.tp);
  nn::Sequential stack;
  for (int block = 0; block < g.layers; ++block) {
    const std::string name = "stack." + std::to_string(block);
    stack.add(
        std::make_shared<nn::Residual>(parallel_attention(store, *tp, name, g, block, blocks)));
    stack.add(std::make_shared<nn::Residual>(
        ch08::parallel_mlp(store, *tp, mlp_spec(name, g, block), blocks.tp)));
  }
  store.allocate();
  const double turns = m.core_groups(world.size()).turns() / m.costs.at("sharing");

  // Every rank's calls at once (after one to warm up), as one rank's turns on a core.
  auto together = [&](auto&& f) {
    f();
    return seconds_together(world, 3, f) * turns;
  };
  auto three = [&](nn::Layer& layer, const Tensor& x) { return pass_costs(layer, x, together); };
  const Tensor x = shardlab::randn(s.rows, g.channels, 3 + r);
  std::array<double, 3> a = three(attention, x), b = three(mlp, x);
  // The halves alone run on warm caches; a stage runs its blocks' forwards first and
  // their backwards later, each reading what its forward kept long before. A stack of the
  // model's L blocks, as one stage of them runs it, scales both halves to what a block
  // takes there.
  const std::array<double, 3> whole = three(stack, x);
  for (int pass = 0; pass < 3; ++pass) {
    const double alone = a[pass] + b[pass];
    const double scale = alone > 0 ? whole[pass] / g.layers / alone : 1.0;
    a[pass] *= scale, b[pass] *= scale;
  }
  put(m, "attention", s, a);
  put(m, "mlp", s, b);

  Tensor ids(Shape{s.rows}, shardlab::DType::i32);
  for (std::int64_t i = 0; i < s.rows; ++i)
    ids.data<std::int32_t>()[i] = std::int32_t((i * 7919) % g.vocab);
  const Tensor dy = shardlab::randn(s.rows, g.channels, 4);
  const double embed_f = together([&] { (void)embed.forward(ids); });
  const double embed_fw = together([&] {
    nn::Forward out = embed.forward(ids);
    (void)embed.backward_input(dy, out.saved);
    embed.backward_weight(out.saved);
  });
  put(m, "first_stage", s, {embed_f, 0.0, std::max(embed_fw - embed_f, 0.0)});
  const ShardRange vocab = embed.vocab();
  auto loss_f = [&] {
    nn::Forward normed = ln_f.forward(x);
    nn::Forward logits = head.forward(normed.out);
    return std::tuple{std::move(normed), std::move(logits),
                      vocab_parallel_cross_entropy(*tp, logits.out, ids, vocab, double(s.rows))};
  };
  const double f = together([&] { (void)loss_f(); });
  const double fb = together([&] {
    auto [normed, logits, loss] = loss_f();
    const Tensor dlogits = vocab_parallel_cross_entropy_backward(loss);
    (void)ln_f.backward_input(head.backward_input(dlogits, logits.saved), normed.saved);
  });
  const double fbw = together([&] {
    auto [normed, logits, loss] = loss_f();
    const Tensor dlogits = vocab_parallel_cross_entropy_backward(loss);
    (void)ln_f.backward_input(head.backward_input(dlogits, logits.saved), normed.saved);
    head.backward_weight(logits.saved);
    ln_f.backward_weight(normed.saved);
  });
  put(m, "last_stage", s, {f, std::max(fb - f, 0.0), std::max(fbw - fb, 0.0)});
}

/// STREAM's triad a = b + s c over arrays far larger than the caches, GB/s.
double triad_GBps() {
  const std::size_t n = std::size_t{1} << 22;  // 3 x 16 MiB
  std::vector<float> a(n), b(n, 1.0f), c(n, 2.0f);
  const float s = 3.0f;
  const double sec = seconds_of([&] {
    for (std::size_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
    asm volatile("" : : "r"(a.data()) : "memory");
  });
  return 3.0 * 4.0 * double(n) / sec / 1e9;
}

/// The elementwise kernels' rates, bytes read and written over seconds, and Adam's
/// update a parameter (seconds, in costs).
void elementwise(MachineProfile& m, std::int64_t rows, std::int64_t channels) {
  const Tensor x = shardlab::randn(rows, 4 * channels, 1),
               dy = shardlab::randn(rows, 4 * channels, 2);
  nn::Gelu gelu;
  const double gelu_s = seconds_of([&] {
    nn::Forward out = gelu.forward(x);
    (void)gelu.backward_input(dy, out.saved);
  });
  m.elementwise["gelu_forward_backward"] = 5.0 * 4 * double(x.size()) / gelu_s / 1e9;
  nn::ParameterStore store;
  nn::LayerNorm ln(store, "ln", 4 * channels);
  store.allocate();
  const double ln_s = seconds_of([&] {
    nn::Forward out = ln.forward(x);
    (void)ln.backward_input(dy, out.saved);
    ln.backward_weight(out.saved);
  });
  m.elementwise["layernorm_forward_backward"] = 6.0 * 4 * double(x.size()) / ln_s / 1e9;
  const std::int64_t n = std::int64_t{1} << 20;
  Tensor p = shardlab::randn(1, n, 1), grad = shardlab::randn(1, n, 2);
  Tensor mm = shardlab::zeros(Shape{1, n}), v = shardlab::zeros(Shape{1, n});
  int t = 0;
  const double adam_s = seconds_of([&] { nn::adam_update(p, grad, mm, v, ++t, {}); });
  m.elementwise["adam"] = 7.0 * 4 * double(n) / adam_s / 1e9;
  m.costs["adam_per_parameter"] = adam_s / double(n);
}

// ---------------------------------------------------------------------------
// The links: every rank at once, as training runs them

/// Seconds of one `op` of `bytes` (the buffer a rank hands over) in `group`, the slowest
/// rank's, the best of 3 rounds.
double collective_seconds(Communicator& world, Communicator& group, const std::string& op,
                          std::size_t bytes) {
  const int g = group.size();
  const std::int64_t n = std::max<std::int64_t>(g, std::int64_t(bytes / 4) / g * g);
  Tensor in = shardlab::randn(1, n, 1), out = shardlab::zeros(Shape{1, n});
  Tensor part = shardlab::zeros(Shape{1, n / g});
  const int peer_to = (group.rank() + 1) % g, peer_from = (group.rank() + g - 1) % g;
  auto once = [&] {
    if (op == "allreduce")
      group.allreduce(in);
    else if (op == "allgather")
      group.allgather(part, out);
    else if (op == "reduce_scatter")
      group.reduce_scatter(in, part);
    else if (op == "alltoall")
      group.alltoall(in, out);
    else
      group.sendrecv(in, peer_to, out, peer_from, 5);
  };
  const int calls = std::clamp(int(2e6 / double(bytes)), 2, 50);
  once();  // checked once (every rank the same call), then timed without the check
  Communicator::Unchecked timed(group);
  double best = std::numeric_limits<double>::infinity();
  for (int round = 0; round < 3; ++round) {
    world.barrier();
    Stopwatch w;
    for (int i = 0; i < calls; ++i) once();
    best = std::min(best, world.agree(w.seconds() / calls, shardlab::ReduceOp::max));
  }
  return best;
}

/// Every rank computing at once, as training does: the same block's forward and backward
/// on each, timed alone (rank 0, the others waiting) and all together; costs["sharing"] is
/// how much longer together takes than the ranks' turns on the cores would if each ran as
/// fast as alone: R t_alone / min(R, cores). It holds what sharing a core costs beyond the
/// turns (caches refilled after every switch, the memory's bandwidth shared, the kernel's
/// switching) and whatever else the machine runs.
void measure_sharing(Context& ctx, MachineProfile& m, const GptShape& g, const Shard& s) {
  Communicator& world = ctx.comm();
  const std::int64_t C = g.channels;
  nn::ParameterStore store;
  nn::Sequential mlp;
  mlp.add<nn::LayerNorm>(store, "ln_2", C);
  mlp.add<nn::Linear>(store, "c_fc", C, 4 * C / s.tp, 3);
  mlp.add<nn::Gelu>();
  mlp.add<nn::Linear>(store, "mlp.c_proj", 4 * C / s.tp, C, 4);
  store.allocate();
  nn::Residual block(mlp);
  const Tensor x = shardlab::randn(s.rows, C, 3), dy = shardlab::randn(s.rows, C, 4);
  auto once = [&] {
    nn::Forward out = block.forward(x);
    (void)block.backward_input(dy, out.saved);
    block.backward_weight(out.saved);
  };
  double alone = 0;
  if (world.rank() == 0) alone = seconds_of(once);
  alone = world.agree(alone, shardlab::ReduceOp::max);
  const int calls = std::clamp(int(0.2 / alone), 4, 2000);  // about 0.2 s of work a rank
  const double together = seconds_together(world, calls, once);
  const double turns = alone / m.core_groups(world.size()).turns();
  m.costs["sharing"] = std::max(1.0, together / turns);
}

/// The CPUs the calling thread may run on (its affinity), as "0,1"; "" where unknown.
std::string cpus_of_this_thread() {
  std::string out;
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return out;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) out += (out.empty() ? "" : ",") + std::to_string(cpu);
#endif
  return out;
}

/// Where the ranks run: on how many hosts (network names: the link between them) and
/// machines (kernels: the cores they share; scripts/cluster.sh's hosts are one machine's),
/// and on which of its cores (a rank pinned to one shares it with the others pinned there).
void where_ranks_are(Context& ctx, MachineProfile& m) {
  Communicator& world = ctx.comm();
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  const std::vector<std::string> hosts = world.gather_strings(name, 0);
  const std::vector<std::string> kernels = world.gather_strings(boot, 0);
  const std::vector<std::string> cpus = world.gather_strings(cpus_of_this_thread(), 0);
  double per_host = 0, per_machine = 0, elsewhere = 0;
  if (world.rank() == 0) {
    group_cores(kernels, cpus, m);
    per_host = double(std::count(hosts.begin(), hosts.end(), hosts[0]));
    per_machine = double(std::count(kernels.begin(), kernels.end(), kernels[0]));
    const auto other =
        std::find_if(hosts.begin(), hosts.end(), [&](auto& h) { return h != hosts[0]; });
    elsewhere = other == hosts.end() ? 0 : double(other - hosts.begin());
  }
  m.ranks_per_host = int(world.agree(per_host, shardlab::ReduceOp::max));
  m.ranks_per_machine = int(world.agree(per_machine, shardlab::ReduceOp::max));
  m.first_elsewhere = int(world.agree(elsewhere, shardlab::ReduceOp::max));
  m.cores = int(world.agree(double(m.cores), shardlab::ReduceOp::max));
  // Rank 0's groups to every rank (a whole number each: the max over ranks of it and 0s).
  const int groups = int(world.agree(double(m.group_cores.size()), shardlab::ReduceOp::max));
  if (groups == 0) return;
  auto from_rank_0 = [&](std::vector<int>& v, std::size_t n) {
    v.resize(n, 0);
    for (int& x : v)
      x = int(world.agree(world.rank() == 0 ? double(x) : 0.0, shardlab::ReduceOp::max));
  };
  from_rank_0(m.core_group, std::size_t(world.size()));
  from_rank_0(m.group_cores, std::size_t(groups));
}

void measure_links(Context& ctx, MachineProfile& m) {
  Communicator& world = ctx.comm();
  const int R = world.size();
  const std::vector<std::size_t> sizes{std::size_t{4} << 10, std::size_t{64} << 10,
                                       std::size_t{512} << 10, std::size_t{4} << 20};
  // Groups of g consecutive ranks (on one host while g fits one), and, across hosts, of
  // g ranks R/g apart (each on another host where it can): "op" and "op_across".
  for (int g = 2; g <= R; g *= 2) {
    if (R % g) continue;
    for (const bool across : {false, true}) {
      const int stride = across ? R / g : 1;
      if (across && (m.first_elsewhere == 0 || stride == 1)) continue;
      const int color = across ? world.rank() % stride + (world.rank() / (stride * g)) * stride
                               : world.rank() / g;
      auto group = world.split(color, world.rank());
      // Open MPI 4.1's MPI_Allgatherv of 512 KiB a group of 4 across scripts/cluster.sh's
      // two hosts stopped for good (2 of 3 runs: two ranks left it, two never did): across
      // hosts the all-gather is not measured, and a prediction takes the one inside a host.
      const bool crosses = m.first_elsewhere != 0 && (across || g > std::max(1, m.ranks_per_host));
      for (const char* op : {"allreduce", "allgather", "reduce_scatter", "alltoall", "sendrecv"}) {
        if (crosses && std::string(op) == "allgather") continue;
        std::vector<std::pair<double, double>> points;
        for (std::size_t bytes : sizes)
          points.emplace_back(double(bytes), collective_seconds(world, *group, op, bytes));
        m.links[std::string(op) + (across ? "_across" : "")][g] = ch08::fit_link(points);
      }
    }
  }
  // Ranks on more than one host: the link between two of them, alone.
  const int across = m.first_elsewhere;
  if (across == 0) return;
  const bool pair = world.rank() == 0 || world.rank() == across;
  auto link = world.split(pair ? 0 : 1, world.rank());
  std::vector<std::pair<double, double>> points;
  for (std::size_t bytes : sizes) {
    double s = 0;
    if (pair) s = collective_seconds(*link, *link, "sendrecv", bytes);
    points.emplace_back(double(bytes), world.agree(s, shardlab::ReduceOp::max));
  }
  m.links["link"][2] = ch08::fit_link(points);
}

}  // namespace

void group_cores(const std::vector<std::string>& kernels, const std::vector<std::string>& cpus,
                 ch08::MachineProfile& m) {
  const std::size_t R = cpus.size();
  std::vector<std::set<int>> sets(R);
  for (std::size_t r = 0; r < R; ++r) {
    if (cpus[r].empty()) return;
    std::stringstream list(cpus[r]);
    for (std::string cpu; std::getline(list, cpu, ',');) sets[r].insert(std::stoi(cpu));
  }
  std::vector<std::size_t> root(R);
  std::iota(root.begin(), root.end(), std::size_t{0});
  auto find = [&](std::size_t r) {
    while (root[r] != r) r = root[r] = root[root[r]];
    return r;
  };
  for (std::size_t i = 0; i < R; ++i)
    for (std::size_t j = i + 1; j < R; ++j)
      if (kernels[i] == kernels[j] &&
          std::any_of(sets[i].begin(), sets[i].end(), [&](int c) { return sets[j].count(c); }))
        root[find(j)] = find(i);
  std::map<std::size_t, int> group;  // a root -> its group, numbered as first met
  std::vector<std::set<int>> cores;
  for (std::size_t r = 0; r < R; ++r) {
    const auto [at, fresh] = group.try_emplace(find(r), int(cores.size()));
    if (fresh) cores.emplace_back();
    m.core_group.push_back(at->second);
    cores[std::size_t(at->second)].insert(sets[r].begin(), sets[r].end());
  }
  for (const std::set<int>& c : cores) m.group_cores.push_back(int(c.size()));
}

void calibrate(Context& ctx, const TrainConfig& base, const std::string& path) {
  MachineProfile m;
  const GptShape& g = base.model;
  m.backend = std::string(ctx.comm().backend());
  m.ranks = ctx.size();
  m.model = describe(base, ctx.comm().backend(), false);
  std::set<Shard> shards;
  for (const MeshShape& mesh : benchmark_meshes(base, ctx.size())) {
    TrainConfig c = base;
    c.mesh = mesh;
    shards.insert(shard_of(c));
  }
  // One core's rates, measured by rank 0 while the others wait.
  if (ctx.rank() == 0) {
    const shardlab::bench::HostCpu& cpu = shardlab::bench::host_cpu();
    m.cpu = cpu.name;
    m.cores = cpu.cores;
    m.clock_ghz = cpu.clock_ghz;
    m.fp32_lanes = cpu.fp32_lanes;
    m.fma_units = cpu.fma_units;
    m.memory_bytes = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
    m.gemm_gflops = shardlab::bench::host_gemm_peak_gflops();
    m.triad_GBps = triad_GBps();
    elementwise(m, 512, g.channels);
    for (const Shard& s : shards) core_costs(m, g, s);
  }
  {
    Communicator::Patience wait(ctx.comm(), std::chrono::minutes(10));
    ctx.comm().barrier();
  }
  where_ranks_are(ctx, m);
  measure_sharing(ctx, m, g, *shards.begin());
  for (const Shard& s : shards) layer_costs_on_groups(ctx, m, base, s);
  measure_links(ctx, m);
  if (ctx.rank() == 0) {
    ch08::save_machine(m, path);
    Table t({"what", "value", "unit"});
    t.add({"cpu", m.cpu, ""});
    t.add({"cores", m.cores, ""});
    const ch08::CoreGroups groups = m.core_groups(m.ranks);
    for (std::size_t k = 0; k < groups.cores.size(); ++k) {
      std::string ranks;
      for (int r = 0; r < m.ranks; ++r)
        if (groups.of[std::size_t(r)] == int(k))
          ranks += (ranks.empty() ? "" : " ") + std::to_string(r);
      t.add({"ranks " + ranks + " share", groups.cores[k], "cores"});
    }
    t.add({"peak (cores x clock x lanes x FMA units x 2)", m.peak_gflops(), "GFLOP/s"});
    t.add({"GEMM 512^3, one core", m.gemm_gflops, "GFLOP/s"});
    t.add({"STREAM triad, one core", m.triad_GBps, "GB/s"});
    for (const auto& [op, sizes] : m.links)
      for (const auto& [size, fit] : sizes)
        t.add({op + " over " + std::to_string(size) + ": alpha, beta",
               format_number(fit.alpha_s * 1e6, 3) + " us, " + format_number(fit.beta_GBps, 3),
               "GB/s"});
    ctx.report(t, "machine",
               "Chapter 09 - this machine, measured (" + std::to_string(shards.size()) +
                   " shard shapes of the model's meshes, " + std::to_string(m.costs.size()) +
                   " costs): written to " + path);
  }
}

double spearman(const std::vector<double>& a, const std::vector<double>& b) {
  shardlab::require(a.size() == b.size(), "spearman: two lists of one length");
  const std::size_t n = a.size();
  if (n < 2) return 0;
  auto ranks = [n](const std::vector<double>& x) {
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](auto i, auto j) { return x[i] < x[j]; });
    std::vector<double> r(n);
    for (std::size_t i = 0; i < n;) {
      std::size_t j = i;
      while (j + 1 < n && x[order[j + 1]] == x[order[i]]) ++j;
      for (std::size_t k = i; k <= j; ++k) r[order[k]] = (double(i) + double(j)) / 2 + 1;
      i = j + 1;
    }
    return r;
  };
  const std::vector<double> ra = ranks(a), rb = ranks(b);
  const double mean = (double(n) + 1) / 2;
  double sab = 0, saa = 0, sbb = 0;
  for (std::size_t i = 0; i < n; ++i) {
    sab += (ra[i] - mean) * (rb[i] - mean);
    saa += (ra[i] - mean) * (ra[i] - mean);
    sbb += (rb[i] - mean) * (rb[i] - mean);
  }
  return saa > 0 && sbb > 0 ? sab / std::sqrt(saa * sbb) : 0.0;
}

}  // namespace ch09
