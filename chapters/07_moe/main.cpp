// Chapter 07 — Mixture-of-Experts with expert parallelism: routing, capacity, and the
// all-to-all.
//
// The course (so-large-lm, the distributed-training walk-through's §7 "专家并行"; CS336
// lecture 7 §4.3): a Mixture-of-Experts layer activates only a few experts per token, so
// the experts can live on different devices — expert parallelism — combined with data
// parallelism. The parameters grow with the number of experts; the compute per token does
// not. This chapter's layer (moe.hpp, an nn layer any model can hold): a softmax router,
// top-k routing (k = 1 Switch, k = 2 GShard) with an expert capacity and dropped tokens,
// the load-balancing loss, small MLP experts. Rank q holds E/N experts and T/N tokens; the
// tokens travel to their experts in an all-to-all and back in another, forward and
// backward, and every result is compared with the same layer on one device.
//
// Run:
//   build/default/bin/ch07_moe                                   2 ranks, 8 experts, k = 2
//   build/default/bin/ch07_moe --ranks 4 --top-k 1 --capacity-factor 1.0
//   build/default/bin/ch07_moe --ranks 4 --train 200 --csv --csv-dir results
//   build/default/bin/ch07_moe --ranks 4 --benchmark --csv-dir results
//   mpirun -np 4 build/default/bin/ch07_moe --benchmark --csv-dir results   (MPI's alltoall)
//
// Expected: the expert-parallel layer equals the one-device one (on the CPU bit for bit but
// the router's gradient, to rounding); the all-to-all moves the rows the routing sends.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "moe.hpp"
#include "shardlab/bench.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/launch.hpp"

using namespace shardlab;
using namespace ch07;

