// Chapter 11: one attempt of a run through failures (fault_run.hpp).
#include "fault_run.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <thread>

#include "background_save.hpp"
#include "checkpoint.hpp"
#include "mesh_flags.hpp"
#include "peer_memory.hpp"
#include "recovery.hpp"
#include "shardlab/format.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/timer.hpp"
#include "train.hpp"

namespace ch11 {

using namespace shardlab;
using namespace ch09;
namespace fs = std::filesystem;

namespace {

/// The first attempt's number of ranks, and the step an elastic restart changed the mesh
/// at (-1: it did not).
std::atomic<int> mesh_ranks{0};
std::atomic<int> mesh_changed_at{-1};
/// --checkpoint-every auto's choice, once made (0: not yet), kept for the restarts.
std::atomic<int> chosen_every{0};
/// Rank 0's record of the attempts (they run one after another in this process).
std::vector<Attempt> attempts;
/// Which faults have struck: a failure happens once, not again when its step is trained
/// again (each flag written by the fault's own rank; the attempts follow one another).
std::vector<char> struck;
/// The checkpoints' folder when --checkpoint-dir is not given: one of the run's own,
/// named by a process id every rank agrees on (removed at the end).
fs::path temporary;
const Stopwatch since_start;
/// A supervised run's start (its first attempt's, seconds since the epoch, rank 0's clock:
/// its attempts are processes one after another); -1: a run of one process.
double run_t0 = -1;

double epoch_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

/// Seconds from the run's start, on rank 0's clock.
double clock_s() { return run_t0 >= 0 ? epoch_seconds() - run_t0 : since_start.seconds(); }

/// A supervised run's fault I has struck: its file, holding what happened.
fs::path struck_file(const Settings11& s, std::size_t i) {
  return fs::path(run_folder(s)) / ("struck-" + std::to_string(i));
}

fs::path attempt_file(const Settings11& s, int attempt) {
  return fs::path(run_folder(s)) / ("attempt-" + std::to_string(attempt) + ".json");
}

/// `j` into `file`, whole or not at all: a new file renamed over the old (the process may
/// be killed while it writes).
void write_whole(const fs::path& file, const nlohmann::json& j) {
  const fs::path next = file.string() + ".new";
  std::ofstream(next) << j.dump();
  fs::rename(next, file);
}

/// Rank 0's record of this attempt of a supervised run.
void save_attempt(const Settings11& s, const Attempt& a, int ranks) {
  const nlohmann::json j = {{"start", a.start},
                            {"ready", a.ready},
                            {"resumed", a.resumed},
                            {"steps", a.steps},
                            {"step_s", a.step_s},
                            {"checkpoint_s", a.checkpoint_s},
                            {"written_s", a.written_s},
                            {"check_s", a.check_s},
                            {"skipped", a.skipped},
                            {"failed_at", a.failed_at},
                            {"end", a.end},
                            {"failure", a.failure},
                            {"t0", run_t0},
                            {"ranks", ranks},
                            {"first_ranks", mesh_ranks.load()},
                            {"every", s.every_auto ? chosen_every.load() : s.every},
                            {"mesh_changed_at", mesh_changed_at.load()}};
  write_whole(attempt_file(s, s.attempt), j);
}

/// The attempts of a supervised run before this one, from their files (every process reads
/// them: the checkpoint interval, the first mesh and the faults that struck are every
/// rank's to know; the attempts themselves rank 0's).
void resume_supervised(Context& ctx, const Settings11& s) {
  if (s.attempt == 0) {
    run_t0 = ctx.comm().agree(ctx.rank() == 0 ? epoch_seconds() : 0.0, ReduceOp::max);
    return;
  }
  attempts.clear();
  nlohmann::json last;
  for (int k = 0; k < s.attempt; ++k) {
    std::ifstream in(attempt_file(s, k));
    nlohmann::json j;
    try {
      in >> j;
    } catch (const nlohmann::json::exception&) {
      throw std::runtime_error("the supervised run's record " + attempt_file(s, k).string() +
                               " is missing or not whole");
    }
    Attempt a;
    a.start = j.at("start");
    a.ready = j.at("ready");
    a.resumed = j.at("resumed");
    a.steps = j.at("steps").get<std::vector<int>>();
    a.step_s = j.at("step_s").get<std::vector<double>>();
    a.checkpoint_s = j.at("checkpoint_s").get<std::vector<double>>();
    a.written_s = j.at("written_s").get<std::vector<double>>();
    a.check_s = j.at("check_s");
    a.skipped = j.at("skipped").get<std::vector<int>>();
    a.failed_at = j.at("failed_at");
    a.end = j.at("end");
    a.failure = j.at("failure");
    attempts.push_back(a);
    if (k == 0) {
      run_t0 = j.at("t0");
      mesh_ranks = j.at("first_ranks").get<int>();
    }
    last = j;
  }
  chosen_every = last.at("every").get<int>();
  mesh_changed_at = last.at("mesh_changed_at").get<int>();
  for (std::size_t i = 0; i < s.faults.size(); ++i) struck[i] = fs::exists(struck_file(s, i));
}

/// On scripts/cluster.sh's hosts (its mpirun stand-in says so): a rank killed there takes
/// its host's link down, and the host is lost with every rank on it.
bool on_cluster() { return std::getenv("SHARDLAB_CLUSTER") != nullptr; }

/// Takes this host's network links down (every interface but the loopback): the host is
/// cut off, as a node whose network card or switch port fails.
void take_host_down() {
  for (const auto& entry : fs::directory_iterator("/sys/class/net")) {
    const std::string link = entry.path().filename().string();
    if (link == "lo") continue;
    const std::string command = "ip link set dev " + link + " down";
    if (std::system(command.c_str()) != 0)
      std::fprintf(stderr, "ch11_fault_tolerance: '%s' failed\n", command.c_str());
  }
}

/// What a fault did, in the words of a supervised run's record.
const char* what_it_did(Fault::Kind kind) {
  switch (kind) {
    case Fault::Kind::kill:
      return on_cluster() ? "took its host's link down" : "killed";
    case Fault::Kind::hang:
      return "hung";
    case Fault::Kind::stall:
      return "stopped inside a collective";
    case Fault::Kind::nan:
      return "made a NaN";
    case Fault::Kind::flip:
      return "had a bit of its weights flipped";
    default:
      return "slowed";
  }
}

/// A fault of this rank, for this step, that has not struck yet (null: none). In a
/// supervised run its file is written before it strikes: the process may not live on.
const Fault* due(const Settings11& s, int rank, int step, Fault::Kind kind) {
  for (std::size_t i = 0; i < s.faults.size(); ++i) {
    const Fault& f = s.faults[i];
    if (f.kind == kind && f.rank == rank && f.step == step && !struck[i]) {
      struck[i] = 1;
      if (s.attempt >= 0)
        std::ofstream(struck_file(s, i)) << "rank " << f.rank << " " << what_it_did(kind)
                                         << " in step " << step << " (--inject " << f.spec << ")";
      return &f;
    }
  }
  return nullptr;
}

/// A kill ends the rank's thread with an error (as a lost process would end), or under
/// mpirun the process itself (SIGKILL: it says nothing more); a hang stops answering until
/// the job has ended around it.
void kill_or_hang(Context& ctx, const Settings11& s, int t) {
  if (const Fault* f = due(s, ctx.rank(), t, Fault::Kind::kill)) {
    if (ctx.comm().backend() == "mpi" && on_cluster()) {
      take_host_down();  // the host is gone: its ranks wait, cut off, until the job ends
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    if (ctx.comm().backend() == "mpi") ::raise(SIGKILL);
    lose_memory(ctx.rank());  // its host's memory with it (--memory-checkpoints)
    throw std::runtime_error("rank " + std::to_string(f->rank) + " killed in step " +
                             std::to_string(t) + " (--inject " + f->spec + ")");
  }
  if (due(s, ctx.rank(), t, Fault::Kind::hang))
    for (;;) {  // CommAborted once another rank's --timeout has ended the job
      ctx.comm().check_not_aborted();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
}

/// The replicas' weights compared by checksum (every rank calls it). A replica that
/// differs is named; with a majority it copies a healthy replica's weights (`repair`: the
/// check came right after the step that could have changed them), else the job fails and
/// restarts from the last checkpoint, written only after such a check.
void check_replicas(Context& ctx, Mesh& mesh, GptModel& model, int t, bool repair) {
  Communicator& replicas = mesh.replicas();
  const std::vector<std::int64_t> signed_sums =
      replicas.gather_values(static_cast<std::int64_t>(checksum(model.store().values())));
  const std::vector<std::uint64_t> sums(signed_sums.begin(), signed_sums.end());
  const ReplicaVote v = vote(sums);
  // One agreement for both: 0 every group agrees, 1 some differ but each has a majority,
  // 2 some group has none.
  const int state = ctx.comm().agree(v.agree() ? 0 : v.healthy >= 0 ? 1 : 2, ReduceOp::max);
  if (state == 0) return;
  std::string line;  // one line per group of replicas that disagree
  if (!v.agree() && replicas.rank() == 0) {
    const std::vector<int> group =
        ch08::group_along(mesh.shape(), mesh.coords(), ch08::kReplicaAxes);
    std::vector<int> odd;  // in the world's numbers
    for (int i : v.odd) odd.push_back(group[static_cast<std::size_t>(i)]);
    line = "after step " + std::to_string(t) + ": the weights of " + format_ranks(odd) +
           (v.healthy >= 0 ? " differ from the other replicas'"
                           : " disagree, and no majority says which is right");
  }
  const std::vector<std::string> lines = ctx.comm().gather_strings(line);
  for (const std::string& l : lines)
    if (!l.empty()) ctx.say(l);
  if (!repair || state == 2)
    throw std::runtime_error("the replicas' weights differ after step " + std::to_string(t) +
                             " (silent data corruption): restarting from the last checkpoint");
  replicas.broadcast(model.store().values(), v.healthy);
  ctx.say("after step " + std::to_string(t) + ": the odd replica copied a healthy one's weights");
}

/// --checkpoint-every auto, after the run's first step: Young's interval √(2 δ M) (the
/// learner's young_interval) from δ, one checkpoint's time (written once, aside, to measure
/// it; with --async-checkpoints, the copy to memory alone), and M, --mtbf-steps steps of the time
/// the step took; in whole steps, at least one. Every rank calls it, and every rank gets the same
/// answer.
int choose_interval(Context& ctx, const Settings11& s, Mesh& mesh, GptModel& model,
                    Trainer& trainer, const Attempt& rec) {
  const std::string aside = s.dir + "_measure";
  const Stopwatch saving;
  if (s.async)  // what the training pays: the copy (the files are written beside the steps)
    (void)snapshot_checkpoint(mesh, model, &trainer.optimizer(), 0, &trainer.scaler(),
                              trainer.expert_optimizer());
  else
    save_checkpoint(aside, mesh, model, &trainer.optimizer(), 0, &trainer.scaler(),
                    trainer.expert_optimizer());
  const double delta = ctx.comm().agree(saving.seconds(), ReduceOp::max);
  if (ctx.rank() == 0 && !s.async) fs::remove_all(aside);
  const double step = ctx.comm().agree(ctx.rank() == 0 ? rec.step_s.back() : 0.0, ReduceOp::max);
  const double mtbf = s.mtbf_steps * step, interval = young_interval(delta, mtbf);
  const int every = std::max(1, static_cast<int>(std::lround(interval / step)));
  chosen_every = every;
  ctx.say("--checkpoint-every auto: a checkpoint takes " + format_number(1e3 * delta, 3) +
          " ms, a step " + format_number(1e3 * step, 3) + " ms, a failure comes every " +
          format_number(s.mtbf_steps, 3) + " steps (" + format_number(mtbf, 3) +
          " s): Young's interval is " + format_number(interval, 3) +
          " s, a checkpoint after every " +
          (every == 1 ? "step" : std::to_string(every) + " steps"));
  ctx.json()["checkpoint_every"] = every;
  ctx.json()["checkpoint_seconds"] = delta;
  return every;
}

/// Steps first .. steps - 1, with this rank's faults; a checkpoint after every `every`-th;
/// rank 0 notes each step's and checkpoint's time in `rec`.
void train_from(Context& ctx, const Settings11& s, Mesh& mesh, GptModel& model, Trainer& trainer,
                BackgroundSaver* saver, Communicator::StartHook& stall, int first, Attempt& rec,
                std::vector<double>& busy) {
  int every = s.every_auto ? chosen_every.load() : s.every;
  const Fault* slow = nullptr;
  for (const Fault& f : s.faults)
    if (f.kind == Fault::Kind::slow && f.rank == ctx.rank()) slow = &f;
  const Fault* poison = nullptr;  // this step's nan fault
  bool made_nan = false;          // this rank's gradients held a NaN before they were summed
  trainer.on_local_gradients([&](const std::vector<nn::Parameter*>& params) {
    if (poison && !params.empty()) {
      Tensor host = params.front()->grad.to(Memory::host);
      host.data<float>()[0] = std::numeric_limits<float>::quiet_NaN();
      params.front()->grad.copy_from(host);
      poison = nullptr;
    }
    for (const nn::Parameter* p : params)
      made_nan = made_nan || !std::isfinite(shardlab::sum_of_squares(p->grad.to(Memory::host)));
  });
  // The seconds this rank waited in calls, on any communicator (the flight recorder's).
  const auto waits = ctx.comm().flight_recorder();
  std::vector<double> work;  // this rank's own work per step (its busy time less the slowing)
  for (int t = first; t < s.run.steps; ++t) {
    rec.failed_at = t;
    if (s.attempt >= 0 && ctx.rank() == 0) {  // as far as it got, should the job end here
      rec.end = clock_s();
      save_attempt(s, rec, ctx.size());
    }
    kill_or_hang(ctx, s, t);
    if (due(s, ctx.rank(), t, Fault::Kind::stall))  // the step's first collective never ends
      stall = [](const Communicator& comm, Op) {
        for (;;) {  // CommAborted once another rank's --timeout has ended the job
          comm.check_not_aborted();
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      };
    poison = due(s, ctx.rank(), t, Fault::Kind::nan);
    made_nan = false;
    const Stopwatch step;
    const double waited = waits->waited();
    double slept = 0;  // a straggler: each step, factor - 1 times its last step's work more
    if (slow && !work.empty()) {
      slept = (slow->factor - 1) * work.back();
      std::this_thread::sleep_for(std::chrono::duration<double>(slept));
    }
    const StepResult result = trainer.step(t);
    busy.push_back(step.seconds() - (waits->waited() - waited));  // not waiting for others
    work.push_back(busy.back() - slept);
    rec.steps.push_back(t);
    rec.step_s.push_back(step.seconds());
    if (result.skipped) {
      const std::vector<int> who = ctx.comm().gather_values(int(made_nan));
      std::string ranks;
      for (std::size_t r = 0; r < who.size(); ++r)
        if (who[r]) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
      ctx.say("step " + std::to_string(t) + ": the gradient norm is not finite; rank(s) " +
              (ranks.empty() ? "none" : ranks) +
              " made a NaN before the sum; the step is skipped on every rank");
      rec.skipped.push_back(t);
    }
    if (due(s, ctx.rank(), t, Fault::Kind::flip)) {  // bit 16 of the rank's first weight
      Tensor host = model.store().values().to(Memory::host);
      std::uint32_t bits = 0;
      std::memcpy(&bits, host.data<float>(), 4);
      bits ^= 1u << 16;
      std::memcpy(host.data<float>(), &bits, 4);
      model.store().values().copy_from(host);
    }
    if (s.every_auto && every == 0) every = choose_interval(ctx, s, mesh, model, trainer, rec);
    const bool save = every > 0 && (t + 1) % every == 0 && t + 1 < s.run.steps;
    if (s.run.run.zero == 0 && ((s.check_every > 0 && (t + 1) % s.check_every == 0) || save)) {
      const Stopwatch checking;  // (ZeRO-1's replicas hold their whole weights only later)
      check_replicas(ctx, mesh, model, t, s.check_every == 1);
      rec.check_s += checking.seconds();
    }
    if (save) {
      const Stopwatch saving;
      if (saver) {  // the copy now (and the wait for the save before), the files meanwhile
        const double written = saver->wait();
        if (written > 0) rec.written_s.push_back(written);
        saver->start(s.dir, snapshot_checkpoint(mesh, model, &trainer.optimizer(), t + 1,
                                                &trainer.scaler(), trainer.expert_optimizer()));
      } else {
        save_checkpoint(s.dir, mesh, model, &trainer.optimizer(), t + 1, &trainer.scaler(),
                        trainer.expert_optimizer());
      }
      if (s.memory) keep_in_memory(ctx.comm(), model, trainer, t + 1);
      rec.checkpoint_s.push_back(saving.seconds());
    }
  }
  trainer.on_local_gradients({});
  if (saver) {  // the last save in flight, before the run ends (the training waits for it)
    const Stopwatch waiting;
    const double written = saver->wait();
    if (written > 0) rec.written_s.push_back(written);
    if (!rec.checkpoint_s.empty()) rec.checkpoint_s.back() += waiting.seconds();
  }
}

/// The stragglers, from every rank's median busy time per step (every rank calls it).
void report_stragglers(Context& ctx, const std::vector<double>& busy) {
  const std::vector<double> all = ctx.comm().gather_values(median(busy));
  const std::vector<int> slow = stragglers(all);
  const double typical = median(all);  // what stragglers() compares with
  std::string text;
  for (int r : slow)
    text += (text.empty() ? "" : ", ") + std::to_string(r) + " (" +
            format_number(all[std::size_t(r)] / typical, 2) + "x)";
  ctx.say("\nstragglers (a rank's median busy step against the median rank's, " +
          format_number(1e3 * typical, 3) + " ms): " + (text.empty() ? "none" : "rank " + text));
  ctx.json()["stragglers"] = slow;
}

/// The mesh for `ranks` ranks: the axes given, data parallelism taking what is left; an
/// elastic restart (--elastic) on fewer ranks keeps every axis but dp.
MeshShape mesh_of(const Settings11& s, int ranks) {
  const std::vector<ch08::Axis> all(std::begin(ch08::kAxes), std::end(ch08::kAxes));
  if (ch08::product(s.run.run.mesh, all) == ranks) return s.run.run.mesh;
  MeshShape shape = s.run.mesh;  // as the flags gave it
  shape.dp = 0;
  return ch08::mesh_for_ranks(shape, ranks);
}

}  // namespace

void train_through_failures(Context& ctx, Settings11 s) {
  s.run.run.mesh = mesh_of(s, ctx.size());  // fewer ranks after an elastic restart
  const TrainConfig& c = s.run.run;
  const Corpus data = Corpus::load(s.run.data, c.model.context);  // a bad --data: one line
  if (s.dir.empty()) {
    const auto pid = static_cast<long>(ctx.comm().agree(double(getpid()), ReduceOp::max));
    const fs::path mine = fs::temp_directory_path() / ("shardlab_ch11_" + std::to_string(pid));
    if (ctx.rank() == 0) temporary = mine;  // the ranks may be threads of one process
    s.dir = (mine / "checkpoint").string();
  }
  const int attempt = s.attempt >= 0 ? s.attempt : ctx.options().attempt;
  const bool first_attempt = attempt == 0;
  if (s.attempt >= 0) resume_supervised(ctx, s);
  Attempt rec;
  rec.start = clock_s();
  if (first_attempt && ctx.rank() == 0) {  // (the faults armed by arm_faults)
    attempts.clear();
    chosen_every = 0;
    clear_memory(ctx.size());
    fs::remove_all(s.dir);  // a run of its own: no checkpoint of an earlier one
  }
  if (first_attempt) {  // every rank (processes under mpirun), the same values
    mesh_ranks = ctx.size();
    mesh_changed_at = -1;
    std::string faults;
    for (const Fault& f : s.faults) faults += (faults.empty() ? "" : ", ") + f.spec;
    ctx.say("Chapter 11 - " + describe(c, ctx.comm().backend()) + "; " +
            std::to_string(s.run.steps) + " steps, " +
            (s.every_auto ? "checkpoints at Young's interval"
                          : "a checkpoint after every " + std::to_string(s.every)) +
            "; failures: " + (faults.empty() ? "none" : faults) +
            (s.mtbf_steps > 0
                 ? " (drawn: one every " + format_number(s.mtbf_steps, 3) +
                       " steps on average, --seed " + std::to_string(ctx.options().seed) + ")"
                 : "") +
            "\n");
  }
  // A supervised run's record of this attempt exists before any rank can fail.
  if (s.attempt >= 0 && ctx.rank() == 0) save_attempt(s, rec, ctx.size());
  ctx.comm().barrier();
  // A recorder on every communicator of the rank (they are split from this one below): the
  // time each rank waits for the others, which names a straggler.
  if (!ctx.comm().flight_recorder())
    ctx.comm().record_flights(std::make_shared<FlightRecorder>(ctx.rank(), 1));
  // stall@: a function the rank's collectives run as they start, on every communicator
  // split from this one (set when the fault strikes).
  auto stall = std::make_shared<Communicator::StartHook>();
  ctx.comm().on_collective_start(stall);
  std::unique_ptr<BackgroundSaver> saver;
  if (s.async) saver = std::make_unique<BackgroundSaver>(ctx.comm());
  Mesh mesh(ctx.comm(), c.mesh);
  GptModel model(mesh, c.model, c.model_options());
  Trainer trainer(mesh, model, c, data);
  int first = 0;
  if (!first_attempt) {
    const Stopwatch loading;
    std::string how;  // --memory-checkpoints: where each rank's state came from
    const int in_memory = s.memory ? restore_from_memory(ctx.comm(), model, trainer, how) : -1;
    if (in_memory >= 0)
      first = in_memory;
    else if (fs::exists(s.dir))
      first = load_checkpoint(s.dir, model, &trainer.optimizer(), &trainer.scaler(),
                              trainer.expert_optimizer());
    const double loaded = ctx.comm().agree(loading.seconds(), ReduceOp::max);
    ctx.json()["load_seconds"] = loaded;
    if (s.memory)
      ctx.say("attempt " + std::to_string(attempt) +
              (in_memory >= 0 ? ": the state of step " + std::to_string(first) + " from memory (" +
                                    how + ") in "
                              : ": nothing whole in memory, the state from storage in ") +
              format_number(1e3 * loaded, 3) + " ms");
    // The bookkeeping (the learner's resume_point) against the checkpoint the run found.
    const int failed_at =
        ctx.comm().agree(ctx.rank() == 0 ? attempts.back().failed_at : 0, ReduceOp::max);
    const int every = s.every_auto ? chosen_every.load() : s.every;
    const ResumePoint p = resume_point(every, failed_at);
    // A save in the background may not have ended when its job did (a process killed with
    // it): the run goes on from the one before.
    const bool unfinished = s.async && first == p.step - every && first >= 0;
    ctx.verify(p.step == first || unfinished, "resume_point says step " + std::to_string(p.step) +
                                                  ", the last complete checkpoint is of step " +
                                                  std::to_string(first));
    ctx.say("attempt " + std::to_string(attempt) + ": from the checkpoint of step " +
            std::to_string(first) + ", " + std::to_string(p.lost + (unfinished ? every : 0)) +
            " steps lost" +
            (unfinished ? " (the save of step " + std::to_string(p.step) +
                              " was still being written when the job failed)"
                        : "") +
            (ctx.size() == mesh_ranks
                 ? ""
                 : "; on " + std::to_string(ctx.size()) + " ranks, " + ch08::mesh_name(c.mesh)));
    if (ctx.size() != mesh_ranks) mesh_changed_at = first;
  }
  rec.resumed = first;
  rec.ready = clock_s();
  std::vector<double> busy;  // this rank's busy seconds, step by step
  try {
    train_from(ctx, s, mesh, model, trainer, saver.get(), *stall, first, rec, busy);
  } catch (...) {
    if (ctx.rank() == 0) {
      rec.end = clock_s();
      rec.failure = "failed";
      attempts.push_back(rec);
      if (s.attempt >= 0) save_attempt(s, rec, ctx.size());
    }
    throw;
  }
  ctx.comm().barrier();
  rec.end = clock_s();
  if (ctx.rank() == 0) attempts.push_back(rec);
  if (ctx.rank() == 0 && s.attempt >= 0) save_attempt(s, rec, ctx.size());
  ctx.comm().barrier();  // rank 0's record whole before any rank reads it
  ctx.json()["restarts"] = int(attempts.size()) - 1;
  report_goodput(ctx, attempts);
  report_stragglers(ctx, busy);

  // The same run without failures, from the start, skipping the steps this one skipped in
  // the end: its final checkpoint and this run's, byte for byte (the weights, Adam's
  // moments, the step).
  // This run's final checkpoint, written once: to --save, or aside to be compared.
  const std::string recovered = s.save.empty() ? s.dir + "_recovered" : s.save;
  const bool mesh_changed = ctx.size() != mesh_ranks;
  if (!mesh_changed || !s.save.empty())
    save_checkpoint(recovered, mesh, model, &trainer.optimizer(), s.run.steps, &trainer.scaler(),
                    trainer.expert_optimizer());
  if (mesh_changed) {
    // The mesh changed: a run without failures on this mesh alone is not the reference; a
    // run that changes mesh at the same step is (chapter 09's --save, then --load on this
    // mesh: the test ch11.elastic_equals_ch09 compares them).
    ctx.json()["mesh_changed_at"] = mesh_changed_at.load();
    ctx.say("\nthe mesh changed at step " + std::to_string(mesh_changed_at.load()) + " (" +
            std::to_string(mesh_ranks.load()) + " ranks to " + std::to_string(ctx.size()) +
            "): its reference is not a run without failures on one mesh but one that changes "
            "mesh at the same step, chapter 09's --save on the first and --load on this one "
            "(--save DIR keeps this run's final checkpoint to compare)");
    return;
  }
  std::vector<int> skip = ctx.rank() == 0 ? skipped_steps(attempts) : std::vector<int>{};
  const int skips = ctx.comm().agree(int(skip.size()), ReduceOp::max);
  skip.resize(std::size_t(skips));
  ctx.comm().broadcast(skip, 0);
  const std::string clean = s.dir + "_uninterrupted";
  GptModel model2(mesh, c.model, c.model_options());
  Trainer trainer2(mesh, model2, c, data);
  for (int t = 0; t < s.run.steps; ++t)
    if (std::find(skip.begin(), skip.end(), t) == skip.end()) (void)trainer2.step(t);
  save_checkpoint(clean, mesh, model2, &trainer2.optimizer(), s.run.steps, &trainer2.scaler(),
                  trainer2.expert_optimizer());
  std::string file;
  if (ctx.rank() == 0) {
    file = first_difference(clean, recovered);
    if (s.save.empty()) fs::remove_all(recovered);
    fs::remove_all(clean);
  }
  ctx.verify(ctx.comm().all_true(file.empty()),
             "the recovered run's " + file + " differs from the run without failures");
  ctx.json()["equal_to_uninterrupted"] = file.empty();
  ctx.json()["skipped_steps"] = skip;
  std::string skipped;
  for (int t : skip) skipped += (skipped.empty() ? "" : ", ") + std::to_string(t);
  ctx.say("\nthe final weights and Adam's moments equal the run without failures" +
          (skip.empty() ? std::string() : " that skips step(s) " + skipped + " too") +
          ", byte for byte: " + std::string(file.empty() ? "yes" : "no, " + file));
}

/// The most ranks, below `now`, that the mesh's other axes and the batch allow; 0: none.
int fewer_ranks(const Settings11& s, int now) {
  for (int r = now - 1; r >= 1; --r) try {
      TrainConfig c = s.run.run;
      c.mesh = mesh_of(s, r);
      check_config(c);
      return r;
    } catch (const UsageError&) {
    }
  return 0;
}

void settle_faults(Settings11& s, const std::string& every, int ranks, int first_ranks,
                   std::uint64_t seed) {
  s.every_auto = every == "auto";
  if (!s.every_auto) {
    std::size_t used = 0;
    int k = -1;
    try {
      k = std::stoi(every, &used);
    } catch (const std::exception&) {
    }
    require_usage(
        used == every.size() && k >= 0 && k <= 100000 &&
            every.find_first_not_of("0123456789") == std::string::npos,
        "--checkpoint-every " + every + ": a whole number of steps, 0 to 100000, or auto");
    s.every = k;
  } else {
    require_usage(s.mtbf_steps > 0,
                  "--checkpoint-every auto needs --mtbf-steps N: Young's "
                  "interval is set by how often failures come");
  }
  if (s.sweep) {
    require_usage(s.inject.empty(),
                  "--sweep draws its own failures (--mtbf-steps), "
                  "not --inject's");
    if (s.mtbf_steps == 0) s.mtbf_steps = 10;
    return;
  }
  if (s.inject.empty() && s.mtbf_steps > 0) s.inject = {"none"};
  if (s.inject.empty())
    s.inject = {"kill@" + std::to_string(ranks - 1) + "@" + std::to_string(s.run.steps / 2)};
  // The faults of the whole run, on its first mesh (a supervised attempt after an elastic
  // restart has fewer ranks).
  const int first = first_ranks > 0 ? first_ranks : ranks;
  s.faults = parse_faults(s.inject, first, s.run.steps);
  if (s.mtbf_steps > 0) {
    for (const Fault& f : draw_failures(s.mtbf_steps, seed, first, s.run.steps))
      s.faults.push_back(f);
    std::stable_sort(s.faults.begin(), s.faults.end(),
                     [](const Fault& a, const Fault& b) { return a.step < b.step; });
  }
}

void arm_faults(std::size_t faults) { struck.assign(faults, 0); }

std::string run_folder(const Settings11& s) { return s.dir + ".run"; }

std::string last_struck(const Settings11& s, std::vector<char>& seen) {
  seen.resize(s.faults.size(), 0);
  std::string text;
  for (std::size_t i = 0; i < s.faults.size(); ++i) {
    if (seen[i] || !fs::exists(struck_file(s, i))) continue;
    seen[i] = 1;
    std::ifstream in(struck_file(s, i));
    std::getline(in, text);
  }
  return text;
}

void note_supervised_failure(const Settings11& s, const std::string& failure) {
  nlohmann::json j;
  std::ifstream in(attempt_file(s, s.attempt));
  try {
    in >> j;
  } catch (const nlohmann::json::exception&) {
    return;  // the job ended before its rank 0 wrote: resume_supervised says so
  }
  j["failure"] = failure;
  write_whole(attempt_file(s, s.attempt), j);
}

void note_failure(const std::string& failure) {
  if (!attempts.empty()) attempts.back().failure = failure;
}

void remove_temporary() {
  std::error_code ignored;  // under mpirun, another process may have removed it
  if (!temporary.empty()) fs::remove_all(temporary, ignored);
}

}  // namespace ch11
