// Chapter 05 — Adam's memory: 4x the parameters, 16 bytes per parameter in mixed
// precision, and ZeRO's way out.
//
// The course (so-large-lm ch. 8 §8.2.2; CS336 lecture 7): Adam keeps for every parameter
// its value, its gradient and two running averages, m and v — storage goes from the 2x
// of SGD to 4x the parameters; in mixed precision 2 + 2 + 12 = 16 bytes per parameter
// (ZeRO §3.1), which decides whether a model fits on a device at all. ZeRO (Rajbhandari
// et al. 2020) keeps data parallelism and removes its redundancy: stage 1 shards the
// optimizer states over the Nd ranks, stage 2 the gradients too, stage 3 the parameters.
//
// Two modes:
//   calculator (default)  the paper's per-device formula for a model of --params (or a
//                         --preset) on --dp ranks: it reproduces ZeRO's Table 1
//   --train               an MLP trained on the ranks, plain data parallel and each ZeRO
//                         stage, every tensor counted by the memory ledger (memory.hpp):
//                         measured bytes next to the formula, the weights of every stage
//                         against plain data parallelism, activation checkpointing
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
// ranks (ZeRO's Figure 1 rounds the last to 1.9); training measures exactly the formula's bytes on every rank, and every stage
// ends with the weights of plain data parallelism (bit for bit on threads).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "calculator.hpp"
#include "shardlab/check.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/results.hpp"
#include "training.hpp"

using namespace shardlab;
using namespace ch05;

namespace {

struct Settings {
  // calculator
  std::string params_text;
  std::string preset;
  double dp = 64;
  double device_gb = 80;
  bool table = false;
  // both
  std::string precision = "mixed";
  // training
  bool train = false;
  int stage = -1;  // -1: every stage
  int steps = 3;
  bool benchmark = false;
  ModelConfig model;
};

Precision precision_of(const std::string& p) {
  return p == "fp32" ? Precision::fp32 : Precision::mixed;
}

/// "7.5e9", "7500000000", "7.5B", "1.5b", "350M", "1T" -> a number of parameters.
double parse_params(const std::string& text) {
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    throw UsageError("--params " + text + ": not a number (try 7.5e9 or 7.5B)");
  }
  std::string rest = text.substr(used);
  double unit = 1;
  if (rest.size() == 1) {
    switch (rest[0]) {
      case 'k': case 'K': unit = 1e3; break;
      case 'm': case 'M': unit = 1e6; break;
      case 'b': case 'B': case 'g': case 'G': unit = 1e9; break;
      case 't': case 'T': unit = 1e12; break;
      default: unit = 0;
    }
    if (unit > 0) rest.clear();
  }
  if (!rest.empty())
    throw UsageError("--params " + text + ": not a number (try 7.5e9 or 7.5B)");
  value *= unit;
  if (!std::isfinite(value) || value < 1 || value > 1e16)
    throw UsageError("--params " + text + ": must be a parameter count from 1 to 1e16");
  return value;
}

std::string gb(double bytes) {
  const double g = bytes / 1e9 * (1 + 1e-12);  // halves round up, as the paper's table: 41.3
  return format_number(g, g >= 100 ? 4 : 3) + " GB";
}

std::string with_commas(std::uint64_t n) {
  std::string s = std::to_string(n);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(static_cast<std::size_t>(i), ",");
  return s;
}

const char* stage_names[] = {"0  plain data parallel", "1  + optimizer states sharded",
                             "2  + gradients sharded", "3  + parameters sharded"};

// ---------------------------------------------------------------------------
// Calculator

