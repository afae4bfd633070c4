// Chapter 04 — pipeline bubbles: GPipe, 1F1B, interleaved 1F1B and ZB-H1, simulated,
// run on real ranks, timed and drawn.
//
// The course's picture (so-large-lm ch. 8 §2.2 "流水线并行"; CS336 lecture 7 §4.2): a
// model cut into stages on different devices, activations relayed from one to the next,
// and the price, the bubble, where devices sit idle waiting for each other. Microbatches
// shrink it; the order of forwards and backwards decides how much memory it costs. This
// chapter writes schedules down as data (schedule.hpp), simulates them exactly with given
// op costs (simulate.hpp), and runs them on ranks (pipeline.hpp): a model of Linear+tanh
// blocks cut into stages, activations and their gradients sent between neighbours, every
// op timed, and the gradients compared with a single-device run over the whole batch.
//
// Simplified: one model replica (no data parallelism), plain stages of equal blocks, no
// communication cost in the simulation, the loss on the last stage.
//
// Run:
//   build/default/bin/ch04_pipeline_bubbles --simulate                      every schedule, p=4,
//   m=8 build/default/bin/ch04_pipeline_bubbles --simulate --schedule zb1 --fwd-cost 1 --bwd-cost 1
//   --wgrad-cost 1 build/default/bin/ch04_pipeline_bubbles --ranks 2                       real
//   run, 2 stages build/default/bin/ch04_pipeline_bubbles --ranks 2 --width 512 --batch 512 --trace
//   run.json mpirun -np 4 build/default/bin/ch04_pipeline_bubbles --microbatches 8
//   build/default/bin/ch04_pipeline_bubbles --ranks 2 --benchmark --csv-dir results
//
// Expected: in simulation every bubble equals its formula; on ranks every schedule's
// gradients equal the single-device ones to rounding, and the measured bubble lies near
// the one simulated with the measured op costs.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "pipeline.hpp"
#include "schedule.hpp"
#include "shardlab/check.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/results.hpp"
#include "simulate.hpp"
#include "timeline.hpp"

using namespace shardlab;
using ch04::Kind;
using ch04::Schedule;
using ch04::Timeline;

