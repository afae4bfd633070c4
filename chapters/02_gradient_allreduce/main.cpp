// Chapter 02 — gradient AllReduce: data-parallel training that stays in sync.
//
// The course's point (so-large-lm ch. 8 §3 "数据并行 / 关键问题——梯度同步"; CS336 lecture
// 7 §3.1-3.2): with the batch split across devices, each device computes a different
// dL/dw. If each replica steps on its own gradient the replicas drift apart; so data
// parallelism allreduces the gradients every step, and then every replica takes the
// same step the single device would have taken on the whole batch.
//
// The program trains the toy MLP (Linear -> tanh -> Linear, shardlab/toy.hpp) with SGD,
// the global batch split across the ranks (unevenly when it must be), the gradients synced
// by ch02::GradSync (grad_sync.hpp), and prints: the loss curve, how far the replicas
// drift apart and from a single device on the full batch, and the allreduce traffic.
//
//   --sync none         each replica steps on its own gradient: watch them drift
//   --sync allreduce    one allreduce per parameter tensor (default)
//   --sync bucketed     one allreduce per bucket of <= --bucket-kb of gradients (a range of
//                       the flat gradient buffer, averaged in place)
//   --sync overlap      each bucket's allreduce started (non-blocking) as soon as backward
//                       has its gradients, waited for before the update
//   --accum-steps k     k micro-batches per step, one sync per step
//   --benchmark         every sync mode and a sweep of bucket sizes, as CSV
//
// Run:
//   build/default/bin/ch02_gradient_allreduce --ranks 4
//   build/default/bin/ch02_gradient_allreduce --ranks 3 --sync none
//   mpirun -np 3 build/default/bin/ch02_gradient_allreduce --sync overlap
//   build/default/bin/ch02_gradient_allreduce --benchmark --ranks 2 --in 1024
//       --hidden 4096 --batch 4 --steps 20 --csv-dir results
//
// Expected: with any sync other than none, replica divergence 0 (bitwise identical), the
// final weights within 1e-6 (relative) of the single-device run, and 2(N-1)/N x G bytes
// sent per rank per step (exactly 2(N-1) x G over all ranks).
#include <algorithm>
#include <nlohmann/json.hpp>

#include "shardlab/cli.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/results.hpp"
#include "trainer.hpp"

using namespace shardlab;
using ch02::Config;
using ch02::Sync;

