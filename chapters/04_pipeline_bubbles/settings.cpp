// Chapter 04: the chapter program's flags and their checks (settings.hpp).
#include "settings.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <filesystem>

#include "shardlab/check.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/results.hpp"

namespace ch04 {

using shardlab::require_usage;

namespace {
/// The schedules that run several chunks per stage, by name.
std::string chunked_names() {
  std::string out;
  for (const ScheduleInfo& info : schedules())
    if (info.chunked) out += (out.empty() ? "" : ", ") + std::string(info.name);
  return out;
}
}  // namespace

void add_flags(shardlab::Program& program, Settings& s) {
  CLI::App& app = program.cli();
  std::vector<std::string> names = schedule_names();
  names.emplace_back("all");
  std::string listed;
  for (const std::string& n : names) listed += (listed.empty() ? "" : ", ") + n;
  for (CLI::Option* option :
       {app.add_option("--schedule", s.schedule, "a schedule, or all of them: " + listed)
            ->check(CLI::IsMember(names)),
        app.add_option("-m,--microbatches", s.microbatches, "pieces the batch is cut into")
            ->check(shardlab::cli::whole(1, 4096)),
        app.add_option("-v,--chunks", s.chunks, "model chunks per stage (interleaved)")
            ->check(shardlab::cli::whole(1, 64)),
        app.add_option("--fwd-cost", s.costs.forward, "simulation: time of a forward (F)")
            ->check(shardlab::cli::between(1e-6, 1e6)),
        app.add_option("--bwd-cost", s.costs.backward,
                       "simulation: time of a backward's input gradient (B)")
            ->check(shardlab::cli::between(1e-6, 1e6)),
        app.add_option("--wgrad-cost", s.costs.weight,
                       "simulation: time of a backward's weight gradient (W; part of B when not "
                       "split)")
            ->check(shardlab::cli::between(0.0, 1e6)),
        app.add_option("--layers", s.model.layers, "blocks of the model (on ranks)")
            ->check(shardlab::cli::whole(1, 4096)),
        app.add_option("--width", s.model.width, "width of every block")
            ->check(shardlab::cli::whole(1, 8192)),
        app.add_option("--batch", s.model.batch, "rows of the batch")
            ->check(shardlab::cli::whole(1, 1 << 20))})
    option->capture_default_str();
  app.add_option("-p,--stages", s.stages, "stages (simulation: default 4; on ranks: the ranks)")
      ->check(shardlab::cli::whole(1, 1024));
  app.add_flag("--simulate", s.simulate, "on paper only, with the op costs above");
  CLI::Option* trace =
      app.add_option("--trace", s.trace, "write the timelines as Chrome trace JSON (Perfetto)");
  app.add_flag("--benchmark", s.benchmark, "on ranks: sweep the microbatches, write CSV");

  const CLI::Option* chunks = app.get_option("--chunks");
  program.validate([&s, trace, chunks](const shardlab::Options& o) {
    require_usage(chunks->count() == 0 || s.schedule == "all" || schedule_info(s.schedule).chunked,
                  "--chunks " + std::to_string(s.chunks) + ": " + s.schedule +
                      " runs one chunk per stage; --chunks is for a schedule of chunks (" +
                      chunked_names() + ")");
    s.model.seed = o.seed;
    require_usage(!(s.simulate && s.benchmark), "--benchmark runs on ranks: drop --simulate");
    require_usage(s.simulate || s.model.batch >= s.microbatches,
                  "--batch " + std::to_string(s.model.batch) + " cannot be cut into " +
                      std::to_string(s.microbatches) + " microbatches");
    if (trace->count() > 0) shardlab::check_writable_file(s.trace, "--trace");
  });
  // On ranks, one stage per rank; every stage chunk needs a block of the model (with
  // --schedule all, the interleaved schedule is left out when only the others fit).
  program.world_size([&s](const shardlab::Options&, int ranks) {
    const int p = s.stages > 0 ? s.stages : (s.simulate ? 4 : ranks);
    require_usage(s.simulate || p == ranks, "--stages " + std::to_string(p) + " on ranks needs " +
                                                std::to_string(p) +
                                                " ranks (one stage per rank), not " +
                                                std::to_string(ranks) + "; or add --simulate");
    require_shape(s.schedule, p, s.microbatches, s.chunks, s.simulate ? 0 : s.model.layers);
  });
  // Memory: what each rank holds (toy_stage.hpp); the ranks of a threads job share this
  // machine.
  program.memory_estimate([&s](const shardlab::Options& o) {
    // The simulation: every schedule's ops and timelines, about 0.6 kB per stage and
    // microbatch with the default 2 chunks (measured: 82 MB at 64 x 2048), more with more
    // chunks; --trace's JSON takes about 28 kB more (3.8 GB).
    if (s.simulate)
      return 16e6 + (s.trace.empty() ? 1e3 : 30e3) * (s.stages > 0 ? s.stages : 4) *
                        static_cast<double>(s.microbatches) * std::max(1.0, s.chunks / 2.0);
    return bytes_per_rank(s.model, o.ranks) *
           (o.backend == "threads" || o.backend == "auto" ? o.ranks : 1);
  });
  program.writes_csv([&s] { return s.benchmark; });
  program.supports_cuda();
}

}  // namespace ch04