namespace {

const std::vector<std::string> all_schedules = {"naive", "gpipe", "1f1b", "interleaved", "zb1"};

struct Settings {
  std::string schedule = "all";
  int microbatches = 8;
  int chunks = 2;  // interleaved only
  int stages = 0;  // 0: 4 in simulation, the number of ranks on ranks
  ch04::Costs costs;
  bool simulate = false;
  bool benchmark = false;
  std::string trace;
  ch04::ModelConfig model{8, 256, 128, 0};
};

std::string percent(double fraction) { return format_number(100 * fraction, 3) + "%"; }

std::string join(const std::vector<double>& values) {
  std::string s;
  for (double v : values) s += (s.empty() ? "" : " ") + format_number(v, 3);
  return s;
}

/// What the papers' formulas say for this schedule and these costs, where they say
/// something: bubble over the ideal time, and microbatches in flight per stage.
struct Formula {
  std::string text;          // "(p-1)/m", "" when no formula applies
  double over_ideal = -1;    // -1: none
  std::vector<double> peak;  // empty: none
};

Formula formula_for(const Schedule& s, const ch04::Costs& c, int batch_in_microbatches) {
  const int p = s.stages, m = s.microbatches, v = s.chunks;
  Formula f;
  if (s.name == "naive" || s.name == "gpipe" || s.name == "1f1b") {
    f.text = s.name == "naive" ? "p-1" : "(p-1)/m";
    f.over_ideal = static_cast<double>(p - 1) / m;
    for (int st = 0; st < p; ++st)
      f.peak.push_back(s.name == "1f1b" ? std::min(p - st, m) : batch_in_microbatches);
  } else if (s.name == "interleaved" && c.backward == 2 * c.forward && c.weight == 0) {
    f.text = "(p-1)/(v m)";
    f.over_ideal = static_cast<double>(p - 1) / (v * m);
  } else if (s.name == "zb1" && c.forward == c.backward && c.backward == c.weight && m >= p) {
    f.text = "(p-1)/(3m)";
    f.over_ideal = static_cast<double>(p - 1) / (3.0 * m);
    f.peak.assign(static_cast<std::size_t>(p), static_cast<double>(p));
  }
  return f;
}

std::string costs_text(const Schedule& s, const ch04::Costs& c) {
  std::string t = "t_f = " + format_number(c.forward) + ", ";
  if (s.split_backward())
    t += "t_b = " + format_number(c.backward) + " (B), t_w = " + format_number(c.weight) + " (W)";
  else
    t += "t_b = " + format_number(c.backward + c.weight) + " (B and W as one op)";
  return t;
}

/// The schedules this run shows: one, or all that the shape allows.
std::vector<std::string> chosen(const Settings& s, int p, std::vector<std::string>& skipped) {
  if (s.schedule != "all") return {s.schedule};
  std::vector<std::string> names;
  for (const std::string& n : all_schedules) {
    if (n == "interleaved" && s.microbatches % p != 0) {
      skipped.push_back("interleaved (--microbatches " + std::to_string(s.microbatches) +
                        " is not a multiple of " + std::to_string(p) + " stages)");
      continue;
    }
    if (n == "interleaved" && !s.simulate && s.model.layers < p * s.chunks) {
      skipped.push_back("interleaved (--layers " + std::to_string(s.model.layers) +
                        " cannot give " + std::to_string(p) + " stages x " +
                        std::to_string(s.chunks) + " chunks a block each)");
      continue;
    }
    names.push_back(n);
  }
  return names;
}

/// The naive schedule's one "microbatch" is the whole batch: m of the others' microbatches
/// (what its stages hold, counted like theirs).
void in_microbatches(Timeline& t, const Schedule& sched, int m) {
  if (sched.name == "naive")
    for (double& held : t.peak_in_flight) held *= m;
}

/// Builds and checks schedule `name`; a broken one is reported and gives nullopt.
std::optional<Schedule> build(Context& ctx, const std::string& name, int p, const Settings& s) {
  Schedule sched = ch04::make_schedule(name, p, s.microbatches, s.chunks);
  sched.name = name;
  const std::string problem = ch04::validate(sched);
  if (!ctx.verify(problem.empty(), name + ": " + problem)) return std::nullopt;
  return sched;
}

/// The summary every mode prints for one schedule, and its JSON.
void report(Context& ctx, const Schedule& sched, const Timeline& t, const Formula& f,
            nlohmann::json& j) {
  std::ostringstream out;
  out << "bubble " << percent(t.bubble_fraction()) << " of the total time, "
      << percent(t.bubble_over_ideal()) << " of the ideal";
  if (f.over_ideal >= 0) out << " (formula " << f.text << " = " << percent(f.over_ideal) << ")";
  out << "; microbatches in flight at most, per stage: " << join(t.peak_in_flight);
  if (!f.peak.empty()) out << " (formula: " << join(f.peak) << ")";
  ctx.say(out.str());
  j["makespan"] = t.makespan;
  j["bubble_fraction"] = t.bubble_fraction();
  j["bubble_over_ideal"] = t.bubble_over_ideal();
  j["peak_inflight_microbatches"] = t.peak_in_flight;
  j["stages"] = sched.stages;
  j["microbatches"] = sched.microbatches;
  j["chunks"] = sched.chunks;
  if (f.over_ideal >= 0) j["formula_bubble_over_ideal"] = f.over_ideal;
}

// ---------------------------------------------------------------------------
// On paper

void simulate_all(Context& ctx, const Settings& s, nlohmann::json& trace) {
  const int p = s.stages > 0 ? s.stages : 4;
  std::vector<std::string> skipped;
  const std::vector<std::string> names = chosen(s, p, skipped);
  ctx.say("Chapter 04 - pipeline schedules on paper: p = " + std::to_string(p) +
          " stages, m = " + std::to_string(s.microbatches) +
          " microbatches; each op takes its given time, and " + "sending takes none\n");
  int pid = 0;
  for (const std::string& name : names) {
    const auto built = build(ctx, name, p, s);
    if (!built) continue;
    const Schedule& sched = *built;
    // The naive schedule's one op carries all m microbatches.
    const double scale = name == "naive" ? s.microbatches : 1.0;
    Timeline t = ch04::simulate(sched, s.costs, scale);
    in_microbatches(t, sched, s.microbatches);
    ctx.say(name + (sched.chunks > 1 ? " (v = " + std::to_string(sched.chunks) + " chunks)" : "") +
            ": " + costs_text(sched, s.costs));
    if (!ctx.verify(t.deadlock.empty(), name + ": the schedule deadlocks: " + t.deadlock)) {
      ctx.say("  deadlock: " + t.deadlock + "\n");
      continue;
    }
    ctx.say(ch04::draw(t, ch04::cell_for(t), ctx.color()));
    const Formula f = formula_for(sched, s.costs, s.microbatches);
    auto& j = ctx.json()["schedules"][name];
    report(ctx, sched, t, f, j);
    ctx.say("");
    if (f.over_ideal >= 0)
      ctx.verify(
          std::fabs(t.bubble_over_ideal() - f.over_ideal) <= 1e-9 * std::max(1.0, f.over_ideal),
          name + ": the simulated bubble " + format_number(t.bubble_over_ideal()) +
              " of the ideal differs from the formula's " + format_number(f.over_ideal));
    if (!f.peak.empty())
      ctx.verify(t.peak_in_flight == f.peak, name + ": microbatches in flight " +
                                                 join(t.peak_in_flight) + ", formula " +
                                                 join(f.peak));
    ch04::add_trace(trace, t, pid++, name, sched.chunks, 1000.0);  // 1 unit = 1 ms
  }
  for (const std::string& n : skipped) ctx.say("skipped: " + n);
}

// ---------------------------------------------------------------------------
// On ranks

struct RealRun {
  Schedule schedule;
  Timeline measured, simulated;
  double grad_diff = 0, grad_scale = 0, loss = 0, reference_loss = 0;
  std::uint64_t bytes = 0;  // sent by all stages together
};

/// Runs `sched` on the ranks, times it, simulates it with the measured op costs, and
/// compares the gradients with the single-device reference.
RealRun run_on_ranks(Context& ctx, const Schedule& sched, const Settings& s,
                     const ch04::Batch& batch, ch04::Reference& ref) {
  Communicator& comm = ctx.comm();
  RealRun r{sched, {}, {}, 0, 0, 0, 0, 0};
  ch04::StageModel model(s.model, comm.rank(), sched.stages, sched.chunks, ctx.memory());
  // Once untimed first (the first touches of fresh memory would count as compute), then
  // the fastest of three runs: on a shared machine, one run can lose a core for a while.
  model.store().zero_grad();
  (void)ch04::run_schedule(comm, sched, model, batch);
  ch04::StageRun run;
  std::vector<ch04::Event> events;
  double fastest = 0;
  for (int round = 0; round < 3; ++round) {
    model.store().zero_grad();
    ch04::StageRun attempt = ch04::run_schedule(comm, sched, model, batch);
    std::vector<ch04::Event> all = ch04::gather_events(comm, attempt.events);
    const double makespan =
        ch04::timeline_of(all, sched.stages, sched.chunks, sched.split_backward()).makespan;
    if (round == 0 || makespan < fastest) {
      fastest = makespan;
      run = std::move(attempt);
      events = std::move(all);
    }
  }
  r.measured = ch04::timeline_of(events, sched.stages, sched.chunks, sched.split_backward());
  r.simulated = ch04::simulate(sched, ch04::measured_costs(events));
  in_microbatches(r.measured, sched, s.microbatches);
  in_microbatches(r.simulated, sched, s.microbatches);
  r.grad_diff = comm.agree(ch04::max_gradient_diff(model, ref), ReduceOp::max);
  r.grad_scale = max_abs(ref.store.grads());
  r.loss = comm.agree(run.squared_error, ReduceOp::sum) / (2.0 * s.model.batch);
  r.bytes = static_cast<std::uint64_t>(
      comm.agree(static_cast<std::int64_t>(run.bytes_sent), ReduceOp::sum));
  r.reference_loss = ref.squared_error / (2.0 * s.model.batch);
  return r;
}

void run_all(Context& ctx, const Settings& s, nlohmann::json& trace,
             std::vector<RealRun>* runs = nullptr) {
  const int p = ctx.size();
  if (s.stages > 0 && s.stages != p)  // under mpirun: the processes it started
    throw UsageError("--stages " + std::to_string(s.stages) + " on ranks needs " +
                     std::to_string(s.stages) + " ranks, not " + std::to_string(p));
  std::vector<std::string> skipped;
  const std::vector<std::string> names = chosen(s, p, skipped);
  ctx.say("Chapter 04 - pipeline schedules on " + std::to_string(p) + " ranks (" +
          std::string(ctx.comm().backend()) +
          "), one stage each: " + std::to_string(s.model.layers) + " blocks of Linear(" +
          std::to_string(s.model.width) + ", " + std::to_string(s.model.width) +
          ") + tanh, batch " + std::to_string(s.model.batch) +
          " in m = " + std::to_string(s.microbatches) + " microbatches\n");
  const ch04::Batch batch = ch04::make_batch(s.model);
  ch04::Reference ref;
  ch04::run_reference(s.model, batch, ref);
  // Relative tolerance of the gradients: the microbatches sum in another order.
  const double tolerance = ctx.on_gpu() ? 1e-4 : 1e-5;
  int pid = 0;
  std::ostringstream table;
  table << "\nschedule      bubble measured   simulated (measured op costs)   ratio   grad max "
           "diff\n";
  for (const std::string& name : names) {
    const auto built = build(ctx, name, p, s);
    if (!built) continue;
    const Schedule& sched = *built;
    // On paper first: a schedule that deadlocks is reported, not run into the timeout.
    const Timeline paper = ch04::simulate(sched, s.costs);
    if (!ctx.verify(paper.deadlock.empty(), name + ": the schedule deadlocks: " + paper.deadlock))
      continue;
    const RealRun r = run_on_ranks(ctx, sched, s, batch, ref);
    ctx.say(name + (sched.chunks > 1 ? " (v = " + std::to_string(sched.chunks) + " chunks)" : "") +
            ", measured (" + format_number(r.measured.makespan * 1e3, 3) + " ms):");
    ctx.say(ch04::draw(r.measured, r.measured.makespan / 100, ctx.color()));
    auto& j = ctx.json()["schedules"][name];
    report(ctx, sched, r.measured, formula_for(sched, s.costs, s.microbatches), j);
    const double ratio = r.measured.bubble_fraction() / r.simulated.bubble_fraction();
    ctx.say("simulated with the measured op costs: bubble " +
            percent(r.simulated.bubble_fraction()) + " of the total time; gradients vs one " +
            "device: max abs diff " + format_number(r.grad_diff, 3) + " (largest gradient " +
            format_number(r.grad_scale, 3) + "); loss " + format_number(r.loss, 6) + " vs " +
            format_number(r.reference_loss, 6));
    const std::uint64_t formula = ch04::formula_bytes(s.model, p, sched.chunks);
    ctx.say("sent between stages: " + std::to_string(r.bytes) + " bytes in all, measured; " +
            "formula 2 (p v - 1) x batch x width x 4 = " + std::to_string(formula) + "\n");
    j["bytes_sent"] = r.bytes;
    j["formula_bytes_sent"] = formula;
    ctx.verify(r.bytes == formula, name + ": stages sent " + std::to_string(r.bytes) +
                                       " bytes, the formula says " + std::to_string(formula));
    char line[200];
    std::snprintf(line, sizeof line, "%-13s %-17s %-31s %-7s %s\n", name.c_str(),
                  percent(r.measured.bubble_fraction()).c_str(),
                  percent(r.simulated.bubble_fraction()).c_str(), format_number(ratio, 3).c_str(),
                  format_number(r.grad_diff, 3).c_str());
    table << line;
    j["measured_bubble_fraction"] = r.measured.bubble_fraction();
    j["simulated_bubble_fraction"] = r.simulated.bubble_fraction();
    j["vs_single_device_max_abs_diff"] = r.grad_diff;
    ctx.verify(r.grad_diff <= tolerance * std::max(r.grad_scale, 1e-30),
               name + ": gradients differ from the single-device run by " +
                   format_number(r.grad_diff) + " (largest gradient " +
                   format_number(r.grad_scale) + ", tolerance " + format_number(tolerance) +
                   " of it)");
    ch04::add_trace(trace, r.measured, pid++, name, sched.chunks, 1e6);  // seconds -> us
    if (runs) runs->push_back(r);
  }
  for (const std::string& n : skipped) ctx.say("skipped: " + n);
  ctx.say(table.str());
  if (p > static_cast<int>(std::thread::hardware_concurrency()))
    ctx.say("(more ranks than cores: stages share cores, and the measured bubble grows)");
}

// ---------------------------------------------------------------------------
// Benchmark: every schedule over a sweep of microbatch counts, best of three runs each

void benchmark(Context& ctx, const Settings& s, const std::vector<RealRun>& at_default) {
  const int p = ctx.size();
  const std::string machine = machine_description(), backend(ctx.comm().backend());
  // Every op of the runs above (m = --microbatches), measured and simulated: the Gantt
  // charts.
  CsvTable events({"schedule", "source", "stages", "microbatches", "chunks", "stage", "kind",
                   "microbatch", "chunk", "start_ms", "end_ms", "backend", "machine"});
  for (const RealRun& r : at_default)
    for (const auto& [source, t] :
         {std::pair{"measured", &r.measured}, {"simulated", &r.simulated}})
      for (const ch04::Event& e : t->events)
        events.add({r.schedule.name, source, std::to_string(p),
                    std::to_string(r.schedule.microbatches), std::to_string(r.schedule.chunks),
                    std::to_string(e.stage), std::string(1, "FBW"[static_cast<int>(e.op.kind)]),
                    std::to_string(e.op.microbatch), std::to_string(e.op.chunk),
                    format_number(e.start * 1e3, 6), format_number(e.end * 1e3, 6), backend,
                    machine});
  ctx.save_csv(events, "04_pipeline_bubbles_events");

  CsvTable sweep({"schedule", "stages", "microbatches", "chunks", "measured_bubble",
                  "simulated_bubble", "formula_bubble", "makespan_ms", "peak_in_flight",
                  "grad_max_abs_diff", "bytes_sent", "layers", "width", "batch", "backend",
                  "machine"});
  const ch04::Batch batch = ch04::make_batch(s.model);
  ch04::Reference ref;
  ch04::run_reference(s.model, batch, ref);
  ctx.say("benchmark: every schedule for m = 1, 2, 4, ... up to " +
          std::to_string(std::min(64, s.model.batch)) + " microbatches, best of 3 runs each");
  for (int m = 1; m <= std::min(64, s.model.batch); m *= 2) {
    Settings at = s;
    at.microbatches = m;
    at.schedule = "all";
    std::vector<std::string> skipped;
    for (const std::string& name : chosen(at, p, skipped)) {
      Schedule sched = ch04::make_schedule(name, p, m, at.chunks);
      sched.name = name;
      if (!ch04::validate(sched).empty() || !ch04::simulate(sched, at.costs).deadlock.empty())
        continue;  // reported by the run above
      const std::optional<RealRun> best = run_on_ranks(ctx, sched, at, batch, ref);
      const Formula f = formula_for(sched, at.costs, m);
      sweep.add({name, std::to_string(p), std::to_string(m), std::to_string(sched.chunks),
                 format_number(best->measured.bubble_fraction()),
                 format_number(best->simulated.bubble_fraction()),
                 f.over_ideal >= 0 ? format_number(f.over_ideal / (1 + f.over_ideal)) : "",
                 format_number(best->measured.makespan * 1e3), join(best->measured.peak_in_flight),
                 format_number(best->grad_diff, 3), std::to_string(best->bytes),
                 std::to_string(s.model.layers), std::to_string(s.model.width),
                 std::to_string(s.model.batch), backend, machine});
    }
  }
  ctx.save_csv(sweep, "04_pipeline_bubbles");
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch04_pipeline_bubbles",
                  "Chapter 04: pipeline bubbles - GPipe, 1F1B, interleaved and ZB-H1 schedules");
  Settings s;
  auto& cli = program.cli();
  cli.add_option("--schedule", s.schedule, "naive, gpipe, 1f1b, interleaved, zb1 or all")
      ->check(CLI::IsMember({"naive", "gpipe", "1f1b", "interleaved", "zb1", "all"}))
      ->capture_default_str();
  cli.add_option("-m,--microbatches", s.microbatches, "pieces the batch is cut into")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cli.add_option("-v,--chunks", s.chunks, "model chunks per stage (interleaved)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cli.add_option("-p,--stages", s.stages, "stages (simulation: default 4; on ranks: the ranks)")
      ->check(CLI::Range(1, 1024));
  cli.add_flag("--simulate", s.simulate, "on paper only, with the op costs below");
  cli.add_option("--fwd-cost", s.costs.forward, "simulation: time of a forward (F)")
      ->check(cli::between(1e-6, 1e6))
      ->capture_default_str();
  cli.add_option("--bwd-cost", s.costs.backward,
                 "simulation: time of a backward's input gradient (B)")
      ->check(cli::between(1e-6, 1e6))
      ->capture_default_str();
  cli.add_option("--wgrad-cost", s.costs.weight,
                 "simulation: time of a backward's weight gradient (W; part of B when not split)")
      ->check(cli::between(0.0, 1e6))
      ->capture_default_str();
  cli.add_option("--layers", s.model.layers, "blocks of the model (on ranks)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cli.add_option("--width", s.model.width, "width of every block")
      ->check(CLI::Range(1, 8192))
      ->capture_default_str();
  cli.add_option("--batch", s.model.batch, "rows of the batch")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cli.add_option("--trace", s.trace, "write the timelines as Chrome trace JSON (Perfetto)");
  cli.add_flag("--benchmark", s.benchmark, "on ranks: sweep the microbatches, write CSV");

  program.validate([&](const Options& o) {
    s.model.seed = o.seed;
    if (s.simulate) {
      if (s.benchmark) throw UsageError("--benchmark runs on ranks: drop --simulate");
    } else {
      const int p = s.stages > 0 ? s.stages : o.ranks;
      if (s.stages > 0 && s.stages != o.ranks && o.backend != "mpi")
        throw UsageError("--stages " + std::to_string(s.stages) + " on ranks needs --ranks " +
                         std::to_string(s.stages) + " (one stage per rank), not " +
                         std::to_string(o.ranks) + "; or add --simulate");
      // Every stage chunk needs a block (with --schedule all, the interleaved schedule is
      // left out when only the others fit).
      const int pieces = p * (s.schedule == "interleaved" ? s.chunks : 1);
      if (s.model.layers < pieces)
        throw UsageError("--layers " + std::to_string(s.model.layers) + " cannot give " +
                         std::to_string(pieces) + " stage chunks a block each" +
                         (s.schedule == "interleaved" ? " (" + std::to_string(p) + " stages x " +
                                                            std::to_string(s.chunks) + " chunks)"
                                                      : std::string()) +
                         ": use --layers " + std::to_string(pieces) + " or more");
      if (s.model.batch < s.microbatches)
        throw UsageError("--batch " + std::to_string(s.model.batch) + " cannot be cut into " +
                         std::to_string(s.microbatches) + " microbatches");
    }
    const int p = s.stages > 0 ? s.stages : (s.simulate ? 4 : o.ranks);
    // Each op is an event to simulate, draw and keep: a million is plenty to look at.
    const double ops = 3.0 * p * s.microbatches * s.chunks;
    if (ops > 1e6)
      throw UsageError(std::to_string(p) + " stages x " + std::to_string(s.microbatches) +
                       " microbatches x " + std::to_string(s.chunks) + " chunks make " +
                       format_number(ops, 3) + " ops: more than a million to simulate; use fewer");
    if (s.schedule == "interleaved" && s.microbatches % p != 0)
      throw UsageError("the interleaved schedule takes microbatches p at a time: --microbatches " +
                       std::to_string(s.microbatches) + " is not a multiple of " +
                       std::to_string(p) + " stages");
    if (!s.trace.empty())
      check_writable_folder(std::filesystem::absolute(s.trace).parent_path(),
                            "--trace " + s.trace + ": its folder");
  });
  // Memory, per rank: its blocks' weights and gradients, the activations of every
  // microbatch it may hold (at most the whole batch: GPipe), and the single-device
  // reference (the whole model and batch); the ranks of a threads job share this machine.
  program.memory_estimate([&](const Options& o) {
    if (s.simulate) return 0.0;
    const double L = s.model.layers, d = s.model.width, B = s.model.batch;
    const double per_rank = 4.0 * (2 * L * d * d / o.ranks + 3 * B * d * L / o.ranks) +
                            4.0 * (2 * L * d * d + 3 * B * d * L + 2 * B * d);
    return per_rank * (o.backend == "threads" || o.backend == "auto" ? o.ranks : 1);
  });
  program.writes_csv([&] { return s.benchmark; });
  program.supports_cuda();

  return program.run(argc, argv, [&](Context& ctx) {
    ctx.json()["chapter"] = "04_pipeline_bubbles";
    ctx.json()["schedule"] = s.schedule;
    nlohmann::json trace = nlohmann::json::array();
    if (s.simulate) {
      if (ctx.rank() == 0) simulate_all(ctx, s, trace);
    } else if (s.benchmark) {
      std::vector<RealRun> runs;
      run_all(ctx, s, trace, &runs);
      benchmark(ctx, s, runs);
    } else {
      run_all(ctx, s, trace);
    }
    // One schedule: its numbers at the top of the JSON too.
    if (s.schedule != "all" && ctx.json().contains("schedules") &&
        ctx.json()["schedules"].contains(s.schedule))
      for (auto& [key, value] : ctx.json()["schedules"][s.schedule].items())
        ctx.json()[key] = value;
    if (!s.trace.empty() && ctx.rank() == 0) {
      write_file_atomic(s.trace,
                        nlohmann::json{{"traceEvents", trace}, {"displayTimeUnit", "ms"}}.dump());
      ctx.say("wrote " + s.trace + " (open it in ui.perfetto.dev or chrome://tracing)");
      ctx.json()["trace"] = s.trace;
    }
  });
}
