// launch: the command line, the ranks, and the exit code of every chapter program.
//
//   #include <CLI/CLI.hpp>              // the program's own flags
//   #include <nlohmann/json.hpp>        // what it reports under --json
//   int main(int argc, char** argv) {
//     shardlab::Program program("ch01_matmul_split", "Matmul split by rows, then columns");
//     int rows = 4;
//     program.cli().add_option("--rows", rows, "rows of x")->check(CLI::PositiveNumber);
//     return program.run(argc, argv, [&](shardlab::Context& ctx) { ... });
//   }
//
// run() parses the common flags (below) and the chapter's own, picks the backend
// (mpi when started by mpirun, else threads), checks what the chapter needs of the
// number of ranks and of memory, starts the ranks, runs the body on each, and turns what
// happened into an exit code:
//   0  ok
//   1  a verification failed (Context::verify), or a rank failed: its error is printed,
//      the other ranks are stopped (MPI_Abort under MPI), nobody is left waiting
//   2  bad usage: one line on stderr saying what is wrong
//
// Common flags: --ranks N, --backend auto|threads|mpi|nccl, --device cpu|cuda, --seed S,
// --json, --csv-dir DIR, --quiet, --timeout SECONDS, --memory-limit GIB, --flight-record N,
// --flight-dir DIR, --help, --version.
//
// This header names CLI11's and nlohmann-json's types without including them (they are
// heavy); a program that adds flags or JSON fields includes them itself.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <utility>

#include "shardlab/comm.hpp"
#include "shardlab/results.hpp"

namespace CLI {
class App;
}

namespace shardlab {

/// The common flags, after parsing.
struct Options {
  int ranks = 2;  ///< --ranks (threads backend); under mpirun, the processes it started.
  std::string backend = "auto";     ///< --backend auto|threads|mpi|nccl.
  std::string device = "cpu";       ///< --device cpu|cuda: cuda puts rank r on GPU r % count.
  std::uint64_t seed = 0;           ///< --seed: every random tensor derives from it.
  bool json = false;                ///< --json: one JSON object on stdout, text on stderr.
  std::string csv_dir = "results";  ///< --csv-dir: where benchmark CSV files go.
  bool quiet = false;               ///< --quiet: no human-readable text.
  double timeout_s = 60;            ///< --timeout: how long a blocking call may wait (seconds).
  double memory_limit_gib = 0;      ///< --memory-limit (GiB): 0 = what the machine can give now.
  int attempt = 0;  ///< which run of the job this is: 0, then 1, 2, ... (Program::restart)
  /// --flight-record: each rank keeps its last N calls and, when the job fails, the ranks'
  /// records are compared (flight.hpp); 0: none.
  int flight_record = 0;
  /// --flight-dir: where each rank writes its flight record (rank_R.json) when the job
  /// fails; "": nowhere (on threads the records are compared in the process). Under
  /// mpirun a failing job then ends one --timeout later, once the other ranks have written.
  std::string flight_dir;
  /// Where a rank's tensors live: Memory::device under --device cuda (or --backend nccl).
  Memory memory() const { return device == "cuda" ? Memory::device : Memory::host; }
};

/// What a rank's body gets: its communicator, the options, and the job's outputs.
class Context {
 public:
  /// The context of the rank of `comm`; `comm` and `options` must outlive it.
  Context(Communicator& comm, const Options& options);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  /// This rank's world communicator.
  Communicator& comm() { return comm_; }
  /// This rank's number, 0..size()-1.
  int rank() const { return comm_.rank(); }
  /// The number of ranks in the job.
  int size() const { return comm_.size(); }
  /// The common flags.
  const Options& options() const { return options_; }
  /// True under --device cuda (this rank's thread is then on GPU rank % device count).
  bool on_gpu() const { return options_.device == "cuda"; }
  /// Where this rank's tensors live: Memory::device under --device cuda.
  Memory memory() const { return options_.memory(); }

