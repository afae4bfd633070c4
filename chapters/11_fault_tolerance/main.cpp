// Chapter 11 — training through failures: chapter 09's GPT trained while ranks are made to
// fail on purpose, recovered from its last checkpoint, and checked to end where a run
// without failures ends, bit for bit.
//
// A job on thousands of devices fails every few hours (Llama 3's 16,384 GPUs: 419
// unexpected interruptions in 54 days, Dubey et al. 2024, §3.3.4). This program kills a
// rank (`kill@RANK@STEP`: it ends without a word) or stops one inside a step
// (`hang@RANK@STEP`: the others notice within --timeout, naming it); the job ends, a
// supervisor starts it again on fresh ranks (Program::restart), and the run goes on from
// the last complete checkpoint (written every --checkpoint-every steps): the steps since
// are lost and trained again, each on the batch of its step, so no batch is trained twice
// or skipped. At the end it trains the same run without failures and compares the two
// final checkpoints byte for byte, and says where the wall time went (the goodput).
//
// Simplified: the ranks are threads of one process and the supervisor is the program;
// under mpirun a failure ends the job (a launcher around mpirun would start it again
// with --load).
//
// Run:
//   build/default/bin/ch11_fault_tolerance                          kill@7@10, 20 steps
//   build/default/bin/ch11_fault_tolerance --inject hang@5@7 --timeout 2
//   build/default/bin/ch11_fault_tolerance --inject kill@1@3 --inject kill@6@13
//   build/default/bin/ch11_fault_tolerance --checkpoint-every 0     no checkpoints: from 0
//
// Expected: one failure, one restart from step 8 (steps 8 to 10 lost), the final weights
// and Adam's moments equal to the uninterrupted run's, and the goodput table.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "checkpoint.hpp"
#include "context_parallel.hpp"  // chapter 10: ring_context, for --cp
#include "faults.hpp"
#include "mesh_flags.hpp"
#include "options.hpp"
#include "recovery.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/timer.hpp"
#include "train.hpp"

using namespace shardlab;
using namespace ch09;
using namespace ch11;
namespace fs = std::filesystem;

