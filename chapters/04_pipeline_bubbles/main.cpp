// Chapter 04 — pipeline bubbles: GPipe, 1F1B, interleaved 1F1B and ZB-H1, simulated,
// run on real ranks, timed and drawn.
//
// The course's picture (so-large-lm ch. 8 §2.2 "流水线并行"; CS336 lecture 7 §4.2): a
// model cut into stages on different devices, activations relayed from one to the next,
// and the price, the bubble, where devices sit idle waiting for each other. Microbatches
// shrink it; the order of forwards and backwards decides how much memory it costs. This
// chapter writes schedules down as data (schedule.hpp), simulates them exactly with given
// op costs (simulate.hpp), and runs them on ranks with a runtime that takes any model made
// of nn layers (pipeline.hpp). Here the model is the toy one (toy_stage.hpp): Linear+tanh
// blocks cut into stages, every op timed, the gradients compared with one device's.
//
// Simplified: one model replica (no data parallelism), plain stages of equal blocks, no
// communication cost in the simulation, the loss on the last stage.
//
// Run:
//   build/default/bin/ch04_pipeline_bubbles --simulate           every schedule, p = 4, m = 8
//   build/default/bin/ch04_pipeline_bubbles --simulate --schedule zb1 --fwd-cost 1
//       --bwd-cost 1 --wgrad-cost 1                              ZB-H1 with its paper's costs
//   build/default/bin/ch04_pipeline_bubbles --ranks 2            real run, 2 stages
//   build/default/bin/ch04_pipeline_bubbles --ranks 2 --width 512 --batch 512 --trace run.json
//   mpirun -np 4 build/default/bin/ch04_pipeline_bubbles --microbatches 8
//   build/default/bin/ch04_pipeline_bubbles --ranks 2 --benchmark --csv-dir results
//
// Expected: in simulation every bubble equals its formula; on ranks every schedule's
// gradients equal the single-device ones to rounding, the bytes sent their formula, and
// the measured bubble lies near the one simulated with the measured op costs.
#include <algorithm>
#include <nlohmann/json.hpp>
#include <thread>

#include "pipeline.hpp"
#include "schedule.hpp"
#include "settings.hpp"
#include "shardlab/launch.hpp"
#include "simulate.hpp"
#include "timeline.hpp"
#include "toy_stage.hpp"

using namespace shardlab;
using ch04::Schedule;
using ch04::Timeline;

