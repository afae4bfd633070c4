// Chapter 11 — training through failures: chapter 09's GPT trained while ranks are made to
// fail on purpose, each failure noticed, its rank named, and the run recovered — checked to
// end where a run without failures ends, bit for bit.
//
// A job on thousands of devices fails every few hours (Llama 3's 16,384 GPUs: 419
// unexpected interruptions in 54 days, Dubey et al. 2024, §3.3.4). This program:
//   kill@RANK@STEP   the rank ends without a word; the job ends, a supervisor starts it
//                    again on fresh ranks (Program::restart) from the last complete
//                    checkpoint (every --checkpoint-every steps): the steps since are lost
//                    and trained again, each on the batch of its step;
//   hang@RANK@STEP   the rank stops; the others notice within --timeout, and the flight
//                    recorder (shardlab/flight.hpp) names the rank they all wait for;
//   stall@RANK@STEP  the rank stops inside the step's first collective, once entered:
//                    every member of that call is inside it, and the records say so;
//   slow@RANK@F      the rank's steps take F times as long: the job runs at its pace, and
//                    the ranks' busy times (not waiting) name it;
//   nan@RANK@STEP    a NaN in one of its gradients: the rank that made it is named, and the
//                    step is skipped on every rank (no update), as GradScaler skips one;
//   flip@RANK@STEP   one bit of its weights flipped: the replicas' checksums (every
//                    --check-every steps, and before every checkpoint) name the replica that
//                    differs; it copies a healthy one's weights when a majority agrees, and
//                    the run restarts from the last checkpoint when none does.
// At the end it trains the same run without failures (skipping the steps the NaNs made it
// skip) and compares the two final checkpoints byte for byte, and says where the wall time
// went (the goodput).
//
// This file reads the flags and supervises the attempts; one attempt's steps, faults and
// checks are fault_run.cpp's, the report of the attempts faults.cpp's.
//
// The supervisor is the program itself for ranks that are threads (Program::restart); for
// processes, --processes N makes it start mpirun on itself and start it again after a
// failure (supervisor.cpp), the attempts' records and the faults that struck kept beside
// the checkpoints, since a killed process keeps nothing. --async-checkpoints writes the
// checkpoints in the background (background_save.cpp).
//
// Run:
//   build/default/bin/ch11_fault_tolerance                          kill@7@10, 20 steps
//   build/default/bin/ch11_fault_tolerance --inject hang@5@7 --timeout 2
//   build/default/bin/ch11_fault_tolerance --inject kill@1@3 --inject kill@6@13
//   build/default/bin/ch11_fault_tolerance --inject nan@2@5 --inject slow@6@3
//   build/default/bin/ch11_fault_tolerance --inject flip@1@6 --dp 4 --tp 1
//   build/default/bin/ch11_fault_tolerance --checkpoint-every 0     no checkpoints: from 0
//   build/default/bin/ch11_fault_tolerance --processes 8             under mpirun, supervised
//
// Expected: one failure, one restart from step 8 (steps 8 to 10 lost), the final weights
// and Adam's moments equal to the uninterrupted run's, and the goodput table.
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "checkpoint.hpp"
#include "context_parallel.hpp"  // chapter 10: ring_context, for --cp
#include "fault_run.hpp"
#include "faults.hpp"
#include "mesh_flags.hpp"
#include "options.hpp"
#include "reliability.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/launch.hpp"
#include "supervisor.hpp"
#include "sweep.hpp"
#include "train.hpp"

using namespace shardlab;
using namespace ch09;
using namespace ch11;
namespace fs = std::filesystem;

