// Chapter 05 — Adam's memory: 4x the parameters, 16 bytes per parameter in mixed
// precision, and ZeRO's way out.
//
// The course (so-large-lm ch. 8 §8.2.2; CS336 lecture 7): Adam keeps for every parameter
// its value, its gradient and two running averages, m and v — storage goes from the 2x
// of SGD to 4x the parameters; in mixed precision 2 + 2 + 12 = 16 bytes per parameter
// (ZeRO §3.1), which decides whether a model fits on a device at all. ZeRO (Rajbhandari
// et al. 2020) keeps data parallelism and removes its redundancy: stage 1 shards the
// optimizer states over the Nd ranks, stage 2 the gradients too, stage 3 the parameters
// (ZeroOptimizer, zero.hpp: any model's ParameterStore, any data-parallel communicator).
//
// Two modes: the calculator (default), the paper's per-device formula for --params (or a
// --preset) on --dp ranks, which reproduces ZeRO's Table 1; and --train, toy.hpp's MLP
// trained on the ranks at every stage with each tensor counted by the memory ledger:
// bytes next to the formula, weights against plain data parallelism's, checkpointing.
//
// Simplified: a small MLP (no attention), fp16 computed through f32 on the CPU, no loss
// scaling (chapter 06), no bucketing or overlap of the gradient reduction.
//
// Run:
//   build/default/bin/ch05_adam_memory                          ZeRO Table 1's 7.5B on 64 ranks
//   build/default/bin/ch05_adam_memory --preset gpt3-175b --dp 1024 --device-gb 80
//   build/default/bin/ch05_adam_memory --table                  Table 1: Nd = 1 ... 1024
//   build/default/bin/ch05_adam_memory --train --ranks 4        measured on 4 ranks
//   mpirun -np 4 build/default/bin/ch05_adam_memory --train
//   build/default/bin/ch05_adam_memory --train --ranks 4 --benchmark --csv-dir results
//
// Expected: the calculator prints 120, 31.4, 16.6 and 1.88 GB for the 7.5B model on 64
// ranks (ZeRO's Figure 1 rounds the last to 1.9); training measures exactly the formula's
// bytes on every rank, and every stage ends with the weights of plain data parallelism
// (bit for bit on threads).
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "calculator.hpp"
#include "shardlab/check.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/launch.hpp"
#include "training.hpp"

using namespace shardlab;
using namespace ch05;