void calculator(Context& ctx, const Settings& s) {
  const Preset* preset = find_preset(s.preset.empty() && s.params_text.empty() ? "zero-7.5b" : s.preset);
  const double psi = s.params_text.empty() ? preset->params : parse_params(s.params_text);
  const Precision p = precision_of(s.precision);
  const bool mixed = p == Precision::mixed;
  std::string name = s.params_text.empty() ? preset->name + " (" + preset->source + ")"
                                           : format_number(psi, 4) + " parameters";
  ctx.say("Chapter 05 - ZeRO's memory per device, from the paper's formulas (ZeRO §3.1, §5)");
  ctx.say("model: " + name + ", Psi = " + format_number(psi, 4) + ", " +
          (mixed ? "mixed precision (fp16 weights and gradients; K = 12: fp32 master, m, v)"
                 : "fp32 (K = 8: Adam's m and v)") + "\n");
  auto& j = ctx.json();
  j["params"] = psi;
  j["precision"] = s.precision;
  j["device_gb"] = s.device_gb;
  if (!s.params_text.empty() || !s.preset.empty()) j["model"] = s.params_text.empty() ? preset->name : name;
  std::vector<double> dps = {s.dp};
  if (s.table) dps = {1, 4, 16, 64, 256, 1024};
  j["stages"] = nlohmann::json::array();
  for (double nd : dps) {
    std::ostringstream out;
    out << "Nd = " << format_number(nd) << " data-parallel devices of " << format_number(s.device_gb)
        << " GB:\n";
    char line[240];
    std::snprintf(line, sizeof line, "  %-32s %12s %12s %12s %12s  %-5s %s\n", "stage", "params",
                  "grads", "optimizer", "per device", "fits", "comm per step");
    out << line;
    for (int st = 0; st <= 3; ++st) {
      const StageMemory m = zero_memory(psi, nd, st, p);
      const double comm = zero_comm_elements(psi, nd, st) * (mixed ? 2 : 4);
      const bool fits = m.total() <= s.device_gb * 1e9;
      std::snprintf(line, sizeof line, "  %-32s %12s %12s %12s %12s  %-5s %s (%s)\n",
                    stage_names[st], gb(m.params).c_str(), gb(m.grads).c_str(),
                    gb(m.optimizer).c_str(), gb(m.total()).c_str(), fits ? "yes" : "no",
                    gb(comm).c_str(), st == 3 ? "3 Psi (Nd-1)/Nd" : "2 Psi (Nd-1)/Nd");
      out << line;
      j["stages"].push_back({{"stage", st},
                             {"dp", nd},
                             {"bytes_per_device", m.total()},
                             {"gb_per_device", m.total() / 1e9},
                             {"params_bytes", m.params},
                             {"grads_bytes", m.grads},
                             {"optimizer_bytes", m.optimizer},
                             {"fits", fits},
                             {"comm_bytes_per_step", comm}});
    }
    ctx.say(out.str());
  }
  ctx.say("GB = 1e9 bytes. Model states only: activations, temporary buffers and "
          "fragmentation come on top (ZeRO §3.2). Run it for real: --train --ranks 4");
}

// ---------------------------------------------------------------------------
// Training

std::string bytes_text(std::uint64_t b) { return with_commas(b); }

struct StageOutcome {
  RunResult run;
  StateBytes formula;
  double paper = 0;  // the paper's formula with Psi / Nd
  std::uint64_t comm_bytes = 0, comm_formula = 0;
  double diff = 0;
};

StageOutcome run_stage(Context& ctx, const Settings& s, int stage, Precision p,
                       const Tensor* reference, bool prefetch = true,
                       Communicator* on = nullptr) {
  Communicator& comm = on ? *on : ctx.comm();
  RunConfig rc;
  rc.stage = stage;
  rc.precision = p;
  rc.steps = s.steps;
  rc.prefetch = prefetch;
  StageOutcome o;
  o.run = train(comm, s.model, rc, ctx.memory());
  o.formula = formula_states(s.model, rc, comm.size(), comm.rank());
  o.paper = zero_memory(static_cast<double>(s.model.params()), comm.size(), stage, p).total();
  o.comm_bytes = o.run.comm.total().bytes_received / static_cast<std::uint64_t>(s.steps);
  o.comm_formula = formula_comm_bytes(s.model, rc, comm.size(), comm.rank());
  if (reference) o.diff = comm.agree(max_abs_diff(o.run.weights, *reference), ReduceOp::max);
  return o;
}