  /// Human text from rank 0 (the job's voice): stdout, or stderr under --json,
  /// nothing under --quiet. Other ranks' calls are ignored.
  void say(const std::string& text);
  /// One line from every rank, printed by rank 0 in rank order as "[rank r] line".
  /// Every rank must call it (it gathers the lines; the traffic is not counted).
  void say_each(const std::string& line);
  /// True when human text is printed at all (not --quiet).
  bool talking() const { return !options_.quiet; }
  /// True when the text goes to a colour terminal.
  bool color() const;

  /// Records a check. A failed one makes the job exit 1; `what` is printed when the body
  /// has finished on every rank, once for all the ranks that reported it.
  bool verify(bool ok, const std::string& what);
  /// The distributed result against its reference: agrees the largest `diff` over the
  /// ranks (every rank calls it; NaN anywhere fails everywhere) and records the check
  /// "`what` differs from <reference> by D (tolerance T)". Returns the agreed diff.
  double verify_close(const std::string& what, double diff, double tolerance,
                      const std::string& reference = "one device's");
  /// Replicas that must be identical (data-parallel weights): the largest difference of
  /// `mine` from rank 0's copy, over every rank (uncounted), must be 0. Returns it.
  double verify_replicas(const std::string& what, const Tensor& mine);
  /// False once a check recorded on this rank has failed.
  bool ok() const { return ok_; }
  /// Prints the failed checks of every rank, each distinct one once (every rank calls it;
  /// run() does, after the body).
  void report_failures();

  /// The --json object (rank 0's is printed); `ok` and the common fields are added.
  nlohmann::json& json() { return *json_; }

  /// Rank 0 writes `table` to `CSV_DIR/NAME.csv` (`--csv-dir`, atomically), says so, and records
  /// the path under "csv" in the JSON. Benchmark modes call it; the notebooks read it. A
  /// file another run wrote while this one ran is left alone: this run's CSVs, the earlier
  /// ones included, go to NAME.PID.csv, so that a run's files stay together.
  void save_csv(const Table& table, const std::string& name);
  /// One result, written once: rank 0 prints `heading` and the table's text (unless
  /// --quiet), and the JSON gets it under `name` (an array of row objects).
  void report(const Table& table, const std::string& name, const std::string& heading = "");

