// Chapter 07 — Mixture-of-Experts with expert parallelism: routing, capacity, and the
// all-to-all.
//
// The course (so-large-lm, the distributed-training walk-through's §7 "专家并行", citing
// the course's chapter on new architectures; CS336 lecture 7 §4.3): in a Mixture-of-
// Experts layer each token activates only a few experts, so experts can be placed on
// different devices — expert parallelism — and combined with data parallelism. The
// parameters grow with the number of experts; the compute per token does not.
//
// This chapter's layer: a softmax router over E experts, top-k routing (k = 1 Switch,
// k = 2 GShard) with an expert capacity and dropped tokens, the load-balancing auxiliary
// loss, experts that are small MLPs. On ranks, each rank holds E/N experts and T/N
// tokens; tokens travel to their experts in an all-to-all and back in another, forward
// and backward, and every result is compared with the same layer on one device.
//
// Run:
//   build/default/bin/ch07_moe                                   2 ranks, 8 experts, k = 2
//   build/default/bin/ch07_moe --ranks 4 --top-k 1 --capacity-factor 1.0
//   build/default/bin/ch07_moe --ranks 4 --train 200 --csv --csv-dir results
//   build/default/bin/ch07_moe --ranks 4 --benchmark --csv-dir results
//   mpirun -np 4 build/default/bin/ch07_moe --benchmark --csv-dir results   (MPI's alltoall)
//
// Expected: the expert-parallel layer equals the single-device one (on the CPU the
// forward bit for bit, gradients to rounding); the all-to-all moves exactly the rows the
// routing sends to other ranks.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moe.hpp"
#include "routing.hpp"
#include "shardlab/bench.hpp"
#include "shardlab/check.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/results.hpp"

using namespace shardlab;
using namespace ch07;