/// Part 1: one replica's bytes, SGD vs Adam, fp32 vs mixed.
void part_adam(Context& ctx, const Settings& s) {
  const std::uint64_t P = static_cast<std::uint64_t>(s.model.params());
  ctx.say("1. Where the bytes go: plain data parallel, each rank a whole replica (measured on "
          "every rank by the memory ledger; rank 0 shown)");
  char line[240];
  std::ostringstream out;
  std::snprintf(line, sizeof line, "  %-24s %11s %11s %11s %11s %11s  %-36s %s\n", "", "params", "grads",
                "master", "optimizer", "total", "formula", "peak, all tensors");
  out << line;
  struct Case {
    const char* name;
    Precision p;
    bool sgd;
    const char* formula;
    std::uint64_t per_param;
  };
  const Case cases[] = {{"SGD, fp32", Precision::fp32, true, "4+4 = 8 B/param: 2x the weights", 8},
                        {"Adam, fp32", Precision::fp32, false, "4+4+8 = 16 B/param: 4x the weights", 16},
                        {"Adam, mixed precision", Precision::mixed, false,
                         "2+2+4+4+4 = 16 B/param (K = 12)", 16}};
  for (const Case& c : cases) {
    RunConfig rc;
    rc.precision = c.p;
    rc.sgd = c.sgd;
    rc.steps = 1;
    const RunResult r = train(ctx.comm(), s.model, rc, ctx.memory());
    const StateBytes f = formula_states(s.model, rc, ctx.size(), ctx.rank());
    std::snprintf(line, sizeof line, "  %-24s %11s %11s %11s %11s %11s  %-36s %s%s\n", c.name,
                  bytes_text(r.states.params).c_str(), bytes_text(r.states.grads).c_str(),
                  bytes_text(r.states.master).c_str(), bytes_text(r.states.optimizer).c_str(),
                  bytes_text(r.states.total()).c_str(), c.formula, bytes_text(r.usage.peak_total).c_str(),
                  r.states == f && f.total() == c.per_param * P ? "" : "  <- differs");
    out << line;
    ctx.verify(r.states == f && f.total() == c.per_param * P,
               std::string(c.name) + ": measured " + std::to_string(r.states.total()) +
                   " bytes of model states, the formula says " + std::to_string(c.per_param * P));
    auto& j = ctx.json()["adam_memory"][c.name];
    j["measured_bytes"] = r.states.total();
    j["formula_bytes"] = c.per_param * P;
    j["peak_bytes"] = r.usage.peak_total;
  }
  out << "  Psi = " << with_commas(P) << " parameters; bytes per rank, live at the end of training;"
      << " the peak adds activations, communication buffers and temporaries\n";
  ctx.say(out.str());
}