namespace {

struct Settings11 {
  ch09::Settings run;               ///< the model, the mesh and the training (chapter 09's flags)
  std::vector<std::string> inject;  ///< --inject; none given: the last rank killed halfway
  int every = 4;                    ///< --checkpoint-every
  std::string dir;                  ///< --checkpoint-dir; "": a temporary folder of the run's own
  std::string compare;              ///< --compare-flights: the records of a job to compare
  std::vector<Fault> faults;
};

/// Rank 0's record of the attempts (they run one after another in this process).
std::vector<Attempt> attempts;
/// The checkpoints' folder when --checkpoint-dir is not given: one of the run's own,
/// named by a process id every rank agrees on (removed at the end).
fs::path temporary;
const Stopwatch since_start;

/// The fault, on the rank it hits: a kill ends the rank's thread with an error (as a lost
/// process would end); a hang stops answering until the job has ended around it.
void strike(Context& ctx, const Fault& f) {
  if (f.kind == Fault::Kind::kill)
    throw std::runtime_error("rank " + std::to_string(f.rank) + " killed in step " +
                             std::to_string(f.step) + " (--inject " + f.spec + ")");
  for (;;) {  // CommAborted once another rank's --timeout has ended the job
    ctx.comm().check_not_aborted();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

/// Steps first .. steps - 1, a checkpoint after every `every`-th, the armed fault struck
/// at its step; rank 0 notes each step's and checkpoint's time in `rec`.
void train_from(Context& ctx, const Settings11& s, Mesh& mesh, GptModel& model, Trainer& trainer,
                int first, const Fault* armed, Attempt& rec) {
  for (int t = first; t < s.run.steps; ++t) {
    if (armed && armed->step == t && armed->rank == ctx.rank()) strike(ctx, *armed);
    const Stopwatch step;
    (void)trainer.step(t);
    rec.steps.push_back(t);
    rec.step_s.push_back(step.seconds());
    if (s.every > 0 && (t + 1) % s.every == 0 && t + 1 < s.run.steps) {
      const Stopwatch save;
      save_checkpoint(s.dir, mesh, model, &trainer.optimizer(), t + 1, &trainer.scaler(),
                      trainer.expert_optimizer());
      rec.checkpoint_s.push_back(save.seconds());
    }
  }
}

void run(Context& ctx, Settings11 s) {
  const TrainConfig& c = s.run.run;
  if (s.dir.empty()) {
    const auto pid = static_cast<long>(ctx.comm().agree(double(getpid()), ReduceOp::max));
    const fs::path mine = fs::temp_directory_path() / ("shardlab_ch11_" + std::to_string(pid));
    if (ctx.rank() == 0) temporary = mine;  // the ranks may be threads of one process
    s.dir = (mine / "checkpoint").string();
  }
  const int attempt = ctx.options().attempt;
  const bool first_attempt = attempt == 0;
  Attempt rec;
  rec.start = since_start.seconds();
  if (first_attempt && ctx.rank() == 0) {
    attempts.clear();
    fs::remove_all(s.dir);  // a run of its own: no checkpoint of an earlier one
  }
  if (first_attempt) {
    std::string faults;
    for (const Fault& f : s.faults) faults += (faults.empty() ? "" : ", ") + f.spec;
    ctx.say("Chapter 11 - " + describe(c, ctx.comm().backend()) + "; " +
            std::to_string(s.run.steps) + " steps, a checkpoint after every " +
            std::to_string(s.every) + "; failures: " + (faults.empty() ? "none" : faults) + "\n");
  }
  ctx.comm().barrier();
  const Fault* armed = std::size_t(attempt) < s.faults.size() ? &s.faults[attempt] : nullptr;
  const Corpus data = Corpus::load(s.run.data, c.model.context);
  Mesh mesh(ctx.comm(), c.mesh);
  GptModel model(mesh, c.model, c.model_options());
  Trainer trainer(mesh, model, c, data);
  int first = 0;
  if (!first_attempt) {
    if (fs::exists(s.dir))
      first = load_checkpoint(s.dir, model, &trainer.optimizer(), &trainer.scaler(),
                              trainer.expert_optimizer());
    // The bookkeeping (the learner's resume_point) against the checkpoint the run found.
    const ResumePoint p = resume_point(s.every, s.faults[std::size_t(attempt) - 1].step);
    ctx.verify(p.step == first, "resume_point says step " + std::to_string(p.step) +
                                    ", the last complete checkpoint is of step " +
                                    std::to_string(first));
    ctx.say("attempt " + std::to_string(attempt) + ": from the checkpoint of step " +
            std::to_string(first) + ", " + std::to_string(p.lost) + " steps lost");
  }
  rec.resumed = first;
  rec.ready = since_start.seconds();
  try {
    train_from(ctx, s, mesh, model, trainer, first, armed, rec);
  } catch (...) {
    if (ctx.rank() == 0) {
      rec.end = since_start.seconds();
      rec.failure = "failed";
      attempts.push_back(rec);
    }
    throw;
  }
  ctx.comm().barrier();
  rec.end = since_start.seconds();
  if (ctx.rank() == 0) attempts.push_back(rec);
  ctx.comm().barrier();  // rank 0's record whole before any rank reads it
  ctx.json()["restarts"] = int(attempts.size()) - 1;
  report_goodput(ctx, attempts);

  // The same run without failures, from the start: its final checkpoint and this run's,
  // byte for byte (the weights, Adam's moments, the step).
  const std::string recovered = s.dir + "_recovered", clean = s.dir + "_uninterrupted";
  save_checkpoint(recovered, mesh, model, &trainer.optimizer(), s.run.steps, &trainer.scaler(),
                  trainer.expert_optimizer());
  GptModel model2(mesh, c.model, c.model_options());
  Trainer trainer2(mesh, model2, c, data);
  for (int t = 0; t < s.run.steps; ++t) (void)trainer2.step(t);
  save_checkpoint(clean, mesh, model2, &trainer2.optimizer(), s.run.steps, &trainer2.scaler(),
                  trainer2.expert_optimizer());
  std::string file;
  if (ctx.rank() == 0) {
    file = first_difference(clean, recovered);
    fs::remove_all(recovered);
    fs::remove_all(clean);
  }
  ctx.verify(ctx.comm().all_true(file.empty()),
             "the recovered run's " + file + " differs from the run without failures");
  ctx.json()["equal_to_uninterrupted"] = file.empty();
  ctx.say(
      "\nthe final weights and Adam's moments equal the run without failures, byte for "
      "byte: " +
      std::string(file.empty() ? "yes" : "no, " + file));
}

}  // namespace

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
                 "a failure: kill@RANK@STEP or hang@RANK@STEP (several allowed), or none "
                 "[kill@LAST_RANK@STEPS/2]")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cli::option(cli, "--checkpoint-every", s.every, "a checkpoint after every K steps (0: none)",
              cli::whole(0, 100000));
  cli::option(cli, "--checkpoint-dir", s.dir,
              "where the checkpoints go (kept; default: a temporary folder, removed)",
              CLI::Validator());
  cli::option(cli, "--compare-flights", s.compare,
              "only compare the flight records a failed job wrote (--flight-dir DIR)",
              CLI::Validator());
  program.default_flight_record(64);
  program.default_ranks([&](const Options& o) { return s.compare.empty() ? o.ranks : 1; });
  program.world_size([&](const Options&, int ranks) {
    if (!s.compare.empty()) return;
    c.mesh = ch08::mesh_for_ranks(s.run.mesh, ranks);
    if (c.mesh.cp > 1)
      c.context = ch10::ring_context(ch10::Split::zigzag, c.overlap[ch08::Axis::cp]);
    check_config(c);
    if (s.inject.empty())
      s.inject = {"kill@" + std::to_string(ranks - 1) + "@" + std::to_string(s.run.steps / 2)};
    s.faults = parse_faults(s.inject, ranks, s.run.steps);
  });
  program.validate([&](const Options& o) {
    c.model.seed = o.seed;
    c.memory = o.memory();
    c.recompute = ch08::parse_recompute(s.run.recompute);
    set_precision(c, s.run.precision, s.run.scaler);
    check_training_flags(cli, s.run);
    if (!s.dir.empty()) check_save_target(s.dir);
  });
  program.restart([&](int attempt, const std::string& failure) {
    if (std::size_t(attempt) > s.faults.size()) return false;
    if (!attempts.empty()) attempts.back().failure = failure;
    std::fprintf(stderr, "ch11_fault_tolerance: restart %d after: %s\n", attempt, failure.c_str());
    return true;
  });
  program.memory_estimate([&](const Options& o) {
    return 2 * run_bytes(c, o.backend == "threads" || o.backend == "auto");
  });
  const int code = program.run(argc, argv, [&](Context& ctx) {
    ctx.json()["chapter"] = "11_fault_tolerance";
    if (s.compare.empty()) return run(ctx, s);
    // A job under mpirun cannot compare its ranks' records as it fails: they are written
    // (--flight-dir) and compared here, afterwards.
    const FlightVerdict v = compare_flight_dir(s.compare);
    for (const std::string& line : v.lines) ctx.say("flight recorder: " + line);
    ctx.json()["stopped"] = v.stopped;
    ctx.json()["deadlocked"] = v.deadlocked;
  });
  std::error_code ignored;  // under mpirun, another process may have removed it
  if (!temporary.empty()) fs::remove_all(temporary, ignored);
  return code;
}
