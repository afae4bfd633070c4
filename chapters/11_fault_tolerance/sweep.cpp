// Chapter 11's sweep of the checkpoint interval (sweep.hpp).
#include "sweep.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "checkpoint.hpp"
#include "faults.hpp"
#include "shardlab/format.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/results.hpp"
#include "shardlab/timer.hpp"

namespace ch11 {

namespace fs = std::filesystem;
using shardlab::format_number;

namespace {

/// One run of the sweep: its attempts (rank 0's clock), each failure a rebuild and a load.
struct Run {
  std::vector<Attempt> attempts;
  double rebuild = 0;  ///< seconds spent building the model again and loading, all failures
  int failures = 0;
};

Run run_once(shardlab::Context& ctx, const SweepSettings& s, const ch09::Corpus& data, int every,
             const std::vector<Fault>& faults) {
  Run out;
  const std::string dir = s.dir + "/k" + std::to_string(every);
  if (ctx.rank() == 0) fs::remove_all(dir);
  ctx.comm().barrier();
  std::size_t next = 0;  // the next failure of the schedule
  const shardlab::Stopwatch clock;
  for (bool failed = true; failed;) {
    failed = false;
    Attempt rec;
    rec.start = clock.seconds();
    ch09::Mesh mesh(ctx.comm(), s.run.mesh);
    ch09::GptModel model(mesh, s.run.model, s.run.model_options());
    ch09::Trainer trainer(mesh, model, s.run, data);
    if (fs::exists(dir))
      rec.resumed = ch09::load_checkpoint(dir, model, &trainer.optimizer(), &trainer.scaler(),
                                          trainer.expert_optimizer());
    rec.ready = clock.seconds();
    if (!out.attempts.empty()) out.rebuild += rec.ready - rec.start;
    for (int t = rec.resumed; t < s.steps; ++t) {
      if (next < faults.size() && faults[next].step == t) {  // every rank knows the schedule
        rec.failure = faults[next++].spec;
        failed = true;
        ++out.failures;
        break;
      }
      const shardlab::Stopwatch step;
      (void)trainer.step(t);
      rec.steps.push_back(t);
      rec.step_s.push_back(step.seconds());
      if (every > 0 && (t + 1) % every == 0 && t + 1 < s.steps) {
        const shardlab::Stopwatch saving;
        ch09::save_checkpoint(dir, mesh, model, &trainer.optimizer(), t + 1, &trainer.scaler(),
                              trainer.expert_optimizer());
        rec.checkpoint_s.push_back(saving.seconds());
      }
    }
    ctx.comm().barrier();
    rec.end = clock.seconds();
    out.attempts.push_back(rec);
  }
  if (ctx.rank() == 0) fs::remove_all(dir);
  return out;
}

double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0 : sum / static_cast<double>(v.size());
}

}  // namespace

void sweep_waste(shardlab::Context& ctx, const SweepSettings& s) {
  const ch09::Corpus data = ch09::Corpus::load(s.data, s.run.model.context);
  // Per interval: each round's waste; over everything: the step, checkpoint and rebuild
  // times the formula takes.
  std::vector<std::vector<double>> waste(s.intervals.size());
  std::vector<double> step_s, checkpoint_s, rebuild_s;
  int failures = 0;
  for (int round = 0; round < s.rounds; ++round) {
    const std::vector<Fault> faults = draw_failures(
        s.mtbf_steps, s.seed + static_cast<std::uint64_t>(round), ctx.size(), s.steps);
    for (std::size_t k = 0; k < s.intervals.size(); ++k) {
      const Run r = run_once(ctx, s, data, s.intervals[k], faults);
      // Rank 0's clock decides (every rank waits for the slowest at each step anyway).
      const double fraction = ctx.comm().agree(
          ctx.rank() == 0 ? goodput_of(r.attempts).fraction() : 0.0, shardlab::ReduceOp::max);
      waste[k].push_back(1 - fraction);
      for (const Attempt& a : r.attempts) {
        step_s.insert(step_s.end(), a.step_s.begin(), a.step_s.end());
        checkpoint_s.insert(checkpoint_s.end(), a.checkpoint_s.begin(), a.checkpoint_s.end());
      }
      if (r.failures > 0) rebuild_s.push_back(r.rebuild / r.failures);
      failures += r.failures;
    }
  }
  // The formula's inputs, measured (rank 0's, agreed so that every rank prints the same).
  auto agreed = [&](double x) {
    return ctx.comm().agree(ctx.rank() == 0 ? x : 0.0, shardlab::ReduceOp::max);
  };
  const double step = agreed(mean(step_s)), delta = agreed(mean(checkpoint_s)),
               restart = agreed(mean(rebuild_s)), mtbf = s.mtbf_steps * step;
  const double young = std::sqrt(2 * delta * mtbf) / step;  // in steps

  shardlab::Table table({"interval_steps", "rounds", "waste", "waste_min", "waste_max", "formula",
                         "step_s", "checkpoint_s", "restart_s", "mtbf_steps"});
  std::size_t best = 0;
  for (std::size_t k = 0; k < s.intervals.size(); ++k) {
    const double t = s.intervals[k] * step;
    // The first-order overhead per second of useful work, as a share of the wall time.
    const double over = delta / t + (t / 2 + restart) / mtbf, formula = over / (1 + over);
    const auto [lo, hi] = std::minmax_element(waste[k].begin(), waste[k].end());
    table.add({s.intervals[k], s.rounds, mean(waste[k]), *lo, *hi, formula, step, delta, restart,
               s.mtbf_steps});
    if (mean(waste[k]) < mean(waste[best])) best = k;
  }
  ctx.report(table, "sweep",
             "\nthe waste (one less the goodput) against the checkpoint interval, " +
                 std::to_string(s.rounds) + " round(s) of " + std::to_string(s.steps) +
                 " steps, failures every " + format_number(s.mtbf_steps, 3) +
                 " steps on average (" + std::to_string(failures) +
                 " in all); the formula's share x / (1 + x) of x = delta/T + (T/2 + R)/M, the "
                 "overhead per second of work, with the measured step " +
                 format_number(1e3 * step, 3) + " ms, checkpoint " + format_number(1e3 * delta, 3) +
                 " ms and rebuild-and-load R " + format_number(1e3 * restart, 3) + " ms");
  ctx.say("\nYoung's interval: " + format_number(young, 3) +
          " steps; the least waste measured: every " + std::to_string(s.intervals[best]) +
          " steps");
  ctx.json()["young_steps"] = young;
  ctx.json()["best_interval"] = s.intervals[best];
  ctx.save_csv(table, "11_fault_tolerance");
}

}  // namespace ch11