/// Part 2: activation checkpointing at stage 0.
void part_checkpoint(Context& ctx, const Settings& s) {
  const Precision p = precision_of(s.precision);
  RunConfig plain, ckpt;
  plain.precision = ckpt.precision = p;
  plain.steps = ckpt.steps = std::max(s.steps, 3);
  ckpt.checkpoint = true;
  plain.keep_grads = ckpt.keep_grads = true;
  const RunResult a = train(ctx.comm(), s.model, plain, ctx.memory());
  const RunResult b = train(ctx.comm(), s.model, ckpt, ctx.memory());
  const bool same = a.first_grads.bitwise_equal(b.first_grads) && a.weights.bitwise_equal(b.weights);
  const bool all_same = ctx.comm().all_true(same);
  const std::uint64_t fa = formula_activations(s.model, plain), fb = formula_activations(s.model, ckpt);
  const double extra = b.fastest_step_s / a.fastest_step_s - 1;
  std::ostringstream out;
  out << "2. Activation checkpointing (keep each block's input, recompute the rest in backward)\n"
      << "  kept after the forward: " << bytes_text(a.activations_after_forward) << " bytes (formula 5 L B d x "
      << (p == Precision::mixed ? 2 : 4) << " = " << bytes_text(fa) << ") -> "
      << bytes_text(b.activations_after_forward) << " bytes with checkpointing (L B d x "
      << (p == Precision::mixed ? 2 : 4) << " = " << bytes_text(fb) << ")\n"
      << "  peak activations over a step: " << bytes_text(a.usage.peak(memory::Category::activations))
      << " -> " << bytes_text(b.usage.peak(memory::Category::activations)) << " bytes\n"
      << "  step time (fastest of " << plain.steps << "): " << format_number(a.fastest_step_s * 1e3, 3)
      << " ms -> " << format_number(b.fastest_step_s * 1e3, 3) << " ms (" << (extra >= 0 ? "+" : "")
      << format_number(100 * extra, 3) << "%: the price of one more forward per step)\n"
      << "  gradients and weights bit for bit the same: " << (all_same ? "yes" : "NO") << "\n";
  ctx.say(out.str());
  ctx.verify(all_same, "activation checkpointing changed the gradients");
  ctx.verify(a.activations_after_forward == fa && b.activations_after_forward == fb,
             "activations kept after the forward: measured " +
                 std::to_string(a.activations_after_forward) + " and " +
                 std::to_string(b.activations_after_forward) + " bytes, formula " +
                 std::to_string(fa) + " and " + std::to_string(fb));
  auto& j = ctx.json()["checkpointing"];
  j["activation_bytes"] = a.activations_after_forward;
  j["activation_bytes_checkpointed"] = b.activations_after_forward;
  j["formula_activation_bytes"] = fa;
  j["formula_activation_bytes_checkpointed"] = fb;
  j["peak_activation_bytes"] = a.usage.peak(memory::Category::activations);
  j["peak_activation_bytes_checkpointed"] = b.usage.peak(memory::Category::activations);
  j["step_time_ratio"] = b.fastest_step_s / a.fastest_step_s;
  j["bitwise_equal"] = all_same;
}