namespace {

// The final weights may differ from the single-device CPU run by this much, relative to
// the largest weight. Not 0: splitting the batch changes the order in which the per-row
// gradient contributions are added, and float addition is not associative. On a GPU,
// cuBLAS also sums in its own order and fuses multiply-adds, and tanhf is within 2 ulp of
// the CPU's: 1e-5 there (a bound not yet measured on hardware).
constexpr double cpu_relative_tolerance = 1e-6;
constexpr double gpu_relative_tolerance = 1e-5;

// ---------------------------------------------------------------------------
// Benchmark: every sync mode, and a sweep of bucket sizes, as CSV rows.

void benchmark(Context& ctx, const Config& base) {
  Communicator& comm = ctx.comm();
  struct Run {
    Sync sync;
    double bucket_kb;
    const char* plan;  // what the bucket size makes of this model's gradients
  };
  // Bucket sizes that make the four different plans this model has (gradients walked
  // last to first: b2, W2, b1, W1): every tensor alone; layer 2's together (so overlap can
  // start them before layer 1's backward); all but W1; one bucket for all.
  const double H = static_cast<double>(base.hidden), I = static_cast<double>(base.in);
  const double alone = 4.0 / 1024, layer2 = 4.0 * (1 + H) / 1024, but_w1 = 4.0 * (1 + 2 * H) / 1024,
               all = 4.0 * (1 + 2 * H + I * H) / 1024;
  const Run plans[] = {{Sync::bucketed, alone, "[b2] [W2] [b1] [W1]"},
                       {Sync::bucketed, layer2, "[b2 W2] [b1] [W1]"},
                       {Sync::bucketed, but_w1, "[b2 W2 b1] [W1]"},
                       {Sync::bucketed, all, "[b2 W2 b1 W1]"}};
  std::vector<Run> runs = {{Sync::none, 0, ""}, {Sync::allreduce, 0, "per tensor"}};
  for (const Run& r : plans) runs.push_back(r);
  for (const Run& r : {plans[0], plans[1]}) runs.push_back({Sync::overlap, r.bucket_kb, r.plan});
  {
    // Warm-up, untimed: the first run would otherwise pay for the first touches of memory.
    Config warm = base;
    warm.steps = 2;
    ch02::Model model(warm);
    (void)ch02::train(comm, warm, model);
  }
  // step = making the batch + compute (forward, backward, update) + waiting on communication
  Table table({"sync", "plan", "ranks", "bucket_kb", "accum_steps", "grad_bytes", "buckets",
               "step_ms", "batch_ms", "compute_ms", "comm_wait_ms", "allreduce_calls_per_step",
               "bytes_sent_per_rank_per_step", "backend", "steps", "machine"});
  for (const Run& run : runs) {
    Config cfg = base;
    cfg.sync = run.sync;
    cfg.bucket_kb = run.bucket_kb > 0 ? run.bucket_kb : base.bucket_kb;
    ch02::Model model(cfg);
    const ch02::Trace t = ch02::train(comm, cfg, model);
    const double n = cfg.steps;
    // The slowest rank sets the pace of a synchronous step: its step, split into making
    // the batch, computing and waiting (which add up to its step time).
    const std::vector<double> steps = comm.gather_values(t.step_s);
    const auto slowest =
        static_cast<std::size_t>(std::max_element(steps.begin(), steps.end()) - steps.begin());
    auto ms = [&](double mine) { return comm.gather_values(mine)[slowest] / n * 1e3; };
    table.add({std::string(ch02::sync_name(run.sync)), run.plan, ctx.size(),
               run.bucket_kb > 0 ? Cell(run.bucket_kb) : Cell(""), cfg.accum_steps,
               model.store.size() * 4, t.buckets, ms(t.step_s), ms(t.batch_s), ms(t.compute_s),
               ms(t.comm_wait_s), static_cast<double>(t.allreduce.calls) / n,
               static_cast<double>(t.allreduce.bytes_sent) / n, std::string(comm.backend()),
               cfg.steps, machine_description()});
  }
  ctx.report(table, "benchmark", "ms per step, slowest rank");
  ctx.save_csv(table, "02_gradient_allreduce");
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch02_gradient_allreduce",
                  "Chapter 02: data-parallel training kept in sync by gradient allreduce");
  Config cfg;
  std::string sync = "allreduce";
  bool bench = false;
  program.supports_cuda();
  auto& cli = program.cli();
  for (CLI::Option* option :
       {cli.add_option("--sync", sync, "none, allreduce, bucketed or overlap")
            ->check(CLI::IsMember({"none", "allreduce", "bucketed", "overlap"})),
        cli.add_option("--steps", cfg.steps, "training steps")
            ->check(shardlab::cli::whole(1, 1000000)),
        cli.add_option("--batch", cfg.batch, "global batch B, split across the ranks")
            ->check(shardlab::cli::whole(1, 1 << 20)),
        cli.add_option("--bucket-kb", cfg.bucket_kb, "bucket capacity in KiB (bucketed, overlap)")
            ->check(cli::between(0.001, 1048576.0)),
        cli.add_option("--accum-steps", cfg.accum_steps, "micro-batches per step, one sync")
            ->check(shardlab::cli::whole(1, 4096)),
        cli.add_option("--lr", cfg.lr, "SGD learning rate")->check(cli::between(0.0, 10.0)),
        cli.add_option("--in", cfg.in, "input features I")->check(shardlab::cli::whole(1, 65536)),
        cli.add_option("--hidden", cfg.hidden, "hidden units H")
            ->check(shardlab::cli::whole(1, 65536))})
    option->capture_default_str();
  cli.add_flag("--benchmark", bench, "time every sync mode and bucket size, write CSV");
  // The ranks of a threads job share this machine (trainer.hpp says what a rank holds).
  program.memory_estimate([&](const Options& o) {
    return ch02::bytes_per_rank(cfg) *
           (o.backend == "threads" || o.backend == "auto" ? o.ranks : 1);
  });
  program.writes_csv([&] { return bench; });
  // Settled once, before the ranks start: every rank reads cfg, none writes it.
  program.validate([&](const Options& o) {
    cfg.sync = ch02::parse_sync(sync);
    cfg.seed = o.seed;
    cfg.memory = o.device == "cuda" ? Memory::device : Memory::host;
  });