 private:
  Communicator& comm_;
  const Options& options_;
  std::unique_ptr<nlohmann::json> json_;
  bool ok_ = true;
  std::vector<std::string> failures_;
  bool csv_diverted_ = false;  // this run's CSVs go to NAME.PID.csv (save_csv)
  struct CsvWritten {
    std::string name, text;
    std::filesystem::file_time_type when;
  };
  std::vector<CsvWritten> csv_written_;
};

/// What a program runs on every rank, given that rank's Context.
using Body = std::function<void(Context&)>;

/// A chapter program: its flags, what it needs of the ranks and of memory, and run(),
/// which starts the ranks and turns what happened into the exit code (see the top).
class Program {
 public:
  /// `name` names the program in --version and starts its error lines
  /// ("ch01_matmul_split"); `description` heads --help.
  Program(std::string name, std::string description);
  ~Program();
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;
  /// The parser: chapters add their own flags to it before run().
  CLI::App& cli() { return *app_; }
  /// The chapter has a GPU path: --device cuda is accepted (otherwise it is bad usage).
  void supports_cuda() { cuda_ = true; }
  /// The number of ranks when --ranks is not given (2 unless a chapter says otherwise:
  /// chapter 08's 2 x 2 x 2 mesh wants 8).
  void default_ranks(int ranks);
  /// A program on paper (chapter 08's planner and layout): it computes on one rank, so it
  /// has no --ranks to give (more ranks would only do the same work again).
  void on_paper();
  /// The same, worked out from the other flags once they are parsed (chapter 09: a mesh
  /// whose axes ask for more ranks than its default gets them); not under mpirun, whose
  /// processes are the ranks.
  void default_ranks(std::function<int(const Options&)> ranks) {
    default_ranks_from_ = std::move(ranks);
  }
  /// Chapter checks that need several flags at once; throw UsageError to exit 2.
  void validate(std::function<void(const Options&)> check) { validate_ = std::move(check); }
  /// What the chapter needs of the number of ranks (E experts over N ranks, N dividing
  /// the batch, ...): `check` throws UsageError when `ranks` cannot run. run() calls it
  /// with --ranks before the threads start, and under mpirun with the number of
  /// processes mpirun started, before any of them starts MPI: one line, from one process,
  /// exit 2.
  void world_size(std::function<void(const Options&, int ranks)> check) {
    world_size_ = std::move(check);
  }
  /// How many bytes the whole run needs on this machine (all its ranks together; under
  /// mpirun, this process's), worked out from the flags before anything is allocated.
  /// run() refuses (exit 2) a run that needs more than the machine can give: the memory
  /// available now, the address-space limit (ulimit -v), or --memory-limit /
  /// SHARDLAB_MEMORY_LIMIT_GIB when given.
  void memory_estimate(std::function<double(const Options&)> bytes) {
    memory_estimate_ = std::move(bytes);
  }
  /// The run writes CSV files when `when()` holds (a benchmark mode): --csv-dir is then
  /// made and tried before the ranks start, not after the benchmark.
  void writes_csv(std::function<bool()> when) { writes_csv_ = std::move(when); }
  /// After the flags are parsed and checked: `run` may do the program's work itself, in
  /// this process and without ranks (a supervisor that starts other processes), and return
  /// the exit code; std::nullopt goes on to start the ranks.
  void instead(std::function<std::optional<int>(const Options&)> run) { instead_ = std::move(run); }
  /// A supervisor, on the threads backend: when a run ends because a rank failed (an
  /// error it raised, or a --timeout it ran into; not bad usage, not a failed
  /// verification), `again(attempt, failure)` says whether to run the job once more, from
  /// the start, on fresh ranks; `attempt` is the run that would come (1, 2, ...), `failure`
  /// the first failing rank's line. Options::attempt tells the body which run it is in. A
  /// rank that never returns ends the process (nothing to restart), and under mpirun the
  /// job ends as without a supervisor: a launcher around mpirun starts it again.
  void restart(std::function<bool(int attempt, const std::string& failure)> again) {
    restart_ = std::move(again);
  }
  /// The flight recorder's length when --flight-record is not given (0: off unless asked).
  void default_flight_record(int calls);
  /// From a restart callback: the next run of the job has `ranks` ranks (threads), an
  /// elastic restart on the ranks that remain. The body sees them as Context::size().
  void resize(int ranks) { options_.ranks = ranks; }
  /// Parses argv, runs `body` on every rank, returns the exit code (see the top).
  int run(int argc, char** argv, const Body& body);
  /// The common flags: the defaults until run() has parsed argv.
  const Options& options() const { return options_; }

 private:
  int run_threads(const Body& body);
  /// One run of the job on threads: its exit code, and the first failing rank's line when
  /// a rank failed first-hand (else empty).
  std::pair<int, std::string> run_threads_once(const Body& body);
  int run_mpi(const Body& body);
  void check_memory() const;
  std::string name_;
  std::unique_ptr<CLI::App> app_;
  Options options_;
  std::function<void(const Options&)> validate_;
  std::function<void(const Options&, int)> world_size_;
  std::function<double(const Options&)> memory_estimate_;
  std::function<bool(int, const std::string&)> restart_;
  std::function<std::optional<int>(const Options&)> instead_;
  std::function<bool()> writes_csv_;
  bool ranks_given_ = false;
  std::function<int(const Options&)> default_ranks_from_;
  bool cuda_ = false;
};

/// True when this process was started by mpirun (or another MPI launcher).
bool started_by_mpirun();

/// Bytes this process can still allocate: the smaller of the memory available now
/// (MemAvailable), the room left under its address-space limit (ulimit -v) and under its
/// cgroup's memory limit.
double memory_available();

}  // namespace shardlab