namespace {

struct Settings {
  MoeConfig moe;
  int train = 0, max_mib = 64;
  float lr = 1e-2f;
  bool csv = false, benchmark = false, alpha_given = false;
};

void layer(Context& ctx, const Settings& s) {
  Communicator& comm = ctx.comm();
  const MoeConfig& c = s.moe;
  const int N = ctx.size();
  const ShardRange mine = shard_range(c.tokens, N, ctx.rank());
  // Every token and its gradient, drawn alike for every rank count; this rank's share.
  const Tensor all_x = randn(Shape{c.tokens, c.hidden}, c.seed * 7919 + 11);
  const Tensor all_dy = scale(randn(Shape{c.tokens, c.hidden}, c.seed * 7919 + 12), 0.1f);

  // 1. The reference: the same layer on one device, every token, each rank's tokens routed
  // as that rank routes them (each rank computes it).
  const Weights all = make_weights(c, 0, c.experts);
  const Result ref = moe_reference(c, all, all_x, all_dy, N);

  // 2. Expert parallel: this rank's E/N experts and T/N tokens, an nn layer over `comm`.
  nn::ParameterStore store;
  MoeLayer moe(store, comm, c);
  store.allocate(ctx.memory());
  const CommStats before = comm.stats();
  nn::Forward f = moe.forward(all_x.slice(mine.offset, mine.length));
  const RoutingStats st = combined(comm, moe.stats(f.saved));  // every rank's tokens
  const Tensor dx = moe.backward(all_dy.slice(mine.offset, mine.length).to(ctx.memory()), f.saved);
  const CommStats moved = comm.stats().since(before);

  std::string capacities;  // C of each rank, from its own tokens
  for (int q = 0; q < N; ++q) capacities += (q ? " " : "") + std::to_string(c.capacity(q, N));
  Table routed({"capacity_per_rank", "even_router_capacity", "dropped_tokens", "of_choices",
                "passed_through_tokens", "aux_loss", "balanced_aux_loss"});
  routed.add({capacities, static_cast<double>(c.k) * c.tokens / (N * c.experts), st.dropped,
              c.k * c.tokens, st.passed_through, st.aux_loss, c.aux_alpha});
  ctx.report(routed, "routing",
             "Chapter 07 - a Mixture-of-Experts layer on " + std::to_string(N) + " ranks (" +
                 std::string(comm.backend()) + "): " + describe(c) +
                 "\n\neach rank routes its own T_r tokens: capacity C = ceil(k T_r / E x capacity "
                 "factor) per expert and rank; dropped: choices (tokens for k = 1); aux loss "
                 "alpha E sum f_i P_i, each rank's, weighted by T_r / T");
  Table experts({"expert", "wanted", "kept", "dropped", "load"});
  int most = std::ranges::max(st.wanted);
  for (int q = 0; q < N; ++q) most = std::max(most, N * c.capacity(q, N));
  for (std::size_t e = 0; e < st.kept.size(); ++e)
    experts.add({e, st.wanted[e], st.kept[e], st.wanted[e] - st.kept[e], bar(st.kept[e], most)});
  ctx.report(experts, "experts",
             "\ntokens per expert, every rank's (an expert full for a rank drops the rest of "
             "that rank's)");

  // 3. The comparison. On the CPU both sides add the same numbers in the same order: bit
  // for bit, except the router's gradient, summed over the ranks: another order of the
  // same T terms (Higham's bound). On a GPU, cuBLAS's order: the bounds `tolerance` derives.
  const Tolerance tol = tolerance(c, all, all_x, all_dy, ref, ctx.on_gpu());
  Table vs({"what", "max_abs_diff", "tolerance", "largest"});
  auto compare = [&](const std::string& what, double diff, double tolerance, const Tensor& want) {
    vs.add({what, ctx.verify_close(what, diff, tolerance), tolerance, max_abs(want)});
  };
  const Tensor y = f.out.to(Memory::host);
  compare("outputs y", max_abs_diff(y, ref.y.slice(mine.offset, mine.length)), tol.y, ref.y);
  compare("dL/dx", max_abs_diff(dx.to(Memory::host), ref.dx.slice(mine.offset, mine.length)),
          tol.dx, ref.dx);
  compare("dL/dWrouter", max_abs_diff(moe.router().grad.to(Memory::host), ref.drouter), tol.drouter,
          ref.drouter);
  compare("dL/dW of the experts", moe.expert_grad_diff(ref), tol.dw, ref.dw1[0]);
  ctx.report(vs, "vs_one_device", "\nexpert parallel vs one device, every token");

  // 4. The all-to-alls, measured next to what the one-device routing sends across ranks.
  const auto received =
      comm.gather_values(static_cast<std::int64_t>(moved[Op::alltoall].bytes_received));
  const auto formula = comm.gather_values(
      static_cast<std::int64_t>(formula_alltoall_bytes(ref.routings, ctx.rank(), N, c.hidden)));
  const double even = even_router_alltoall_bytes(c, N);
  Table bytes({"rank", "alltoall_bytes_received", "formula", "even_router", "traffic_modeled"});
  for (std::size_t q = 0; q < received.size(); ++q)
    bytes.add({q, received[q], formula[q], even, moved.is_modeled(Op::alltoall)});
  ctx.report(bytes, "alltoall",
             "\nall-to-all bytes received per rank, forward and backward; formula: rows that "
             "cross ranks x d x 4 x 2, and the counts (N-1) E/N x 8; even router: 4 x k T/N x "
             "(N-1)/N x d x 4 and the counts");
  ctx.verify(received == formula,
             "the all-to-all moved other than the rows the routing sends to other ranks");
  ctx.json()["output_max_abs_diff"] = vs.at(0, 1).number();
}

// ---------------------------------------------------------------------------
// Training: the router learns, with and without the auxiliary loss

void training(Context& ctx, const Settings& s) {
  MoeConfig with = s.moe, without = s.moe;
  // Switch's 0.01 suits long runs of large models; a few hundred steps here need more.
  with.aux_alpha = s.alpha_given ? s.moe.aux_alpha : 0.1;
  without.aux_alpha = 0;
  const TrainSettings settings{.steps = s.train, .lr = s.lr, .memory = ctx.memory()};
  const std::vector<std::pair<std::string, TrainRun>> runs = {
      {"without", train(ctx.comm(), without, settings)},
      {"with", train(ctx.comm(), with, settings)}};
  ctx.say("Chapter 07 - training the router, " + std::to_string(s.train) + " steps of Adam (lr " +
          format_number(s.lr) + ") from a router whose first choice is expert 0; capacity " +
          std::to_string(s.moe.capacity(0, ctx.size())) + " per expert and rank; aux loss alpha " +
          format_number(with.aux_alpha));
  Table tokens({"aux", "expert", "step_1", "load_1", "last_step", "load_last"});
  Table summary(
      {"aux", "dropped_fraction_step_1", "dropped_fraction_last", "loss_step_1", "loss_last"});
  for (const auto& [aux, run] : runs) {
    const auto &first = run.kept.front(), &last = run.kept.back();
    const int most = std::max(std::ranges::max(first), std::ranges::max(last));
    for (std::size_t e = 0; e < first.size(); ++e)
      tokens.add({aux, e, first[e], bar(first[e], most, 20), last[e], bar(last[e], most, 20)});
    summary.add({aux, run.dropped_fraction.front(), run.dropped_fraction.back(), run.loss.front(),
                 run.loss.back()});
  }
  ctx.report(tokens, "tokens_per_expert", "\ntokens per expert at step 1 and the last step");
  ctx.report(summary, "training", "\ndropped choices and the task's loss");
  if (!s.csv) return;
  Table steps({"step", "aux", "expert", "tokens", "dropped_fraction", "loss"});
  for (const auto& [aux, run] : runs)
    for (std::size_t t = 0; t < run.kept.size(); ++t)
      for (std::size_t e = 0; e < run.kept[t].size(); ++e)
        steps.add({t + 1, aux, e, run.kept[t][e], run.dropped_fraction[t], run.loss[t]});
  ctx.save_csv(steps, "07_moe_training");
  // Dropped choices against the capacity factor: both trained routers, an unseen batch.
  Table drops({"capacity_factor", "capacity", "aux", "dropped_fraction"});
  const ShardRange mine = shard_range(s.moe.tokens, ctx.size(), ctx.rank());
  const Tensor x = leaning_batch(s.moe, 1000000).x.slice(mine.offset, mine.length);
  for (double factor : {0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0}) {
    MoeConfig at = s.moe;
    at.capacity_factor = factor;
    for (const auto& [aux, run] : runs) {
      const Result r = moe_parallel(ctx.comm(), at, run.weights, x, {}, ctx.memory());
      drops.add({factor, at.capacity(0, ctx.size()), aux,
                 static_cast<double>(r.stats.dropped) / (at.k * at.tokens)});
    }
  }
  ctx.save_csv(drops, "07_moe_capacity");
}

// ---------------------------------------------------------------------------
// Benchmark: the all-to-all, nccl-tests style: the backend's and the pairwise exchange

void benchmark(Context& ctx, const Settings& s) {
  const int N = ctx.size();
  const std::string backend(ctx.comm().backend());
  bench::Config config;
  config.title =
      "all-to-all, " + std::to_string(N) + " ranks (" + backend + "): busbw = algbw x (N-1)/N";
  config.redop = "none";
  config.iterations = 10;
  config.warmup = 2;
  config.csv_name = "07_moe_alltoall_" + backend;  // a file per backend
  config.json_key = "alltoall";
  std::vector<std::int64_t> sizes;  // a multiple of N elements, from 1 MiB, x4
  for (auto n : bench::sweep(1u << 20, static_cast<std::uint64_t>(s.max_mib) << 20, 4, 4))
    sizes.push_back(n / N * N);
  bench::run(ctx, config, alltoall_cases(ctx.comm(), ctx.memory()), sizes);
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch07_moe", "Chapter 07: Mixture-of-Experts and expert parallelism's all-to-all");
  Settings s;
  auto& cli = program.cli();
  MoeConfig& c = s.moe;
  cli::option(cli, "--tokens", c.tokens, "tokens T, all ranks together", cli::whole(1, 1 << 16));
  cli::option(cli, "--hidden", c.hidden, "width d of a token", cli::whole(1, 4096));
  cli::option(cli, "--ffn", c.ffn, "hidden width h of an expert", cli::whole(1, 16384));
  cli::option(cli, "--experts", c.experts, "experts E (a multiple of the ranks)",
              cli::whole(1, 1024));
  cli::option(cli, "--top-k", c.k, "experts per token k (1 Switch, 2 GShard)", cli::whole(1, 1024));
  cli::option(cli, "--capacity-factor", c.capacity_factor, "C = ceil(k T/E x this)",
              cli::between(1e-6, 1e6));
  cli::option(cli, "--aux-alpha", c.aux_alpha, "weight of the load-balancing loss",
              cli::between(0.0, 1e3));
  cli::option(cli, "--train", s.train, "train this many steps, with/without aux loss",
              cli::whole(1, 100000));
  cli::option(cli, "--lr", s.lr, "training: Adam's learning rate", cli::between(1e-9, 1.0));
  cli.add_flag("--csv", s.csv, "training: write tokens per expert and dropped choices as CSV");
  cli.add_flag("--benchmark", s.benchmark, "time the all-to-all, nccl-tests style (CSV)");
  cli::option(cli, "--max-mib", s.max_mib, "benchmark: largest size, MiB (from 1, x4)",
              cli::whole(1, 4096));

  program.validate([&](const Options& o) {
    c.seed = o.seed;
    s.alpha_given = cli.count("--aux-alpha") > 0;
    require_usage(!(s.train && s.alpha_given && c.aux_alpha == 0),
                  "--train compares training without the aux loss and with: --aux-alpha > 0");
    require_usage(c.k <= c.experts,
                  "--top-k must be at most the " + std::to_string(c.experts) + " experts");
    require_usage(!(s.benchmark && (s.train || s.csv)),
                  "--benchmark times the all-to-all alone: drop --train and --csv");
    require_usage(!s.csv || s.train, "--csv writes the training's curves: add --train STEPS");
  });
  program.world_size([&](const Options&, int ranks) {
    const std::string N = std::to_string(ranks);
    require_usage(c.experts % ranks == 0, "--experts must be a multiple of the " + N + " ranks");
    require_usage(c.tokens >= ranks, "--tokens must be at least the " + N + " ranks (one each)");
  });
  program.memory_estimate([&](const Options& o) {
    const double ranks = o.backend == "threads" || o.backend == "auto" ? o.ranks : 1;
    // Benchmark: ~6 buffers of the largest size a rank, + 32 MiB (measured 1.5 GB: 4 x 64 MiB)
    if (s.benchmark) return ranks * (6.0 * s.max_mib + 32) * (1 << 20);
    return layer_run_bytes(c, static_cast<int>(ranks));
  });
  program.writes_csv([&] { return s.benchmark || s.csv; });
  program.supports_cuda();

  return program.run(argc, argv, [&](Context& ctx) {
    ctx.json()["chapter"] = "07_moe";
    if (s.benchmark) return benchmark(ctx, s);
    if (s.train) return training(ctx, s);
    layer(ctx, s);
  });
}