  return program.run(argc, argv, [&](Context& ctx) {
    Communicator& comm = ctx.comm();
    const int P = ctx.size();
    nlohmann::json& json = ctx.json();
    json["chapter"] = "02_gradient_allreduce";
    if (bench) return benchmark(ctx, cfg);
    ctx.say("Chapter 02 - data-parallel SGD on " + std::to_string(P) +
            (P > 1 ? " ranks (" : " rank (") + std::string(comm.backend()) + "), --sync " + sync +
            ": " + ch02::describe(cfg));
    const ShardRange mine = shard_range(cfg.batch, P, ctx.rank());
    ctx.say_each(mine.length == 0 ? "batch rows none"
                                  : "batch rows " + std::to_string(mine.offset) + "-" +
                                        std::to_string(mine.offset + mine.length - 1));

    // 1. The single-device reference on the full batch, on the CPU (every rank can afford it).
    Config host_cfg = cfg;
    host_cfg.memory = Memory::host;
    ch02::Model single(host_cfg);
    const ch02::Trace reference = ch02::train_single_device(host_cfg, single);

    // 2. The distributed run; after each of the first steps, how far apart are the replicas?
    ch02::Model model(cfg);
    auto weights = [&] { return model.store.values().to(Memory::host); };
    std::vector<double> apart;
    const ch02::Trace trace = ch02::train(comm, cfg, model, [&](int step) {
      if (step < 5 || step == cfg.steps - 1) apart.push_back(replica_divergence(comm, weights()));
    });
    Table curve({"step", "loss", "single_device_loss", "replicas_differ_by"});
    for (std::size_t k = 0; k < apart.size(); ++k) {
      const std::size_t s = k < 5 ? k : trace.losses.size() - 1;
      curve.add({s + 1, trace.losses[s], reference.losses[s], apart[k]});
    }
    ctx.report(curve, "loss_curve", "\nThe loss (distributed, single device) after each step");

    // 3. The comparison. Did training itself blow up? Then no comparison of weights means
    // anything: say so once, with the step it happened at. Else: the replicas with each
    // other (identical), then with the single device (within the tolerance).
    const bool synced = cfg.sync != Sync::none;
    const double tolerance = ctx.on_gpu() ? gpu_relative_tolerance : cpu_relative_tolerance;
    const std::string blew_up = ch02::divergence_failure(reference, trace, cfg.lr);
    ctx.verify(blew_up.empty(), blew_up);
    const bool compare = synced && blew_up.empty();
    const Tensor w = weights();
    const double divergence =
        compare ? ctx.verify_replicas("weights", w) : replica_divergence(comm, w);
    const double weights_diff = comm.agree(max_abs_diff(w, single.store.values()), ReduceOp::max) /
                                std::max(max_abs(single.store.values()), 1e-30);
    if (compare)
      ctx.verify_close("the weights (max |w - w_single| / max |w_single|)", weights_diff, tolerance,
                       "the single device's on the full batch");
    Table result({"sync", "replica_max_divergence", "vs_single_device_max_rel_diff",
                  "relative_tolerance", "loss_curve_max_rel_diff", "diverged_at_step"});
    result.add({sync, divergence, weights_diff, synced ? Cell(tolerance) : Cell("none"),
                ch02::loss_curve_diff(reference, trace), ch02::diverged_at(reference.losses)});
    ctx.report(result, "result",
               synced ? "\nThe replicas against each other (must be 0) and against one device"
                      : "\nNo sync: each replica followed its own gradient");

    // 4. The traffic, measured next to its formula. Ring-shaped allreduce: each rank sends
    // 2(N-1)/N of the G gradient bytes per step; over all ranks exactly 2(N-1) G, however
    // the chunks divide. The wait and compute times are there to look at, not to compare.
    const std::int64_t G = model.store.size() * 4;
    const double n = cfg.steps;
    const auto sent = comm.gather_values(static_cast<std::int64_t>(trace.allreduce.bytes_sent));
    const auto calls = comm.gather_values(static_cast<std::int64_t>(trace.allreduce.calls));
    const auto compute_s = comm.gather_values(trace.compute_s);
    const auto wait_s = comm.gather_values(trace.comm_wait_s);
    const bool modeled = trace.allreduce.calls && comm.stats().is_modeled(Op::allreduce);
    Table traffic({"rank", "allreduce_calls_per_step", "bytes_sent_per_step",
                   "formula_bytes_per_step", "traffic_modeled", "compute_ms", "comm_wait_ms"});
    auto per_step = [&](std::int64_t total) {  // every step sends the same: whole bytes
      return total % cfg.steps ? Cell(static_cast<double>(total) / n) : Cell(total / cfg.steps);
    };
    std::int64_t sent_total = 0;
    for (int q = 0; q < P; ++q) {
      const auto i = static_cast<std::size_t>(q);
      sent_total += sent[i];
      traffic.add({q, per_step(calls[i]), per_step(sent[i]),
                   synced ? 2.0 * (P - 1) / P * static_cast<double>(G) : 0.0, modeled,
                   compute_s[i] * 1e3, wait_s[i] * 1e3});
    }
    const std::int64_t formula_total = synced ? 2 * (P - 1) * G * cfg.steps : 0;
    traffic.add({"all", per_step(calls[0]), per_step(sent_total), per_step(formula_total), modeled,
                 *std::max_element(compute_s.begin(), compute_s.end()) * 1e3,
                 *std::max_element(wait_s.begin(), wait_s.end()) * 1e3});
    ctx.report(
        traffic, "traffic",
        "\nAllreduce per step: each rank against 2(N-1)/N x G, all against 2(N-1) x G (G = " +
            std::to_string(G) + " gradient bytes)\ncompute and wait: totals over the " +
            "steps (all: the slowest rank's)" +
            (modeled ? "\n(modeled: " + std::string(comm.backend()) +
                           " hides its algorithm; this is the formula's count)"
                     : ""));
    ctx.verify(sent_total == formula_total, "allreduce sent " + std::to_string(sent_total) +
                                                " bytes over all ranks, formula says " +
                                                std::to_string(formula_total));
    json["gradient_bytes"] = G;
    json["losses"] = trace.losses;
  });
}