namespace {

struct Settings {
  MoeConfig moe;
  int train = 0;
  float lr = 1e-2f;
  bool csv = false;
  bool benchmark = false;
  int max_mib = 64;
  bool alpha_given = false;
};

std::string bar(int n, int most, int width = 32) {
  return std::string(static_cast<std::size_t>(most ? (width * n + most - 1) / most : 0), '#');
}

/// Tokens per expert as text bars, with the capacity.
std::string histogram(const Result& r, int capacity) {
  std::ostringstream out;
  const int most = std::max(capacity, *std::max_element(r.wanted.begin(), r.wanted.end()));
  for (std::size_t e = 0; e < r.wanted.size(); ++e) {
    char line[160];
    std::snprintf(line, sizeof line, "  expert %2zu  wanted %4d  kept %4d  %-34s%s\n", e, r.wanted[e], r.kept[e],
                  bar(r.kept[e], most).c_str(), r.wanted[e] > r.kept[e] ? "  <- full: the rest dropped" : "");
    out << line;
  }
  return out.str();
}

void layer(Context& ctx, const Settings& s) {
  Communicator& comm = ctx.comm();
  const MoeConfig& c = s.moe;
  const int N = ctx.size(), per = c.experts / N;
  const Weights mine = make_weights(c, ctx.rank() * per, per);
  // Every token and its gradient, drawn alike for every rank count; this rank's share.
  const Tensor all_x = randn(Shape{c.tokens, c.hidden}, c.seed * 7919 + 11);
  const Tensor all_dy = scale(randn(Shape{c.tokens, c.hidden}, c.seed * 7919 + 12), 0.1f);
  const ShardRange tokens = shard_range(c.tokens, N, ctx.rank());
  const Result r = moe_parallel(comm, c, mine, all_x.slice(tokens.offset, tokens.length),
                                all_dy.slice(tokens.offset, tokens.length), ctx.memory());
  // The same layer on one device, every token: each rank computes it and compares its share.
  const Result ref = moe_reference(c, make_weights(c, 0, c.experts), all_x, all_dy);
  const double dy_diff = comm.agree(max_abs_diff(r.y, ref.y.slice(tokens.offset, tokens.length)), ReduceOp::max);
  const double dx_diff = comm.agree(max_abs_diff(r.dx, ref.dx.slice(tokens.offset, tokens.length)), ReduceOp::max);
  const double dr_diff = comm.agree(max_abs_diff(r.drouter, ref.drouter), ReduceOp::max);
  double dw_diff = 0;
  for (int l = 0; l < per; ++l) {
    dw_diff = std::max(dw_diff, max_abs_diff(r.dw1[static_cast<std::size_t>(l)], ref.dw1[static_cast<std::size_t>(ctx.rank() * per + l)]));
    dw_diff = std::max(dw_diff, max_abs_diff(r.dw2[static_cast<std::size_t>(l)], ref.dw2[static_cast<std::size_t>(ctx.rank() * per + l)]));
  }
  dw_diff = comm.agree(dw_diff, ReduceOp::max);
  const double scale_dr = max_abs(ref.drouter), scale_dx = max_abs(ref.dx);
  // What the all-to-alls must have moved, from the single-device routing alone: rows of
  // other ranks' tokens for this rank's experts, and rows of this rank's tokens for other
  // ranks' experts, d floats each, forward and backward.
  std::uint64_t rows = 0;
  for (int t = 0; t < c.tokens; ++t)
    for (int j = 0; j < c.k; ++j) {
      const auto ch = static_cast<std::size_t>(t * c.k + j);
      if (ref.routing.slot[ch] < 0) continue;
      const int owner = ref.routing.expert[ch] / per;
      const bool mine_token = t >= tokens.offset && t < tokens.offset + tokens.length;
      if ((owner == ctx.rank()) != mine_token) ++rows;
    }
  const std::uint64_t expected = 2 * rows * static_cast<std::uint64_t>(c.hidden) * 4;
  const auto received = comm.gather_values(static_cast<std::int64_t>(r.alltoall_received));
  const auto formula = comm.gather_values(static_cast<std::int64_t>(expected));
  const bool bytes_ok = comm.all_true(r.alltoall_received == expected);

  std::ostringstream out;
  const double ideal = static_cast<double>(c.k) * c.tokens / c.experts;
  out << "Chapter 07 - a Mixture-of-Experts layer on " << N << " ranks (" << comm.backend() << "): "
      << c.experts << " experts (" << per << " per rank), each an MLP " << c.hidden << " -> " << c.ffn << " -> "
      << c.hidden << "; " << c.tokens << " tokens (" << tokens.length << " on rank 0's share), top-" << c.k
      << " routing\n\n"
      << "capacity C = ceil(k T / E x capacity factor) = ceil(" << c.k << " x " << c.tokens << " / " << c.experts
      << " x " << format_number(c.capacity_factor) << ") = " << c.capacity() << " tokens per expert ("
      << format_number(ideal) << " if the router were perfectly even)\n"
      << histogram(r, c.capacity())
      << "dropped: " << r.dropped << " of " << c.k * c.tokens << " choices (" << r.passed_through
      << " tokens kept none and pass through unchanged); aux loss alpha E sum f_i P_i = "
      << format_number(r.aux_loss, 6) << " (alpha = " << format_number(c.aux_alpha) << "; "
      << format_number(c.aux_alpha) << " when perfectly balanced)\n\n";
  out << "expert parallel vs one device, every token:\n"
      << "  outputs y            max abs diff " << format_number(dy_diff, 3) << "\n"
      << "  dL/dx                max abs diff " << format_number(dx_diff, 3) << " (largest " << format_number(scale_dx, 3)
      << ")\n"
      << "  dL/dWrouter          max abs diff " << format_number(dr_diff, 3) << " (largest " << format_number(scale_dr, 3)
      << "; summed over ranks in another order)\n"
      << "  dL/dW of the experts max abs diff " << format_number(dw_diff, 3) << "\n\n"
      << "all-to-all bytes received per rank (dispatch + combine, forward and backward), "
      << (r.traffic_modeled ? "modeled" : "measured") << " vs the one-device routing's rows that cross ranks x d x 4 "
      << "x 2 passes:\n";
  for (int q = 0; q < N; ++q)
    out << "  rank " << q << ": " << received[static_cast<std::size_t>(q)] << " vs "
        << formula[static_cast<std::size_t>(q)] << "\n";
  const double even = 4.0 * c.k * (static_cast<double>(c.tokens) / N) * (N - 1.0) / N * c.hidden * 4;
  out << "  (a perfectly even router: 4 passes x k T/N x (N-1)/N x d x 4 = " << format_number(even, 6)
      << " bytes per rank)\n";
  ctx.say(out.str());

  // On the CPU both sides add the same numbers in the same order: bit for bit. On a GPU the
  // experts run in cuBLAS and the reference on the host: to rounding.
  const double exact = ctx.on_gpu() ? 1e-5 : 0.0;
  ctx.verify(dy_diff <= exact * std::max(1.0, max_abs(ref.y)),
             "the expert-parallel outputs differ from one device's by " + format_number(dy_diff));
  ctx.verify(dw_diff <= 1e-6 * std::max(1.0, max_abs(ref.dw1[0])) + 1e-6 + exact,
             "the experts' gradients differ from one device's by " + format_number(dw_diff));
  ctx.verify(dx_diff <= 1e-5 * std::max(scale_dx, 1e-30), "dL/dx differs from one device's by " + format_number(dx_diff));
  ctx.verify(dr_diff <= 1e-5 * std::max(scale_dr, 1e-30),
             "the router's gradient differs from one device's by " + format_number(dr_diff));
  ctx.verify(bytes_ok, "the all-to-all moved other than the rows the routing sends to other ranks");
  auto& j = ctx.json();
  j["capacity"] = c.capacity();
  j["dropped_tokens"] = r.dropped;  // dropped choices: tokens for k = 1
  j["dropped_choices"] = r.dropped;
  j["passed_through_tokens"] = r.passed_through;
  j["tokens_per_expert"] = r.kept;
  j["wanted_per_expert"] = r.wanted;
  j["aux_loss"] = r.aux_loss;
  j["alltoall_bytes_per_rank"] = received;
  j["formula_alltoall_bytes_per_rank"] = formula;
  j["traffic_modeled"] = r.traffic_modeled;
  j["vs_single_device_max_abs_diff"] = std::max({dy_diff, dx_diff, dr_diff, dw_diff});
  j["output_max_abs_diff"] = dy_diff;
}

// ---------------------------------------------------------------------------
// Training: the router learns, with and without the auxiliary loss

struct TrainRun {
  std::vector<std::vector<int>> kept;  // per step, tokens per expert
  std::vector<double> aux, dropped_fraction, loss;
  Weights weights;
};

/// The direction every training token leans along (unit length).
Tensor lean(const MoeConfig& c) {
  return scale(full(Shape{c.hidden}, 1.0f), 1.0f / std::sqrt(static_cast<float>(c.hidden)));
}
/// Training batch `step`: N(0, 1) tokens shifted along lean(), all T of them.
Tensor training_tokens(const MoeConfig& c, std::uint64_t step) {
  const Tensor u = lean(c);
  Tensor x = randn(Shape{c.tokens, c.hidden}, c.seed * 7919 + 1000 + step);
  for (std::int64_t t = 0; t < c.tokens; ++t)
    for (std::int64_t i = 0; i < c.hidden; ++i) x(t, i) += 1.5f * u[i] * std::sqrt(static_cast<float>(c.hidden));
  return x;
}

/// Trains router and experts on y -> target = x + 0.5 tanh(x A), from a router that
/// starts out preferring expert 0 (the tokens share a direction it is aligned with).
TrainRun train(Context& ctx, const Settings& s, double alpha) {
  Communicator& comm = ctx.comm();
  MoeConfig c = s.moe;
  c.aux_alpha = alpha;
  const int N = ctx.size(), per = c.experts / N;
  Weights w = make_weights(c, ctx.rank() * per, per);
  const Tensor u = lean(c);
  for (std::int64_t i = 0; i < c.hidden; ++i) w.router(i, 0) += 2.0f * u[i];
  const Tensor A = scale(randn(Shape{c.hidden, c.hidden}, c.seed * 7919 + 21), 1.0f / std::sqrt(static_cast<float>(c.hidden)));
  const ShardRange mine = shard_range(c.tokens, N, ctx.rank());
  nn::AdamConfig adam{.lr = s.lr};
  std::vector<Tensor> params = {w.router};
  for (int l = 0; l < per; ++l) params.push_back(w.w1[static_cast<std::size_t>(l)]), params.push_back(w.w2[static_cast<std::size_t>(l)]);
  std::vector<Tensor> m, v;
  for (const Tensor& p : params) m.emplace_back(p.shape(), DType::f32), v.emplace_back(p.shape(), DType::f32);
  TrainRun run;
  for (int step = 1; step <= s.train; ++step) {
    // A fresh batch each step; every token leans along u.
    const Tensor x = training_tokens(c, static_cast<std::uint64_t>(step));
    const Tensor target = add(x, scale(tanh(matmul(x, A)), 0.5f));
    const Tensor xs = x.slice(mine.offset, mine.length).clone();
    const Result f = moe_parallel(comm, c, w, xs, {}, ctx.memory());
    const Tensor err = sub(f.y, target.slice(mine.offset, mine.length));
    const Tensor dy = scale(err, 1.0f / static_cast<float>(c.tokens));
    const Result r = moe_parallel(comm, c, w, xs, dy, ctx.memory());
    run.loss.push_back(comm.agree(nn::squared_error(f.y, target.slice(mine.offset, mine.length)), ReduceOp::sum) /
                       (2.0 * c.tokens));
    run.kept.push_back(r.kept);
    run.aux.push_back(r.aux_loss / std::max(alpha, 1e-30) * (alpha > 0 ? 1 : 0));
    run.dropped_fraction.push_back(static_cast<double>(r.dropped) / (c.k * c.tokens));
    std::vector<Tensor> grads = {r.drouter};
    for (int l = 0; l < per; ++l) grads.push_back(r.dw1[static_cast<std::size_t>(l)]), grads.push_back(r.dw2[static_cast<std::size_t>(l)]);
    for (std::size_t i = 0; i < params.size(); ++i) {
      Tensor flat = params[i].flat(), mf = m[i].flat(), vf = v[i].flat();
      nn::adam_update(flat, grads[i].flat(), mf, vf, step, adam);
    }
  }
  run.weights = w;
  return run;
}

void training(Context& ctx, const Settings& s) {
  const MoeConfig& c = s.moe;
  // Switch's 0.01 suits long runs of large models; a few hundred steps here need more.
  const double alpha = s.alpha_given ? c.aux_alpha : 0.1;
  const TrainRun without = train(ctx, s, 0.0);
  const TrainRun with = train(ctx, s, alpha);
  std::ostringstream out;
  out << "Chapter 07 - training the router, " << s.train << " steps of Adam (lr " << format_number(s.lr)
      << "), from a router that starts out preferring expert 0; capacity " << c.capacity() << "\n\n";
  for (const auto& [name, run] : {std::pair{"without the aux loss", &without}, {"with the aux loss", &with}}) {
    out << name << (run == &with ? " (alpha = " + format_number(alpha) + ")" : std::string()) << ": tokens per expert, step 1 -> "
        << s.train << "\n";
    const auto& first = run->kept.front();
    const auto& last = run->kept.back();
    const int most = std::max(*std::max_element(first.begin(), first.end()), *std::max_element(last.begin(), last.end()));
    for (std::size_t e = 0; e < first.size(); ++e) {
      char line[160];
      std::snprintf(line, sizeof line, "  expert %2zu  %4d %-20s -> %4d %s\n", e, first[e], bar(first[e], most, 20).c_str(),
                    last[e], bar(last[e], most, 20).c_str());
      out << line;
    }
    out << "  dropped choices: " << format_number(100 * run->dropped_fraction.front(), 3) << "% -> "
        << format_number(100 * run->dropped_fraction.back(), 3) << "%; loss " << format_number(run->loss.front(), 4)
        << " -> " << format_number(run->loss.back(), 4) << "\n\n";
  }
  ctx.say(out.str());
  auto& j = ctx.json();
  j["tokens_per_expert_without_aux"] = without.kept.back();
  j["tokens_per_expert_with_aux"] = with.kept.back();
  j["dropped_fraction_without_aux"] = without.dropped_fraction.back();
  j["dropped_fraction_with_aux"] = with.dropped_fraction.back();
  j["capacity"] = c.capacity();
  if (!s.csv) return;
  CsvTable steps({"step", "aux", "expert", "tokens", "dropped_fraction", "loss"});
  for (const auto& [name, run] : {std::pair{"without", &without}, {"with", &with}})
    for (std::size_t t = 0; t < run->kept.size(); ++t)
      for (std::size_t e = 0; e < run->kept[t].size(); ++e)
        steps.add({std::to_string(t + 1), name, std::to_string(e), std::to_string(run->kept[t][e]),
                   format_number(run->dropped_fraction[t]), format_number(run->loss[t])});
  ctx.save_csv(steps, "07_moe_training");
  // Dropped choices against the capacity factor, for the trained routers.
  CsvTable drops({"capacity_factor", "capacity", "aux", "dropped_fraction"});
  const Tensor x = training_tokens(c, 1000000);  // a batch the training never saw
  for (double cf : {0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0}) {
    MoeConfig at = c;
    at.capacity_factor = cf;
    for (const auto& [name, run] : {std::pair{"without", &without}, {"with", &with}}) {
      const ShardRange mine = shard_range(c.tokens, ctx.size(), ctx.rank());
      const Result r = moe_parallel(ctx.comm(), at, run->weights, x.slice(mine.offset, mine.length).clone(), {}, ctx.memory());
      drops.add({format_number(cf), std::to_string(at.capacity()), name,
                 format_number(static_cast<double>(r.dropped) / (c.k * c.tokens))});
    }
  }
  ctx.save_csv(drops, "07_moe_capacity");
}

// ---------------------------------------------------------------------------
// Benchmark: the all-to-all, nccl-tests style

void benchmark(Context& ctx, const Settings& s) {
  Communicator& comm = ctx.comm();
  const int N = ctx.size(), r = ctx.rank();
  Tensor in, out;
  std::int64_t block = 0;
  auto prepare = [&](std::int64_t count) {
    block = count / N;  // elements per peer
    in = Tensor(Shape{block * N}, DType::f32, ctx.memory());
    out = Tensor(Shape{block * N}, DType::f32, ctx.memory());
    Tensor h(block * N);
    for (std::int64_t i = 0; i < block * N; ++i) h[i] = static_cast<float>(r * 1000003 + i);
    in.copy_from(h.to(ctx.memory()));
  };
  // Runs `exchange` once on fresh output and counts the elements not where they belong:
  // block q of my output is rank q's block for me.
  auto wrong_after = [&](const std::function<void()>& exchange) {
    out.zero();
    exchange();
    const Tensor got = out.to(Memory::host);
    std::uint64_t bad = 0;
    for (int q = 0; q < N; ++q)
      for (std::int64_t i = 0; i < block; ++i)
        bad += got[q * block + i] != static_cast<float>(q * 1000003 + r * block + i);
    return bad;
  };
  auto native = [&] { comm.alltoall(in, out); };
  // From scratch: step k = 1..N-1, send my block for rank r+k, receive rank r-k's block.
  auto pairwise = [&] {
    out.slice(r * block, block).copy_from(in.slice(r * block, block));
    for (int k = 1; k < N; ++k) {
      const int to = (r + k) % N, from = (r - k + N) % N;
      comm.sendrecv(in.slice(to * block, block), to, out.slice(from * block, block), from, 70 + k);
    }
  };
  const double bus = (N - 1.0) / N;
  std::vector<bench::Case> cases = {
      {std::string(comm.backend()) + "_alltoall", prepare, native, [&] { return wrong_after(native); }, bus},
      {"pairwise", prepare, pairwise, [&] { return wrong_after(pairwise); }, bus},
  };
  bench::Config config;
  config.title = "all-to-all, " + std::to_string(N) + " ranks (" + std::string(comm.backend()) +
                 "): busbw = algbw x (N-1)/N";
  config.redop = "none";
  config.iterations = 10;
  config.warmup = 2;
  config.csv_name = "07_moe_alltoall_" + std::string(comm.backend());  // a file per backend
  config.json_key = "alltoall";
  const auto sizes = bench::sweep(1u << 20, static_cast<std::uint64_t>(s.max_mib) << 20, 4, 4);
  std::vector<std::int64_t> counts;
  for (auto n : sizes) counts.push_back(n / N * N);
  bench::run(ctx, config, cases, counts);
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch07_moe", "Chapter 07: Mixture-of-Experts - routing, capacity, and expert parallelism's all-to-all");
  Settings s;
  auto& cli = program.cli();
  MoeConfig& c = s.moe;
  cli.add_option("--tokens", c.tokens, "tokens T, all ranks together")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  cli.add_option("--hidden", c.hidden, "width d of a token")->check(CLI::Range(1, 4096))->capture_default_str();
  cli.add_option("--ffn", c.ffn, "hidden width h of an expert")->check(CLI::Range(1, 16384))->capture_default_str();
  cli.add_option("--experts", c.experts, "experts E (a multiple of the ranks)")->check(CLI::Range(1, 1024))->capture_default_str();
  cli.add_option("--top-k", c.k, "experts per token k (1 Switch, 2 GShard)")->check(CLI::Range(1, 1024))->capture_default_str();
  cli.add_option("--capacity-factor", c.capacity_factor, "C = ceil(k T / E x this)")
      ->check(cli::between(1e-6, 1e6))
      ->capture_default_str();
  cli.add_option("--aux-alpha", c.aux_alpha, "weight alpha of the load-balancing loss")
      ->check(cli::between(0.0, 1e3))
      ->capture_default_str();
  cli.add_option("--train", s.train, "train the router for this many steps, with and without the aux loss")
      ->check(CLI::Range(1, 100000));
  cli.add_option("--lr", s.lr, "training: Adam's learning rate")->check(cli::between(1e-9, 1.0))->capture_default_str();
  cli.add_flag("--csv", s.csv, "training: write tokens per expert and dropped choices as CSV");
  cli.add_flag("--benchmark", s.benchmark, "time the all-to-all, nccl-tests style (CSV)");
  cli.add_option("--max-mib", s.max_mib, "benchmark: largest size, MiB (from 1, x4)")->check(CLI::Range(1, 4096))->capture_default_str();

  program.validate([&](const Options& o) {
    c.seed = o.seed;
    s.alpha_given = cli.count("--aux-alpha") > 0;
    if (s.train && s.alpha_given && c.aux_alpha == 0)
      throw UsageError("--train compares training without the aux loss and with it: --aux-alpha must be above 0");
    if (c.k > c.experts)
      throw UsageError("--top-k " + std::to_string(c.k) + " is more than the " + std::to_string(c.experts) + " experts");
    const int ranks = o.backend == "mpi" ? 0 : o.ranks;  // under mpirun: checked when the ranks start
    if (ranks && c.experts % ranks != 0)
      throw UsageError("--experts " + std::to_string(c.experts) + " cannot be shared out evenly over " +
                       std::to_string(ranks) + " ranks: use a multiple of " + std::to_string(ranks));
    if (ranks && c.tokens < ranks)
      throw UsageError("--tokens " + std::to_string(c.tokens) + " cannot give " + std::to_string(ranks) + " ranks one each");
    if (s.benchmark && (s.train || s.csv))
      throw UsageError("--benchmark times the all-to-all alone: drop --train and --csv");
    if (s.csv && !s.train) throw UsageError("--csv writes the training's curves: add --train STEPS");
  });
  program.memory_estimate([&](const Options& o) {
    const double ranks = o.backend == "threads" || o.backend == "auto" ? o.ranks : 1;
    if (s.benchmark) return ranks * 4.0 * 4 * (static_cast<double>(s.max_mib) * (1 << 20));
    const double T = c.tokens, d = c.hidden, h = c.ffn, E = c.experts, k = c.k;
    const double per = 4.0 * (40 * T * d + 4 * T * E + 6 * E * d * h + 8 * k * T * (d + h));
    return ranks * per * 2;
  });
  program.writes_csv([&] { return s.benchmark || s.csv; });
  program.supports_cuda();

  return program.run(argc, argv, [&](Context& ctx) {
    ctx.json()["chapter"] = "07_moe";
    if (c.experts % ctx.size() != 0)
      throw UsageError("--experts " + std::to_string(c.experts) + " cannot be shared out evenly over " +
                       std::to_string(ctx.size()) + " ranks");
    if (c.tokens < ctx.size() && !s.benchmark)
      throw UsageError("--tokens " + std::to_string(c.tokens) + " cannot give " + std::to_string(ctx.size()) +
                       " ranks one each");
    if (s.benchmark) return benchmark(ctx, s);
    if (s.train) return training(ctx, s);
    layer(ctx, s);
  });
}