/// Part 3: ZeRO stages on the ranks.
void part_zero(Context& ctx, const Settings& s) {
  const Precision p = precision_of(s.precision);
  const int N = ctx.size();
  const bool mixed = p == Precision::mixed;
  // The threads backend sums in one order (exact weights) and measures its traffic; MPI
  // and NCCL hide their algorithms (modeled traffic).
  const bool threads = ctx.comm().backend() == "threads";
  const bool modeled = !threads;
  std::ostringstream out;
  out << "3. ZeRO on " << N << " data-parallel ranks, " << (mixed ? "mixed precision (K = 12)" : "fp32 (K = 8)")
      << ", Adam, " << s.steps << " steps: model states per rank (measured on every rank; rank 0 shown)\n";
  char line[300];
  std::snprintf(line, sizeof line, "  %-31s %10s %10s %10s %10s %11s %11s %11s  %11s %11s  %s\n", "stage",
                "params", "grads", "master", "optimizer", "total", "formula", "paper", "recv/step",
                "formula", "weights vs stage 0");
  out << line;
  const StageOutcome base = run_stage(ctx, s, 0, p, nullptr);
  const Tensor reference = base.run.weights;
  // Threads: every stage sums the gradients in the same order, so the weights agree bit
  // for bit. MPI and NCCL reduce f16 pairwise, in an order of their own: a rounding in a
  // gradient moves Adam's step by up to lr.
  const double tolerance = threads ? 0.0 : 2.0 * RunConfig{}.adam.lr * s.steps;
  auto& stages = ctx.json()["stages"];
  stages = nlohmann::json::array();
  for (int st = 0; st <= 3; ++st) {
    if (s.stage >= 0 && st != s.stage && st != 0) continue;
    const StageOutcome o = st == 0 ? base : run_stage(ctx, s, st, p, &reference);
    const RunResult& r = o.run;
    const bool bytes_ok = r.states == o.formula;
    const double slack = 16.0 * s.model.blocks;  // uneven shards: under 16 bytes per block
    const bool paper_ok = std::fabs(static_cast<double>(o.formula.total()) - o.paper) <= slack + 16;
    const bool comm_ok = modeled ? true : o.comm_bytes == o.comm_formula;
    const bool weights_ok = o.diff <= tolerance;
    std::snprintf(line, sizeof line, "  %-31s %10s %10s %10s %10s %11s %11s %11s  %11s %11s  %s\n",
                  stage_names[st], bytes_text(r.states.params).c_str(), bytes_text(r.states.grads).c_str(),
                  bytes_text(r.states.master).c_str(), bytes_text(r.states.optimizer).c_str(),
                  bytes_text(r.states.total()).c_str(), bytes_text(o.formula.total()).c_str(),
                  bytes_text(static_cast<std::uint64_t>(std::llround(o.paper))).c_str(),
                  bytes_text(o.comm_bytes).c_str(), bytes_text(o.comm_formula).c_str(),
                  st == 0 ? "(the reference)" : format_number(o.diff, 3).c_str());
    out << line;
    const std::string name = "stage " + std::to_string(st);
    const bool all_bytes = ctx.comm().all_true(bytes_ok);
    ctx.verify(bytes_ok, name + ": rank " + std::to_string(ctx.rank()) + " holds " +
                             std::to_string(r.states.total()) + " bytes of model states, the formula " +
                             std::to_string(o.formula.total()));
    ctx.verify(paper_ok, name + ": the exact formula " + std::to_string(o.formula.total()) +
                             " is further than uneven shards explain from the paper's " +
                             format_number(o.paper));
    ctx.verify(comm_ok, name + ": rank " + std::to_string(ctx.rank()) + " received " +
                            std::to_string(o.comm_bytes) + " bytes per step, the formula says " +
                            std::to_string(o.comm_formula));
    ctx.verify(weights_ok, name + ": the weights differ from plain data parallelism by " +
                               format_number(o.diff) + " (tolerance " + format_number(tolerance) + ")");
    const auto measured = ctx.comm().gather_values(static_cast<std::int64_t>(r.states.total()));
    const auto formula = ctx.comm().gather_values(static_cast<std::int64_t>(o.formula.total()));
    const auto received = ctx.comm().gather_values(static_cast<std::int64_t>(o.comm_bytes));
    stages.push_back({{"stage", st},
                      {"bytes_per_device", r.states.total()},
                      {"measured_bytes_per_rank", measured},
                      {"formula_bytes_per_rank", formula},
                      {"paper_bytes_per_device", o.paper},
                      {"params_bytes", r.states.params},
                      {"grads_bytes", r.states.grads},
                      {"master_bytes", r.states.master},
                      {"optimizer_bytes", r.states.optimizer},
                      {"activation_peak_bytes", r.usage.peak(memory::Category::activations)},
                      {"comm_buffer_peak_bytes", r.usage.peak(memory::Category::comm)},
                      {"comm_bytes_per_step_per_rank", received},
                      {"formula_comm_bytes_per_step", o.comm_formula},
                      {"traffic_modeled", modeled},
                      {"vs_plain_dp_max_abs_diff", o.diff},
                      {"final_loss", r.losses.back()},
                      {"ok", all_bytes && paper_ok && comm_ok && weights_ok}});
  }
  const double P = static_cast<double>(s.model.params());
  out << "  Psi = " << with_commas(s.model.params()) << "; formula = the paper's per-rank formula with this rank's own shard; paper = with Psi/Nd\n"
      << "  recv/step: bytes each rank receives per step, " << (modeled ? "modeled (the library hides its algorithm)" : "measured")
      << "; (Nd-1)/Nd x " << (mixed ? 2 : 4) << " bytes x (2 Psi, or 3 Psi at stage 3) = "
      << bytes_text(static_cast<std::uint64_t>(zero_comm_elements(P, N, 0) * (mixed ? 2 : 4))) << " and "
      << bytes_text(static_cast<std::uint64_t>(zero_comm_elements(P, N, 3) * (mixed ? 2 : 4))) << " for even shards\n";
  ctx.say(out.str());
}

