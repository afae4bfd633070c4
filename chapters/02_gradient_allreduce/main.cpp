// Chapter 02 — gradient AllReduce: data-parallel training that stays in sync.
//
// The course's point (so-large-lm ch. 8 §3 "数据并行 / 关键问题——梯度同步"; CS336 lecture
// 7 §3.1-3.2): with the batch split across devices, each device computes a different
// dL/dw. If each replica steps on its own gradient the replicas drift apart; so data
// parallelism allreduces the gradients every step, and then every replica takes the
// same step the single device would have taken on the whole batch.
//
// The program trains a 2-layer MLP (Linear -> tanh -> Linear) with SGD on a seeded
// regression task, the global batch split across the ranks (unevenly when it must be),
// and prints: the replicas' divergence, the distance to a single-device run on the full
// batch, the loss curve, and the allreduce traffic per step next to its formula.
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
// Expected: with any sync other than none, replica divergence 0 (bitwise identical) and
// the final weights within 1e-6 (relative) of the single-device run.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

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

/// max over ranks of max |w_r - w_0| over all parameters (uncounted): one broadcast of
/// the flat parameter buffer.
double replica_divergence(Communicator& comm, ch02::Mlp& model) {
  Communicator::Uncounted quiet(comm);
  const Tensor mine = model.store().values().to(Memory::host);
  Tensor rank0 = mine.clone();
  comm.broadcast(rank0, 0);
  return comm.agree(max_abs_diff(mine, rank0), ReduceOp::max);
}

struct Distance {
  double max_abs = 0;  // max |w - w_single| over all parameters
  double max_rel = 0;  // max_abs / max |w_single| over all parameters
};
/// How far this rank's weights are from the single-device run's (worst over ranks).
Distance distance(Communicator& comm, ch02::Mlp& model, ch02::Mlp& single) {
  const Tensor mine = model.store().values().to(Memory::host);
  const Tensor& ref = single.store().values();
  Distance d;
  d.max_abs = comm.agree(max_abs_diff(mine, ref), ReduceOp::max);
  d.max_rel = d.max_abs / std::max(max_abs(ref), 1e-30);
  return d;
}

/// The first step (from 1) whose loss is not finite or has grown past 100 times the first
/// step's: training blew up. 0 when it did not.
int diverged_at(const std::vector<double>& losses) {
  for (std::size_t s = 0; s < losses.size(); ++s)
    if (!std::isfinite(losses[s]) || losses[s] > 100.0 * losses.front())
      return static_cast<int>(s) + 1;
  return 0;
}

std::int64_t gradient_elements(const Config& cfg) {
  return cfg.in * cfg.hidden + cfg.hidden + cfg.hidden + 1;
}

// ---------------------------------------------------------------------------
// Benchmark: every sync mode, and a sweep of bucket sizes, as CSV rows.