namespace {

Cell formula_cell(double value) { return value >= 0 ? Cell(value) : Cell(""); }

/// The schedules of this run for m microbatches on p stages, each checked on paper first:
/// one that is broken or deadlocks is reported (when `report`), not run into the timeout.
std::vector<Schedule> chosen(Context& ctx, const ch04::Settings& s, int p, int m, bool report) {
  std::vector<std::string> skipped;
  std::vector<Schedule> schedules;
  for (const std::string& name : ch04::schedules_to_show(
           report ? s.schedule : "all", p, m, s.chunks, s.simulate ? 0 : s.model.layers, skipped)) {
    Schedule sched = ch04::make_schedule(name, p, m, s.chunks);
    const std::string problem = ch04::problems(sched, s.costs);
    if (problem.empty()) schedules.push_back(std::move(sched));
    if (report) ctx.verify(problem.empty(), problem);
  }
  for (const std::string& n : skipped)
    if (report) ctx.say("skipped: " + n);
  return schedules;
}

// ---------------------------------------------------------------------------
// On paper: each op takes its given time; every bubble against its paper's formula

void simulate_all(Context& ctx, const ch04::Settings& s, nlohmann::json& trace) {
  const int p = s.stages > 0 ? s.stages : 4, m = s.microbatches;
  ctx.say("Chapter 04 - pipeline schedules on paper: p = " + std::to_string(p) +
          " stages, m = " + std::to_string(m) +
          " microbatches; each op takes its given time, and sending takes none\n");
  Table table({"schedule", "chunks", "makespan", "bubble_fraction", "bubble_over_ideal", "formula",
               "formula_bubble_over_ideal", "peak_inflight_microbatches", "formula_peak"});
  int pid = 0;
  for (const Schedule& sched : chosen(ctx, s, p, m, true)) {
    const std::string& name = sched.name;
    // The naive schedule's one op carries all m microbatches.
    Timeline t = ch04::simulate(sched, s.costs, name == "naive" ? m : 1.0);
    ch04::count_in_microbatches(t, sched, m);
    ctx.say(name + ": " + ch04::costs_text(sched, s.costs) + "\n" +
            ch04::draw(t, ch04::cell_for(t), ctx.color()));
    const ch04::Formula f = ch04::formula_for(sched, s.costs, m);
    table.add({name, sched.chunks, t.makespan, t.bubble_fraction(), t.bubble_over_ideal(), f.text,
               formula_cell(f.over_ideal), ch04::join_numbers(t.peak_in_flight),
               ch04::join_numbers(f.peak)});
    const std::string mismatch = ch04::formula_mismatch(name, t, f);
    ctx.verify(mismatch.empty(), mismatch);
    if (!s.trace.empty()) ch04::add_trace(trace, t, pid++, name, sched.chunks, 1000.0);  // 1 ms
  }
  ctx.report(table, "schedules", "bubble: idle over the total time, and over the ideal (busy)");
}

// ---------------------------------------------------------------------------
// On ranks: the runtime (pipeline.hpp) over the toy model, each op timed

/// One schedule on the ranks, its gradients against one device's: they may differ by a
/// 1e-5 of the largest (1e-4 on a GPU), or 10 sqrt(batch) u for a long batch — the
/// microbatches' gradients are summed one after the other instead of in one matmul, and
/// such a sum's rounding grows like sqrt(terms) u (Higham & Mary 2019's probabilistic
/// bound); and its bytes against their formula.
ch04::Measured run_one(Context& ctx, ch04::Pipeline& pipeline, const Schedule& sched,
                       const ch04::Settings& s, int m, const ch04::Batch& batch,
                       ch04::Reference& ref) {
  ch04::Measured r = ch04::measure(pipeline, sched, s.model, batch, ref, ctx.memory(), m);
  const double relative = std::max(ctx.on_gpu() ? 1e-4 : 1e-5,
                                   10 * std::sqrt(static_cast<double>(s.model.batch)) * 0x1p-24);
  const double tolerance = relative * std::max(max_abs(ref.store.grads()), 1e-30);
  r.grad_diff = ctx.verify_close(
      "the gradient of " + sched.name + " (m = " + std::to_string(m) + ")", r.grad_diff, tolerance);
  const std::uint64_t formula = ch04::formula_bytes(s.model, sched.stages, sched.chunks);
  ctx.verify(r.bytes == formula, sched.name + ": stages sent " + std::to_string(r.bytes) +
                                     " bytes, the formula 2 (p v - 1) x batch x width x 4 says " +
                                     std::to_string(formula));
  return r;
}

std::vector<ch04::Measured> run_all(Context& ctx, const ch04::Settings& s, nlohmann::json& trace) {
  const int p = ctx.size(), m = s.microbatches, w = s.model.width;
  ctx.say("Chapter 04 - pipeline schedules on " + std::to_string(p) +
          " ranks, one stage each: " + std::to_string(s.model.layers) + " blocks of Linear(" +
          std::to_string(w) + ", " + std::to_string(w) + ") + tanh, batch " +
          std::to_string(s.model.batch) + " in m = " + std::to_string(m) + " microbatches\n");
  // The reference: one device, the whole model on the whole batch.
  const ch04::Batch batch = ch04::make_batch(s.model);
  ch04::Reference ref;
  ch04::run_reference(s.model, batch, ref);
  ch04::Pipeline pipeline(ctx.comm());
  Table bubbles({"schedule", "chunks", "makespan", "measured_bubble_fraction",
                 "simulated_bubble_fraction", "bubble_ratio", "bubble_over_ideal",
                 "formula_bubble_over_ideal", "peak_inflight_microbatches"});
  Table checks({"schedule", "vs_single_device_max_abs_diff", "loss", "reference_loss", "bytes_sent",
                "formula_bytes_sent"});
  std::vector<ch04::Measured> runs;
  int pid = 0;
  for (const Schedule& sched : chosen(ctx, s, p, m, true)) {
    const std::string& name = sched.name;
    const ch04::Measured r = run_one(ctx, pipeline, sched, s, m, batch, ref);
    const Timeline& t = r.measured;
    ctx.say(name + ", measured (" + format_number(t.makespan * 1e3, 3) + " ms):\n" +
            ch04::draw(t, t.makespan / 100, ctx.color()));
    // Measured over simulated bubble; none where the simulation has no bubble to compare.
    const double simulated = r.simulated.bubble_fraction();
    const Cell ratio = simulated > 0 ? Cell(t.bubble_fraction() / simulated) : Cell("");
    bubbles.add({name, sched.chunks, t.makespan, t.bubble_fraction(), simulated, ratio,
                 t.bubble_over_ideal(),
                 formula_cell(ch04::formula_for(sched, s.costs, m).over_ideal),
                 ch04::join_numbers(t.peak_in_flight)});
    checks.add({name, r.grad_diff, r.loss, ref.loss, r.bytes,
                ch04::formula_bytes(s.model, p, sched.chunks)});
    if (!s.trace.empty()) ch04::add_trace(trace, t, pid++, name, sched.chunks, 1e6);  // s -> us
    runs.push_back(r);
  }
  ctx.report(bubbles, "schedules",
             "bubble: measured, and simulated with the measured op costs (makespan in s)");
  ctx.report(checks, "checks",
             "\nagainst one device (gradients, loss) and 2 (p v - 1) x batch x width x 4 (bytes)");
  if (p > static_cast<int>(std::thread::hardware_concurrency()))
    ctx.say("(more ranks than cores: stages share cores, and the measured bubble grows)");
  return runs;
}

// ---------------------------------------------------------------------------
// Benchmark: every schedule over a sweep of microbatch counts, best of three runs each

void benchmark(Context& ctx, const ch04::Settings& s,
               const std::vector<ch04::Measured>& at_default) {
  const int p = ctx.size(), most = std::min(64, s.model.batch);
  const std::string machine = machine_description(), backend(ctx.comm().backend());
  // Every op of the runs above (m = --microbatches), measured and simulated: the Gantt charts.
  Table events = ch04::events_table();
  for (const ch04::Measured& r : at_default) {
    ch04::add_events(events, r.schedule, "measured", r.measured, backend, machine);
    ch04::add_events(events, r.schedule, "simulated", r.simulated, backend, machine);
  }
  ctx.save_csv(events, "04_pipeline_bubbles_events");

  Table sweep({"schedule", "stages", "microbatches", "chunks", "measured_bubble",
               "simulated_bubble", "formula_bubble", "makespan_ms", "peak_in_flight",
               "grad_max_abs_diff", "bytes_sent", "layers", "width", "batch", "backend",
               "machine"});
  const ch04::Batch batch = ch04::make_batch(s.model);
  ch04::Reference ref;
  ch04::run_reference(s.model, batch, ref);
  ch04::Pipeline pipeline(ctx.comm());
  ctx.say("benchmark: every schedule for m = 1, 2, 4, ... up to " + std::to_string(most) +
          " microbatches, best of 3 runs each");
  for (int m = 1; m <= most; m *= 2) {
    for (const Schedule& sched : chosen(ctx, s, p, m, false)) {
      const std::string& name = sched.name;
      // At m = --microbatches, the runs shown above are this row: one measurement, not two.
      const auto shown = std::find_if(at_default.begin(), at_default.end(), [&](const auto& r) {
        return m == s.microbatches && r.schedule.name == name;
      });
      const ch04::Measured r =
          shown != at_default.end() ? *shown : run_one(ctx, pipeline, sched, s, m, batch, ref);
      const double f = ch04::formula_for(sched, s.costs, m).over_ideal;
      sweep.add({name, p, m, sched.chunks, r.measured.bubble_fraction(),
                 r.simulated.bubble_fraction(), formula_cell(f >= 0 ? f / (1 + f) : -1),
                 r.measured.makespan * 1e3, ch04::join_numbers(r.measured.peak_in_flight),
                 r.grad_diff, r.bytes, s.model.layers, s.model.width, s.model.batch, backend,
                 machine});
    }
  }
  ctx.save_csv(sweep, "04_pipeline_bubbles");
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch04_pipeline_bubbles",
                  "Chapter 04: pipeline bubbles - GPipe, 1F1B, interleaved and ZB-H1 schedules");
  ch04::Settings s;
  ch04::add_flags(program, s);  // settings.hpp: the flags, what they must satisfy, the memory
  return program.run(argc, argv, [&](Context& ctx) {
    nlohmann::json& json = ctx.json();
    json["chapter"] = "04_pipeline_bubbles";
    json["schedule"] = s.schedule;
    nlohmann::json trace = nlohmann::json::array();
    if (s.simulate) {
      if (ctx.rank() == 0) simulate_all(ctx, s, trace);
    } else {
      const std::vector<ch04::Measured> runs = run_all(ctx, s, trace);
      if (s.benchmark) benchmark(ctx, s, runs);
    }
    // One schedule: its numbers at the top of the JSON too.
    for (const char* table : {"schedules", "checks"})
      if (s.schedule != "all" && json.contains(table) && !json[table].empty())
        for (auto& [key, value] : json[table][0].items()) json[key] = value;
    if (!s.trace.empty() && ctx.rank() == 0) {
      ch04::write_trace(s.trace, trace);
      ctx.say("wrote " + s.trace + " (open it in ui.perfetto.dev or chrome://tracing)");
      json["trace"] = s.trace;
    }
  });
}