/// Benchmark: step time of every stage with and without stage 3's prefetch, and the bytes
/// of each stage for Nd = 1, 2, 4, ... up to the ranks (sub-communicators of the ranks).
void benchmark(Context& ctx, const Settings& s) {
  const Precision p = precision_of(s.precision);
  const std::string machine = machine_description(), backend(ctx.comm().backend());
  CsvTable memory_rows({"source", "stage", "dp", "category", "bytes", "params", "precision"});
  CsvTable time_rows({"stage", "prefetch", "dp", "step_ms", "vs_plain_dp", "params", "precision",
                      "backend", "machine"});
  Settings longer = s;
  longer.steps = std::max(s.steps, 5);
  for (int nd = 1; nd <= ctx.size(); nd *= 2) {
    // Ranks 0..nd-1 train together; the others form groups of their own.
    std::unique_ptr<Communicator> group = ctx.comm().split(ctx.rank() / nd, ctx.rank());
    double plain = 0;
    for (int st = 0; st <= 3; ++st) {
      for (bool prefetch : {true, false}) {
        if (st < 3 && !prefetch) continue;
        const StageOutcome o = run_stage(ctx, longer, st, p, nullptr, prefetch, group.get());
        const double t = ctx.comm().agree(o.run.fastest_step_s, ReduceOp::max);
        if (st == 0) plain = t;
        time_rows.add({std::to_string(st), prefetch ? "1" : "0", std::to_string(group->size()),
                       format_number(t * 1e3), format_number(t / plain), std::to_string(s.model.params()),
                       s.precision, backend, machine});
        if (!prefetch) continue;
        const StateBytes& m = o.run.states;
        const StateBytes& f = o.formula;
        const std::pair<const char*, std::uint64_t> cats[] = {{"params", m.params}, {"grads", m.grads},
                                                              {"master", m.master}, {"optimizer", m.optimizer}};
        const std::pair<const char*, std::uint64_t> fcats[] = {{"params", f.params}, {"grads", f.grads},
                                                               {"master", f.master}, {"optimizer", f.optimizer}};
        for (int k = 0; k < 4; ++k) {
          memory_rows.add({"measured", std::to_string(st), std::to_string(group->size()), cats[k].first,
                           std::to_string(cats[k].second), std::to_string(s.model.params()), s.precision});
          memory_rows.add({"formula", std::to_string(st), std::to_string(group->size()), fcats[k].first,
                           std::to_string(fcats[k].second), std::to_string(s.model.params()), s.precision});
        }
      }
    }
  }
  ctx.save_csv(memory_rows, "05_adam_memory");
  ctx.save_csv(time_rows, "05_adam_memory_time");
  // The paper's 7.5B model, by the formula: Table 1's rows as bars.
  CsvTable paper({"stage", "dp", "params_bytes", "grads_bytes", "optimizer_bytes", "total_bytes"});
  for (double nd : {1, 4, 16, 64, 256, 1024})
    for (int st = 0; st <= 3; ++st) {
      const StageMemory m = zero_memory(7.5e9, nd, st, Precision::mixed);
      paper.add({std::to_string(st), format_number(nd), format_number(m.params), format_number(m.grads),
                 format_number(m.optimizer), format_number(m.total())});
    }
  ctx.save_csv(paper, "05_adam_memory_paper");
}