void benchmark(Context& ctx, const Config& base) {
  Communicator& comm = ctx.comm();
  // step = making the batch + compute (forward, backward, update) + waiting on communication
  CsvTable table({"sync", "plan", "ranks", "bucket_kb", "accum_steps", "grad_bytes", "buckets",
                  "step_ms", "batch_ms", "compute_ms", "comm_wait_ms", "allreduce_calls_per_step",
                  "bytes_sent_per_rank_per_step", "backend", "steps", "machine"});
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
    ch02::Mlp model(warm);
    (void)ch02::train(comm, warm, model);
  }
  ctx.say(
      "sync       buckets (last to first)   bucket KiB   step ms   batch ms  compute ms  comm wait "
      "ms");
  for (const Run& run : runs) {
    Config cfg = base;
    cfg.sync = run.sync;
    cfg.bucket_kb = run.bucket_kb > 0 ? run.bucket_kb : base.bucket_kb;
    ch02::Mlp model(cfg);
    const ch02::Trace t = ch02::train(comm, cfg, model);
    const double n = cfg.steps;
    // The slowest rank sets the pace of a synchronous step: its step, split into making
    // the batch, computing and waiting (which add up to its step time).
    const std::vector<double> steps = comm.gather_values(t.step_s);
    const auto slowest =
        static_cast<std::size_t>(std::max_element(steps.begin(), steps.end()) - steps.begin());
    auto of_slowest = [&](double mine) { return comm.gather_values(mine)[slowest] / n * 1e3; };
    const double step_ms = steps[slowest] / n * 1e3;
    const double batch_ms = of_slowest(t.batch_s);
    const double compute_ms = of_slowest(t.compute_s);
    const double wait_ms = of_slowest(t.comm_wait_s);
    char line[160];
    std::snprintf(line, sizeof line, "%-10s %-24s %11s %9.3f %10.3f %11.3f %13.3f",
                  std::string(ch02::sync_name(run.sync)).c_str(), run.plan,
                  run.bucket_kb > 0 ? format_number(run.bucket_kb, 4).c_str() : "-", step_ms,
                  batch_ms, compute_ms, wait_ms);
    ctx.say(line);
    table.add({std::string(ch02::sync_name(run.sync)), run.plan, std::to_string(ctx.size()),
               run.bucket_kb > 0 ? format_number(run.bucket_kb) : "",
               std::to_string(cfg.accum_steps), std::to_string(gradient_elements(cfg) * 4),
               std::to_string(t.buckets), format_number(step_ms), format_number(batch_ms),
               format_number(compute_ms), format_number(wait_ms),
               format_number(static_cast<double>(t.allreduce.calls) / n, 12),
               format_number(static_cast<double>(t.allreduce.bytes_sent) / n, 12),
               std::string(comm.backend()), std::to_string(cfg.steps), machine_description()});
  }
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
  cli.add_option("--sync", sync, "none, allreduce, bucketed or overlap")
      ->check(CLI::IsMember({"none", "allreduce", "bucketed", "overlap"}))
      ->capture_default_str();
  cli.add_option("--steps", cfg.steps, "training steps")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  cli.add_option("--batch", cfg.batch, "global batch B, split across the ranks")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cli.add_option("--bucket-kb", cfg.bucket_kb, "bucket capacity in KiB (bucketed, overlap)")
      ->check(shardlab::cli::between(0.001, 1048576.0))
      ->capture_default_str();
  cli.add_option("--accum-steps", cfg.accum_steps, "micro-batches per step (one sync per step)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cli.add_option("--lr", cfg.lr, "SGD learning rate")
      ->check(shardlab::cli::between(0.0, 10.0))
      ->capture_default_str();
  cli.add_option("--in", cfg.in, "input features I")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  cli.add_option("--hidden", cfg.hidden, "hidden units H")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  cli.add_flag("--benchmark", bench, "time every sync mode and bucket size, write CSV");
  // Memory: every rank holds its model (parameters and gradients), the teachers and the
  // single-device reference (parameters and gradients), the weight gradient's temporary
  // and what each rank thread's allocator keeps after the reference has run: 16 times
  // the parameters measured (in = hidden = 2048), 18 here; plus a batch and its
  // activations. The ranks of a threads job share this machine.
  program.memory_estimate([&](const Options& o) {
    const double params = static_cast<double>(cfg.in) * static_cast<double>(cfg.hidden) +
                          2.0 * static_cast<double>(cfg.hidden) + 1.0;
    const double batch = static_cast<double>(cfg.batch) * (2.0 * static_cast<double>(cfg.in) +
                                                           4.0 * static_cast<double>(cfg.hidden));
    const double per_rank = 4.0 * (18.0 * params + batch);
    return per_rank * (o.backend == "threads" || o.backend == "auto" ? o.ranks : 1);
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
    const double relative_tolerance =
        ctx.on_gpu() ? gpu_relative_tolerance : cpu_relative_tolerance;
    const int P = ctx.size();
    nlohmann::json& json = ctx.json();
    json["chapter"] = "02_gradient_allreduce";
    if (bench) return benchmark(ctx, cfg);

    std::ostringstream head;
    head << "Chapter 02 - data-parallel SGD on " << P << " rank" << (P > 1 ? "s" : "") << " ("
         << comm.backend() << "), --sync " << sync << ": MLP " << cfg.in << " -> " << cfg.hidden
         << " -> 1, global batch " << cfg.batch << ", " << cfg.steps << " steps";
    if (cfg.accum_steps > 1) head << ", " << cfg.accum_steps << " micro-batches per step";
    ctx.say(head.str());
    std::ostringstream rows;
    const ShardRange mine = shard_range(cfg.batch, P, ctx.rank());
    rows << "batch rows ";
    if (mine.length == 0)
      rows << "none";
    else
      rows << mine.offset << "-" << mine.offset + mine.length - 1;
    ctx.say_each(rows.str());

    // 1. The single-device reference on the full batch, on the CPU (every rank can afford it).
    Config host_cfg = cfg;
    host_cfg.memory = Memory::host;
    ch02::Mlp single(host_cfg);
    const ch02::Trace reference = ch02::train_single_device(host_cfg, single);

    // 2. The distributed run; after each of the first steps, how far apart are the replicas?
    ch02::Mlp model(cfg);
    std::vector<double> divergence;
    const ch02::Trace trace = ch02::train(comm, cfg, model, [&](int step) {
      if (step < 5 || step == cfg.steps - 1) divergence.push_back(replica_divergence(comm, model));
    });
    const double final_divergence = divergence.back();

    std::string curve = "\nstep   loss (distributed)   loss (single device)   replicas differ by\n";
    for (int s = 0; s < cfg.steps; ++s) {
      if (s >= 5 && s != cfg.steps - 1) continue;
      if (s == cfg.steps - 1 && cfg.steps > 6) curve += " ...\n";
      const double d =
          divergence[std::min<std::size_t>(static_cast<std::size_t>(s), divergence.size() - 1)];
      char line[120];
      std::snprintf(line, sizeof line, "%4d   %18.9f   %20.9f   %s\n", s + 1,
                    trace.losses[static_cast<std::size_t>(s)],
                    reference.losses[static_cast<std::size_t>(s)], format_number(d, 3).c_str());
      curve += line;
    }
    ctx.say(curve);

    // 3. Distance to the single-device run, and the traffic.
    const Distance dist = distance(comm, model, single);
    double loss_diff = 0;
    for (std::size_t s = 0; s < trace.losses.size(); ++s)
      loss_diff = std::max(loss_diff, std::fabs(trace.losses[s] - reference.losses[s]) /
                                          std::max(1e-30, reference.losses[s]));
    if (diverged_at(trace.losses) > 0) loss_diff = std::numeric_limits<double>::infinity();

    const std::int64_t grad_bytes = gradient_elements(cfg) * 4;
    const double steps = cfg.steps;
    const auto sent = comm.gather_values(static_cast<std::int64_t>(trace.allreduce.bytes_sent));
    std::vector<double> sent_per_step;
    std::int64_t sent_total = 0;
    for (std::int64_t b : sent) {
      sent_per_step.push_back(static_cast<double>(b) / steps);
      sent_total += b;
    }
    const double calls_per_step = static_cast<double>(trace.allreduce.calls) / steps;
    const bool synced = cfg.sync != Sync::none;
    // Ring-shaped allreduce: each rank sends 2(N-1)/N of the gradient bytes per step;
    // summed over ranks exactly 2(N-1) * grad bytes, however the chunks divide.
    const double formula_per_rank =
        synced ? 2.0 * (P - 1) / P * static_cast<double>(grad_bytes) : 0.0;
    const std::int64_t formula_total = synced ? 2 * (P - 1) * grad_bytes * cfg.steps : 0;
    const double wait_s = comm.agree(trace.comm_wait_s, ReduceOp::max),
                 compute_s = comm.agree(trace.compute_s, ReduceOp::max);

    std::ostringstream out;
    out << "replicas differ by " << format_number(final_divergence, 3)
        << (synced ? (final_divergence == 0 ? " (bitwise identical)" : " (SHOULD BE 0)")
                   : " (no sync: each replica followed its own gradient)")
        << "\nvs single device on the full batch: weights max abs diff "
        << format_number(dist.max_abs, 3) << ", relative " << format_number(dist.max_rel, 3)
        << " (tolerance " << relative_tolerance << " when synced); loss curve relative diff "
        << format_number(loss_diff, 3) << "\nallreduce per step: " << format_number(calls_per_step)
        << " call(s)";
    if (trace.buckets)
      out << " (" << trace.buckets << " bucket(s) of <= " << format_number(cfg.bucket_kb)
          << " KiB)";
    const bool modeled = trace.allreduce.calls && comm.stats().is_modeled(Op::allreduce);
    out << ", bytes sent per rank (" << (modeled ? "modeled" : "measured") << "): ";
    for (std::size_t q = 0; q < sent_per_step.size(); ++q)
      out << (q ? " " : "") << format_number(sent_per_step[q]);
    if (synced)
      out << "\n  formula 2(N-1)/N x " << grad_bytes
          << " gradient bytes = " << format_number(formula_per_rank)
          << " per rank; summed over ranks: " << (modeled ? "modeled " : "measured ")
          << sent_total / cfg.steps << ", formula 2(N-1) x " << grad_bytes << " = "
          << formula_total / cfg.steps
          << (modeled ? "  [modeled: " + std::string(comm.backend()) +
                            " hides its algorithm; this is the formula's count]"
                      : "");
    else
      out << "\n  (--sync none: no gradient is exchanged, so nothing keeps the replicas together)";
    out << "\ntime (slowest rank): computing " << format_number(compute_s * 1e3, 3)
        << " ms, waiting on communication " << format_number(wait_s * 1e3, 3) << " ms";
    ctx.say(out.str());

    // Did training itself blow up? Then no comparison of weights means anything: say so
    // once, with the step it happened at.
    const int diverged = diverged_at(reference.losses);
    json["diverged_at_step"] = diverged;
    if (diverged > 0) {
      const double at = reference.losses[static_cast<std::size_t>(diverged - 1)];
      ctx.verify(false, "training diverged at step " + std::to_string(diverged) + " (loss " +
                            format_number(at, 4) + ", from " +
                            format_number(reference.losses.front(), 4) +
                            " at step 1): lower --lr (" + format_number(cfg.lr) + " is too large " +
                            "for this model)");
    } else if (const int own = diverged_at(trace.losses); own > 0) {
      // The single-device run trained; these replicas blew up: a fault in the sync.
      ctx.verify(false, "the distributed run diverged at step " + std::to_string(own) + " (loss " +
                            format_number(trace.losses[static_cast<std::size_t>(own - 1)], 4) +
                            ") while the single-device run trained");
    } else if (synced) {
      ctx.verify(final_divergence == 0,
                 "replicas are not identical after syncing: they differ by " +
                     format_number(final_divergence));
      ctx.verify(dist.max_rel <= relative_tolerance,
                 "weights differ from the single-device run by " + format_number(dist.max_rel) +
                     " relative");
      ctx.verify(sent_total == formula_total, "allreduce sent " + std::to_string(sent_total) +
                                                  " bytes over all ranks, formula says " +
                                                  std::to_string(formula_total));
    }
    json["sync"] = sync;
    json["accum_steps"] = cfg.accum_steps;
    json["replica_max_divergence"] = final_divergence;
    json["vs_single_device_max_abs_diff"] = dist.max_abs;
    json["vs_single_device_max_rel_diff"] = dist.max_rel;
    json["relative_tolerance"] = relative_tolerance;
    json["loss_curve_max_rel_diff"] = loss_diff;
    json["allreduce_calls_per_step"] = calls_per_step;
    json["buckets"] = trace.buckets;
    json["gradient_bytes"] = grad_bytes;
    json["bytes_sent_per_rank_per_step"] = sent_per_step;
    json["formula_bytes_per_rank_per_step"] = formula_per_rank;
    json["final_loss"] = trace.losses.back();
    json["single_device_final_loss"] = reference.losses.back();
    json["losses"] = trace.losses;
  });
}