int main(int argc, char** argv) {
  Program program("ch11_fault_tolerance",
                  "Chapter 11: chapter 09's GPT trained through failures: a rank killed or "
                  "hung, the job restarted from its last checkpoint, equal to a run without");
  program.default_ranks(8);
  Settings11 s;
  s.run.steps = 20;
  TrainConfig& c = s.run.run;
  auto& cli = program.cli();
  add_model_flags(cli, s.run);
  add_training_flags(cli, s.run);
  cli::option(cli, "--data", s.run.data, "the text to learn (the chapters' READMEs)",
              CLI::Validator());
  cli.add_option("--inject", s.inject,
                 "a failure: kill@RANK@STEP, hang@RANK@STEP, stall@RANK@STEP, nan@RANK@STEP, "
                 "flip@RANK@STEP or slow@RANK@FACTOR (several allowed), or none "
                 "[kill@LAST_RANK@STEPS/2]")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  std::string every = "4";
  cli::option(cli, "--checkpoint-every", every,
              "a checkpoint after every K steps (0: none), or auto: at Young's interval from "
              "the checkpoint's time and --mtbf-steps",
              CLI::Validator());
  cli::option(cli, "--mtbf-steps", s.mtbf_steps,
              "failures drawn (kills, at exponential gaps, from --seed) every N steps on "
              "average; 0: only --inject's",
              cli::between(0.0, 1e6));
  cli::option(cli, "--check-every", s.check_every,
              "compare the data-parallel replicas' weights (checksums) after every K steps and "
              "before each checkpoint (0: only before checkpoints)",
              cli::whole(0, 100000));
  cli::option(cli, "--checkpoint-dir", s.dir,
              "where the checkpoints go (kept; default: a temporary folder, removed)",
              CLI::Validator());
  cli::option(cli, "--compare-flights", s.compare,
              "only compare the flight records a failed job wrote (--flight-dir DIR)",
              CLI::Validator());
  program.default_flight_record(64);
  cli.add_flag("--plan", s.plan,
               "only the planner: Llama 3's failures, and what keeps a job's goodput above "
               "90 % and 95 % as it grows");
  cli.add_flag("--elastic", s.elastic,
               "after a rank is lost, go on with the ranks that remain: data parallelism "
               "shrinks to the replicas they hold (the batch and its order unchanged)");
  cli::option(cli, "--save", s.save, "write the final checkpoint there", CLI::Validator());
  cli::option(cli, "--processes", s.processes,
              "run the job as N processes under mpirun and supervise it: after a failure, "
              "new processes go on from the last checkpoint (torchrun's elastic agent)",
              cli::whole(1, 4096));
  cli::option(cli, "--mpirun", s.mpirun, "with --processes: the command that starts them",
              CLI::Validator());
  cli.add_option("--attempt", s.attempt, "(the supervisor's: which attempt this job is)")
      ->group("")
      ->check(cli::whole(0, 100000));
  int first_ranks = 0;  // the supervisor's: the first attempt's processes, which the faults
  cli.add_option("--first-ranks", first_ranks, "(the supervisor's)")  // were drawn for
      ->group("")
      ->check(cli::whole(1, 4096));
  cli.add_flag("--memory-checkpoints", s.memory,
               "keep each checkpoint in memory too, the rank's and a copy on a peer on another "
               "host (Gemini): a restart takes the state from there when it can");
  cli.add_flag("--async-checkpoints", s.async,
               "write the checkpoints in the background: training stops only for the copy "
               "to memory");
  cli.add_flag("--sweep", s.sweep,
               "a benchmark: the waste measured against the checkpoint interval (--intervals) "
               "with failures every --mtbf-steps (10), beside Young's formula; a CSV");
  cli.add_option("--intervals", s.intervals, "the checkpoint intervals the sweep tries, in steps")
      ->delimiter(',')
      ->check(cli::whole(1, 100000));
  cli::option(cli, "--rounds", s.rounds,
              "the sweep's runs per interval, each with its own failures", cli::whole(1, 1000));
  program.writes_csv([&] { return s.sweep; });
  program.default_ranks([&](const Options& o) {
    return s.compare.empty() && !s.plan && s.processes == 0 ? o.ranks : 1;
  });
  program.world_size([&](const Options& o, int ranks) {
    if (!s.compare.empty() || s.plan) return;
    if (s.processes > 0) {  // the supervisor: the job's ranks are the processes it starts
      require_usage(!started_by_mpirun(),
                    "--processes starts mpirun itself: run the program alone");
      require_usage(ranks == 1, "--processes N is the job's size: drop --ranks");
      require_usage(s.sweep == false, "--sweep runs on threads: drop --processes");
      require_usage(!s.memory,
                    "--memory-checkpoints keeps the copies in the ranks' memory, which "
                    "processes started again do not have (Gemini keeps them in an agent on "
                    "each machine): on threads only");
      ranks = s.processes;
    }
    c.mesh = ch08::mesh_for_ranks(s.run.mesh, ranks);
    if (c.mesh.cp > 1)
      c.context = ch10::ring_context(ch10::Split::zigzag, c.overlap[ch08::Axis::cp]);
    check_config(c);
    settle_faults(s, every, ranks, first_ranks, o.seed);
    if (s.sweep) return;
    arm_faults(s.faults.size());  // before any rank starts; kept across the restarts
  });
  program.validate([&](const Options& o) {
    c.model.seed = o.seed;
    c.memory = o.memory();
    c.recompute = ch08::parse_recompute(s.run.recompute);
    set_precision(c, s.run.precision, s.run.scaler);
    check_training_flags(cli, s.run);
    c.skip_nonfinite = true;  // a NaN's step is skipped (its norm is taken: see below)
    for (const Fault& f : s.faults) {
      require_usage(
          f.kind != Fault::Kind::flip || c.zero == 0,
          "--inject " + f.spec +
              ": under --zero 1 every replica's weights come from "
              "one shard's owner each step, so a flipped bit heals or spreads; use --zero 0");
      require_usage(
          f.kind != Fault::Kind::nan || c.zero == 0 || c.clip > 0 || c.scaler != ch06::Scaler::none,
          "--inject " + f.spec +
              ": with --zero 1, --clip 0 and no scaler no gradient "
              "norm is taken, so a NaN is not seen; keep --clip");
    }
    require_usage(!s.memory || c.zero == 0,
                  "--memory-checkpoints with --zero 1: ZeRO-1's Adam state is kept in buckets "
                  "spread over the replicas, which a rank's copy does not restore; use --zero 0");
    if (!s.dir.empty()) check_save_target(s.dir);
    if (!s.save.empty()) check_save_target(s.save);
  });
  program.restart([&](int attempt, const std::string& failure) {
    if (std::size_t(attempt) > s.faults.size()) return false;
    note_failure(failure);
    std::string on;
    if (s.elastic) {  // the lost rank's place is not filled: one rank fewer, or as many fewer as
                      // the mesh needs
      const int now = program.options().ranks, fewer = fewer_ranks(s, now);
      if (fewer == 0) {
        std::fprintf(stderr,
                     "ch11_fault_tolerance: no smaller mesh fits (--elastic keeps every axis "
                     "but dp): not restarting\n");
        return false;
      }
      program.resize(fewer);
      on = " on " + std::to_string(fewer) + " ranks";
    }
    std::fprintf(stderr, "ch11_fault_tolerance: restart %d%s after: %s\n", attempt, on.c_str(),
                 failure.c_str());
    return true;
  });
  const std::vector<std::string> args(argv, argv + argc);
  program.instead([&](const Options& o) -> std::optional<int> {
    if (s.processes == 0) return std::nullopt;
    return supervise(s, args, o.json);
  });
  program.memory_estimate([&](const Options& o) {
    return 2 * run_bytes(c, o.backend == "threads" || o.backend == "auto");
  });
  const int code = program.run(argc, argv, [&](Context& ctx) {
    ctx.json()["chapter"] = "11_fault_tolerance";
    if (s.plan) return report_plan(ctx);
    if (s.sweep) {
      SweepSettings sw{c,           s.run.data, s.run.steps,        s.mtbf_steps,
                       s.intervals, s.rounds,   ctx.options().seed, s.dir};
      if (sw.dir.empty()) {
        const auto pid = static_cast<long>(ctx.comm().agree(double(getpid()), ReduceOp::max));
        sw.dir =
            (fs::temp_directory_path() / ("shardlab_ch11_sweep_" + std::to_string(pid))).string();
      }
      sweep_waste(ctx, sw);
      if (ctx.rank() == 0 && s.dir.empty()) fs::remove_all(sw.dir);
      return;
    }
    if (s.compare.empty()) return train_through_failures(ctx, s);
    // A job under mpirun cannot compare its ranks' records as it fails: they are written
    // (--flight-dir) and compared here, afterwards.
    const FlightVerdict v = compare_flight_dir(s.compare);
    for (const std::string& line : v.lines) ctx.say("flight recorder: " + line);
    ctx.json()["stopped"] = v.stopped;
    ctx.json()["deadlocked"] = v.deadlocked;
  });
  remove_temporary();
  return code;
}