void training(Context& ctx, const Settings& s) {
  ctx.say("Chapter 05 - Adam's memory, measured on " + std::to_string(ctx.size()) + " ranks (" +
          std::string(ctx.comm().backend()) + "): an MLP of " + std::to_string(s.model.blocks) +
          " blocks (Linear " + std::to_string(s.model.width) + "->" + std::to_string(4 * s.model.width) +
          ", tanh, Linear " + std::to_string(4 * s.model.width) + "->" + std::to_string(s.model.width) +
          ", tanh), Psi = " + with_commas(s.model.params()) + " parameters, " +
          std::to_string(s.model.batch) + " rows per rank\n");
  part_adam(ctx, s);
  part_checkpoint(ctx, s);
  part_zero(ctx, s);
  if (s.benchmark) benchmark(ctx, s);
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch05_adam_memory",
                  "Chapter 05: Adam's memory - 16 bytes per parameter, and ZeRO stages 1-3");
  Settings s;
  auto& cli = program.cli();
  cli.add_option("--params", s.params_text, "calculator: parameters (7.5e9 or 7.5B)");
  std::vector<std::string> names;
  for (const Preset& p : presets()) names.push_back(p.name);
  cli.add_option("--preset", s.preset, "calculator: a known model")->check(CLI::IsMember(names));
  cli.add_option("--dp", s.dp, "calculator: data-parallel devices Nd")
      ->check(cli::between(1, 1e9))
      ->capture_default_str();
  cli.add_option("--device-gb", s.device_gb, "calculator: memory of one device, GB")
      ->check(cli::between(1e-6, 1e9))
      ->capture_default_str();
  cli.add_flag("--table", s.table, "calculator: Nd = 1, 4, 16, 64, 256, 1024 (ZeRO Table 1)");
  cli.add_option("--precision", s.precision, "fp32 or mixed")
      ->check(CLI::IsMember({"fp32", "mixed"}))
      ->capture_default_str();
  cli.add_flag("--train", s.train, "train on the ranks instead of the calculator");
  cli.add_option("--stage", s.stage, "training: one ZeRO stage (0-3) next to stage 0; default all")
      ->check(CLI::Range(0, 3));
  cli.add_option("--steps", s.steps, "training: Adam steps")->check(CLI::Range(1, 1000))->capture_default_str();
  cli.add_option("--blocks", s.model.blocks, "training: MLP blocks L")->check(CLI::Range(1, 1024))->capture_default_str();
  cli.add_option("--width", s.model.width, "training: width d")->check(CLI::Range(1, 4096))->capture_default_str();
  cli.add_option("--batch", s.model.batch, "training: rows per rank B")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  cli.add_flag("--benchmark", s.benchmark, "training: step times and bytes per stage and Nd, as CSV");

  program.validate([&](const Options& o) {
    s.model.seed = o.seed;
    const bool calculator_flags = !s.params_text.empty() || !s.preset.empty() || s.table ||
                                  cli.count("--dp") || cli.count("--device-gb");
    if (s.train && calculator_flags)
      throw UsageError("--params, --preset, --dp, --device-gb and --table are the calculator's: drop "
                       "them with --train (the ranks are the data-parallel devices)");
    const bool training_flags = s.stage >= 0 || cli.count("--steps") || cli.count("--blocks") ||
                                cli.count("--width") || cli.count("--batch") || s.benchmark;
    if (!s.train && training_flags)
      throw UsageError("--stage, --steps, --blocks, --width, --batch and --benchmark are for training: add --train");
    if (!s.params_text.empty() && !s.preset.empty())
      throw UsageError("--params and --preset both name the model: give one");
    if (!s.params_text.empty()) (void)parse_params(s.params_text);
    if (std::floor(s.dp) != s.dp)
      throw UsageError("--dp " + format_number(s.dp) + ": a number of devices is a whole number");
  });
  // Training, per rank: the model states (at most 16 bytes per parameter, twice: a run and
  // the reference weights), the data set (every rank draws all N B rows) and activations.
  program.memory_estimate([&](const Options& o) {
    if (!s.train) return 0.0;
    const double P = static_cast<double>(s.model.params());
    const double N = o.backend == "threads" || o.backend == "auto" ? o.ranks : 1;
    const double rows = static_cast<double>(s.model.batch) * o.ranks * s.model.width;
    const double act = 12.0 * s.model.batch * s.model.width * s.model.blocks;
    return N * (40.0 * P + 12.0 * rows + 4 * act);
  });
  program.writes_csv([&] { return s.benchmark; });
  program.supports_cuda();

  return program.run(argc, argv, [&](Context& ctx) {
    ctx.json()["chapter"] = "05_adam_memory";
    ctx.json()["mode"] = s.train ? "train" : "calculator";
    if (!s.train) {
      if (ctx.rank() == 0) calculator(ctx, s);
      return;
    }
    training(ctx, s);
  });
}