namespace {

struct Settings {
  double params = 0;  // calculator: 0 = the preset's
  std::string preset, precision = "mixed";
  double dp = 64, device_gb = 80;
  bool table = false, train = false, benchmark = false;
  int stage = -1;  // training: -1 = every stage
  int steps = 3;
  ModelConfig model;
  Precision p() const { return precision == "fp32" ? Precision::fp32 : Precision::mixed; }
  RunConfig run(int stage_, int steps_ = 0) const {
    RunConfig rc{.precision = p(), .steps = steps_ ? steps_ : steps};
    rc.zero.stage = stage_;
    return rc;
  }
};

// ---------------------------------------------------------------------------
// The calculator: ZeRO's formulas for Psi parameters on Nd devices

void calculator(Context& ctx, const Settings& s) {
  const Preset* preset = find_preset(s.preset.empty() ? "zero-7.5b" : s.preset);
  const double psi = s.params > 0 ? s.params : preset->params;
  ctx.say("Chapter 05 - ZeRO's memory per device, from the paper's formulas (ZeRO §3.1, §5)");
  ctx.say("model: " +
          (s.params > 0 ? format_number(psi, 4) + " parameters"
                        : preset->name + " (" + preset->source + ")") +
          ", Psi = " + format_number(psi, 4) + ", " +
          (s.p() == Precision::mixed
               ? "mixed precision (fp16 weights and gradients; K = 12: fp32 master, m, v)"
               : "fp32 (K = 8: Adam's m and v)"));
  const std::vector<double> dps = s.table ? std::vector<double>{1, 4, 16, 64, 256, 1024}
                                          : std::vector{s.dp};  // --table: ZeRO's Table 1
  ctx.report(zero_table(psi, dps, s.p(), s.device_gb), "stages",
             "on Nd data-parallel devices of " + format_number(s.device_gb) + " GB:");
  ctx.json()["params"] = psi;
  ctx.say(
      "GB = 1e9 bytes. Model states only: activations, temporary buffers and fragmentation "
      "come on top (ZeRO §3.2). Run it for real: --train --ranks 4");
}

// ---------------------------------------------------------------------------
// Training, 1: one replica's bytes, SGD against Adam, fp32 against mixed precision

void part_adam(Context& ctx, const Settings& s) {
  const auto P = static_cast<std::uint64_t>(s.model.params());
  Table t({"run", "params", "grads", "master", "optimizer", "total", "formula", "bytes", "peak"});
  auto row = [&](const char* name, Precision p, bool sgd, const char* formula, int per_param) {
    RunConfig rc = s.run(0, 1);
    rc.precision = p;
    rc.zero.sgd = sgd;
    const Measured m = measure(ctx.comm(), s.model, rc, ctx.memory());
    const StateBytes& b = m.run.states;
    const std::string wrong =
        m.differences(false) + (b.total() == per_param * P ? "" : " (the bytes per param)");
    ctx.verify(wrong.empty(), std::string(name) + ": " + wrong);
    t.add({name, b.params, b.grads, b.master, b.optimizer, b.total(), formula, per_param * P,
           m.run.usage.peak_total});
  };
  row("SGD, fp32", Precision::fp32, true, "4+4 = 8 B/param: 2x the weights", 8);
  row("Adam, fp32", Precision::fp32, false, "4+4+8 = 16 B/param: 4x", 16);
  row("Adam, mixed", Precision::mixed, false, "2+2+4+4+4 = 16 B/param", 16);
  ctx.report(t, "adam_memory",
             "1. Where the bytes go: plain data parallel, each rank a whole replica (rank 0's "
             "ledger, live at the end; the peak adds activations, buffers, temporaries)");
}

// Training, 2: activation checkpointing at stage 0

void part_checkpoint(Context& ctx, const Settings& s) {
  RunConfig plain = s.run(0, std::max(s.steps, 3));
  plain.keep_grads = true;
  RunConfig ckpt = plain;
  ckpt.checkpoint = true;
  const RunResult a = train(ctx.comm(), s.model, plain, ctx.memory());
  const RunResult b = train(ctx.comm(), s.model, ckpt, ctx.memory());
  const bool same = ctx.comm().all_true(a.first_grads.bitwise_equal(b.first_grads) &&
                                        a.weights.bitwise_equal(b.weights));
  Table t({"forward keeps", "bytes after forward", "formula", "peak over a step", "step_ms"});
  for (const auto& [name, r, rc] : {std::tuple{"every tanh output (5 L B d)", &a, &plain},
                                    {"block inputs (L B d)", &b, &ckpt}}) {
    const std::uint64_t formula = formula_activations(s.model, *rc);
    ctx.verify(r->activations_after_forward == formula,
               std::string(name) + ": the bytes kept after the forward differ from the formula");
    t.add({name, r->activations_after_forward, formula,
           r->usage.peak(memory::Category::activations), r->fastest_step_s * 1e3});
  }
  ctx.report(
      t, "checkpointing",
      "\n2. Activation checkpointing: keep block inputs, recompute the rest in the backward");
  const double ratio = b.fastest_step_s / a.fastest_step_s;
  ctx.json()["step_time_ratio"] = ratio;
  ctx.say("  step time (fastest of " + std::to_string(plain.steps) + ") x" +
          format_number(ratio, 3) + ": one more forward per step; gradients and weights bit " +
          "for bit the same: " + (same ? "yes\n" : "NO\n"));
  ctx.verify(same, "activation checkpointing changed the gradients");
}

// Training, 3: the ZeRO stages, measured next to the formula and against stage 0

void part_zero(Context& ctx, const Settings& s) {
  // Threads sum in one order (exact weights) and measure the traffic; MPI and NCCL hide it
  // and add f16 pairwise in their own order: a gradient's rounding moves Adam by up to lr.
  const bool threads = ctx.comm().backend() == "threads";
  const double tolerance = threads ? 0.0 : 2.0 * s.run(0).zero.adam.lr * s.steps;
  const Measured base = measure(ctx.comm(), s.model, s.run(0), ctx.memory());
  Table t({"stage", "sharded", "params", "grads", "master", "optimizer", "total", "formula",
           "paper", "recv/step", "recv formula", "vs_plain_dp_max_abs_diff", "ok"});
  for (int st = 0; st <= 3; ++st) {
    if (s.stage >= 0 && st != s.stage && st != 0) continue;
    const Measured o = st == 0 ? base : measure(ctx.comm(), s.model, s.run(st), ctx.memory());
    const StateBytes& b = o.run.states;
    const std::string name = "stage " + std::to_string(st);
    const double diff = st == 0 ? 0.0
                                : ctx.verify_close(name + "'s weights",
                                                   max_abs_diff(o.run.weights, base.run.weights),
                                                   tolerance, "plain data parallelism's");
    const std::string wrong = o.differences(threads);
    const bool ok = ctx.comm().all_true(ctx.verify(wrong.empty(), name + ": " + wrong));
    t.add({st, stage_name(st), b.params, b.grads, b.master, b.optimizer, b.total(),
           o.formula.total(), std::llround(o.paper), o.comm_bytes, o.comm_formula, diff,
           ok && diff <= tolerance});
  }
  ctx.report(t, "stages",
             "\n3. ZeRO on " + std::to_string(ctx.size()) + " data-parallel ranks, " +
                 precision_name(s.p()) + " precision, Adam, " + std::to_string(s.steps) +
                 " steps: model states per rank (rank 0's; every rank checked)");
  ctx.json()["traffic_modeled"] = !threads;
  ctx.say("  formula: the paper's with this rank's own shard; paper: with Psi/Nd. recv/step: " +
          std::string(threads ? "measured" : "modeled (the library hides its algorithm)") +
          "; (Nd-1)/Nd x (2 Psi, or 3 Psi at stage 3) values for even shards\n");
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch05_adam_memory",
                  "Chapter 05: Adam's memory - 16 bytes per parameter, and ZeRO stages 1-3");
  Settings s;
  auto& cli = program.cli();
  cli.option_defaults()->always_capture_default();
  cli.add_option("--params", s.params, "calculator: parameters (7.5e9 or 7.5B)")
      ->transform(cli::quantity())
      ->check(cli::between(1, 1e16));
  cli.add_option("--preset", s.preset, "calculator: a known model")
      ->check(CLI::IsMember(preset_names()));
  cli.add_option("--dp", s.dp, "calculator: data-parallel devices Nd")->check(cli::between(1, 1e9));
  cli.add_option("--device-gb", s.device_gb, "calculator: GB a device")
      ->check(cli::between(1e-6, 1e9));
  cli.add_flag("--table", s.table, "calculator: Nd = 1, 4, 16, 64, 256, 1024 (ZeRO Table 1)");
  cli.add_option("--precision", s.precision, "fp32, mixed")
      ->check(CLI::IsMember({"fp32", "mixed"}));
  cli.add_flag("--train", s.train, "train on the ranks instead of the calculator");
  cli.add_option("--stage", s.stage, "training: one ZeRO stage (0-3) next to stage 0; default all")
      ->check(shardlab::cli::whole(0, 3));
  cli.add_option("--steps", s.steps, "training: Adam steps")->check(shardlab::cli::whole(1, 1000));
  cli.add_option("--blocks", s.model.blocks, "training: MLP blocks L")
      ->check(shardlab::cli::whole(1, 1024));
  cli.add_option("--width", s.model.width, "training: width d")
      ->check(shardlab::cli::whole(1, 4096));
  cli.add_option("--batch", s.model.batch, "training: B rows a rank")
      ->check(shardlab::cli::whole(1, 1 << 20));
  cli.add_flag("--benchmark", s.benchmark, "training: step times and bytes per stage, as CSV");
  program.validate([&](const Options& o) {
    s.model.seed = o.seed;
    // Each mode's flags alone: the other mode's are bad usage, named.
    const auto refuse = [&](bool when, std::vector<const char*> flags, const char* why) {
      for (const char* flag : flags)
        if (when && cli.count(flag)) throw UsageError(flag + std::string(why));
    };
    refuse(s.train, {"--params", "--preset", "--dp", "--device-gb", "--table"},
           " is the calculator's: drop it with --train (the ranks are the data-parallel devices)");
    refuse(!s.train, {"--stage", "--steps", "--blocks", "--width", "--batch", "--benchmark"},
           " is for training: add --train");
    refuse(cli.count("--preset"), {"--params"}, " and --preset both name the model: give one");
    refuse(s.table, {"--dp"}, " with --table: the table's Nd are 1 to 1024; give one or the other");
    if (std::floor(s.dp) != s.dp)
      throw UsageError("--dp " + format_number(s.dp) + ": a number of devices is a whole number");
  });
  program.memory_estimate([&](const Options& o) {
    const bool threads = o.backend == "threads" || o.backend == "auto";
    return s.train ? memory_estimate(s.model, threads ? o.ranks : 1, o.ranks) : 0.0;
  });
  program.writes_csv([&] { return s.benchmark; });
  program.supports_cuda();
  return program.run(argc, argv, [&](Context& ctx) {
    ctx.json()["chapter"] = "05_adam_memory";
    ctx.json()["mode"] = s.train ? "train" : "calculator";
    if (!s.train) return calculator(ctx, s);  // rank 0 speaks
    ctx.say("Chapter 05 - Adam's memory, measured on " + std::to_string(ctx.size()) + " ranks: " +
            std::to_string(s.model.blocks) + " blocks of Linear d->4d, tanh, Linear 4d->d, tanh " +
            "(d = " + std::to_string(s.model.width) + ", B = " + std::to_string(s.model.batch) +
            " rows per rank): Psi = " + std::to_string(s.model.params()) + " parameters\n");
    part_adam(ctx, s);
    part_checkpoint(ctx, s);
    part_zero(ctx, s);
    if (!s.benchmark) return;
    // Benchmark: step times and bytes per stage for Nd = 1, 2, 4, ...; ZeRO's Table 1.
    const BenchmarkTables bench =
        benchmark(ctx.comm(), s.model, s.run(0, std::max(s.steps, 5)), ctx.memory());
    ctx.save_csv(bench.bytes, "05_adam_memory");
    ctx.save_csv(bench.time, "05_adam_memory_time");
    ctx.save_csv(paper_table(), "05_adam_memory_paper");
  });
}
