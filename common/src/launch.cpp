// launch: parse the command line, start the ranks, turn what happened into an exit code.
#include "shardlab/launch.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "shardlab/check.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/comm_mpi.hpp"
#include "shardlab/comm_nccl.hpp"
#include "shardlab/comm_threads.hpp"
#include "shardlab/cuda.hpp"
#include "shardlab/flight.hpp"
#include "shardlab/tensor.hpp"
#include "shardlab/version.hpp"

namespace shardlab {

namespace {
/// --seed: a whole number 0..2^64-1, said plainly when it is not one (CLI11's own check
/// would print its double range and clamp what is too large).
std::uint64_t parse_seed(const std::string& text) {
  std::uint64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (!text.empty() && text[0] == '-')
    throw CLI::ValidationError(
        "--seed", "'" + text + "' is negative: seeds are 0 to " + std::to_string(UINT64_MAX));
  if (error == std::errc::result_out_of_range)
    throw CLI::ValidationError(
        "--seed", text + " is more than the largest seed, " + std::to_string(UINT64_MAX));
  if (error != std::errc() || stop != end || text.empty())
    throw CLI::ValidationError("--seed", "'" + text + "' is not a whole number");
  return value;
}

double read_number(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word == "max") return 0;
  try {
    return std::stod(word);
  } catch (const std::exception&) {
    return 0;
  }
}
}  // namespace

double memory_available() {
  double available = 0;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    double kib = 0;
    meminfo >> kib;
    if (key == "MemAvailable:") available = kib * 1024;
    meminfo.ignore(256, '\n');
  }
  if (available == 0) available = 1e18;  // not Linux: no figure, no limit from it
  // ulimit -v: the address space left (what is mapped already counts against it).
  rlimit limit{};
  if (getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    double mapped = 0;
    std::ifstream status("/proc/self/status");
    for (std::string key; status >> key;) {
      if (key == "VmSize:") status >> mapped;
      status.ignore(256, '\n');
    }
    available = std::min(available, static_cast<double>(limit.rlim_cur) - mapped * 1024);
  }
  // A cgroup (v2) limit, as containers set.
  const double cgroup_max = read_number("/sys/fs/cgroup/memory.max");
  if (cgroup_max > 0)
    available = std::min(available, cgroup_max - read_number("/sys/fs/cgroup/memory.current"));
  return std::max(available, 0.0);
}

namespace {
/// The number of processes the MPI launcher started, from its environment (0: unknown).
int launched_processes() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS"})
    if (const char* value = std::getenv(var)) {
      char* end = nullptr;
      const long n = std::strtol(value, &end, 10);
      if (end != value && *end == '\0' && n > 0 && n < (1 << 20)) return static_cast<int>(n);
    }
  return 0;
}

/// A usage error found before MPI starts. Under mpirun the first process to end the job
/// may do so before the one that speaks has written its line: the quiet ones leave a
/// moment later, and every one ends the job through MPI (mpi::end_job), so that mpirun
/// adds no banner to the line.
int let_rank_0_speak(bool speaks, int code) {
  if (!started_by_mpirun()) return code;
  if (!speaks) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  if (mpi::available()) mpi::end_job(code);
  return code;
}
}  // namespace

bool started_by_mpirun() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(var) != nullptr) return true;
  return false;
}

// ---------------------------------------------------------------------------
// Context

Context::Context(Communicator& comm, const Options& options)
    : comm_(comm),
      options_(options),
      json_(std::make_unique<nlohmann::json>(nlohmann::json::object())) {}
Context::~Context() = default;

void Context::say(const std::string& text) {
  if (rank() != 0 || !talking()) return;
  std::FILE* out = options_.json ? stderr : stdout;
  std::fputs(text.c_str(), out);
  if (!text.empty() && text.back() != '\n') std::fputc('\n', out);
  std::fflush(out);
}

void Context::say_each(const std::string& line) {
  const std::vector<std::string> lines = comm_.gather_strings(line, 0);
  std::string text;
  for (std::size_t r = 0; r < lines.size(); ++r)
    text += "[rank " + std::to_string(r) + "] " + lines[r] + "\n";
  say(text);
}

bool Context::color() const { return use_color(options_.json ? STDERR_FILENO : STDOUT_FILENO); }

namespace {
// When this program started: a CSV file written after that was written by another run.
const auto started = std::filesystem::file_time_type::clock::now();
}  // namespace

void Context::report(const Table& table, const std::string& name, const std::string& heading) {
  if (rank() != 0) return;
  say((heading.empty() ? "" : heading + "\n") + table.text());
  (*json_)[name] = table.json();
}

double Context::verify_close(const std::string& what, double diff, double tolerance,
                             const std::string& reference) {
  const double agreed = comm_.agree(diff, ReduceOp::max);
  verify(agreed <= tolerance, what + " differs from " + reference + " by " +
                                  format_number(agreed, 3) + " (tolerance " +
                                  format_number(tolerance, 3) + ")");
  return agreed;
}

double Context::verify_replicas(const std::string& what, const Tensor& mine) {
  const double divergence = replica_divergence(comm_, mine);
  verify(divergence == 0, what + ": the replicas differ from rank 0's by up to " +
                              format_number(divergence, 3) + " (they must be identical)");
  return divergence;
}

void Context::save_csv(const Table& table, const std::string& name) {
  if (rank() != 0) return;
  const std::filesystem::path folder(options_.csv_dir);
  auto plain = [&](const std::string& n) { return folder / (n + ".csv"); };
  auto own = [&](const std::string& n) {
    return folder / (n + "." + std::to_string(::getpid()) + ".csv");
  };
  std::error_code error;
  auto written_since = [&](const std::filesystem::path& p, std::filesystem::file_time_type t) {
    return std::filesystem::exists(p, error) && std::filesystem::last_write_time(p, error) > t;
  };
  // Another run wrote this file while this one ran, or rewrote one this run wrote before:
  // then this run's files all go to NAME.PID.csv, the earlier ones again too, so that a
  // run's CSVs (a table and its _events) always come from the same run.
  bool conflict = !csv_diverted_ && written_since(plain(name), started);
  for (std::size_t i = 0; !csv_diverted_ && !conflict && i < csv_written_.size(); ++i)
    conflict = written_since(plain(csv_written_[i].name), csv_written_[i].when);
  if (conflict) {
    say("another run wrote to " + folder.string() + " while this one ran; this run's CSVs go to " +
        own("NAME").string());
    csv_diverted_ = true;
    for (const CsvWritten& w : csv_written_) write_file_atomic(own(w.name), w.text);
  }
  const std::filesystem::path path = csv_diverted_ ? own(name) : plain(name);
  const std::string text = table.csv();
  write_file_atomic(path, text);
  csv_written_.push_back({name, text, std::filesystem::last_write_time(path, error)});
  say("wrote " + path.string());
  (*json_)["csv"] = path.string();
}

bool Context::verify(bool ok, const std::string& what) {
  if (!ok) {
    ok_ = false;
    failures_.push_back(what);
  }
  return ok;
}

void Context::report_failures() {
  // One line per distinct failure, with the ranks that saw it (gathered to rank 0).
  std::string mine;
  for (const std::string& f : failures_) mine += f + '\n';
  const std::vector<std::string> all = comm_.gather_strings(mine, 0);
  if (rank() != 0) return;
  std::vector<std::pair<std::string, std::vector<int>>> seen;
  for (std::size_t r = 0; r < all.size(); ++r) {
    std::size_t start = 0;
    for (std::size_t end; (end = all[r].find('\n', start)) != std::string::npos; start = end + 1) {
      const std::string line = all[r].substr(start, end - start);
      auto it =
          std::find_if(seen.begin(), seen.end(), [&](const auto& s) { return s.first == line; });
      if (it == seen.end()) it = seen.insert(seen.end(), {line, {}});
      it->second.push_back(static_cast<int>(r));
    }
  }
  for (const auto& [line, ranks] : seen) {
    std::string who;
    if (ranks.size() == all.size() && all.size() > 1)
      who = "all " + std::to_string(ranks.size()) + " ranks";
    else
      for (int q : ranks) who += (who.empty() ? "rank " : ", ") + std::to_string(q);
    std::fprintf(stderr, "verification failed (%s): %s\n", who.c_str(), line.c_str());
  }
}

// ---------------------------------------------------------------------------
// Program

namespace {

/// What one rank's body ended with.
struct Outcome {
  int code = 0;  // 0 ok, 1 failed, 2 usage
  std::string message;
  bool aborted = false;  // stopped because another rank failed: not the cause
};

Outcome classify(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const UsageError& e) {
    return {2, e.what(), false};
  } catch (const CommAborted& e) {
    return {1, e.what(), true};
  } catch (const std::exception& e) {
    return {1, e.what(), false};
  } catch (...) {
    return {1, "unknown error", false};
  }
}

/// Writes `record` to DIR/rank_R.json (--flight-dir); a file that cannot be written is
/// said on stderr, not thrown (the job is failing already).
void write_flight_record(const std::string& program, const std::string& dir,
                         const FlightRecord& record) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  const std::string path = dir + "/rank_" + std::to_string(record.rank) + ".json";
  std::ofstream out(path);
  out << flight_record_json(record).dump(1) << "\n";
  if (!out)
    std::fprintf(stderr, "%s: could not write the flight record %s\n", program.c_str(),
                 path.c_str());
}

/// Runs the body on one rank, with the end-of-job agreement on `ok` and the JSON; the
/// rank's calls go to `recorder` when there is one (--flight-record).
int run_rank(Communicator& host, const Options& options, const Body& body,
             std::shared_ptr<FlightRecorder> recorder = nullptr) {
  if (recorder) host.record_flights(std::move(recorder));
  std::unique_ptr<Communicator> gpus;
  if (options.device == "cuda") {
    // Threads share one process, so their rank is their place on the machine; processes
    // under mpirun ask the launcher.
    const int device = cuda::device_for_rank(
        host.backend() == "threads" ? host.rank() : cuda::local_rank(host.rank()));
    cuda::set_device(device);
    if (options.backend == "nccl") gpus = nccl::create(host, device);
  }
  Communicator& comm = gpus ? *gpus : host;
  Context ctx(comm, options);
  body(ctx);
  ctx.report_failures();
  const bool ok = comm.all_true(ctx.ok());
  if (comm.rank() == 0 && options.json) {
    nlohmann::json& j = ctx.json();
    j["ok"] = ok;
    j["backend"] = std::string(comm.backend());
    j["ranks"] = comm.size();
    j["seed"] = options.seed;
    j["device"] = options.device;
    std::cout << j.dump(2) << std::endl;
  }
  return ok ? 0 : 1;
}

}  // namespace

namespace {
std::string ranks_help(int ranks) {
  return "number of ranks (threads backend; under mpirun, mpirun's -np decides) [" +
         std::to_string(ranks) + "]";
}
}  // namespace

Program::Program(std::string name, std::string description)
    : name_(std::move(name)), app_(std::make_unique<CLI::App>(std::move(description), name_)) {
  app_->set_version_flag("--version", std::string(name_) + " (ShardLab " + version + ")");
  app_->add_option_function<int>(
          "-r,--ranks",
          [this](int n) {
            options_.ranks = n;
            ranks_given_ = true;
          },
          ranks_help(options_.ranks))
      ->check(cli::whole(1, 1024));
  app_->add_option("--backend", options_.backend,
                   "auto, threads, mpi or nccl (auto: mpi under mpirun; nccl: one GPU per rank, "
                   "implies --device cuda)")
      ->check(CLI::IsMember({"auto", "threads", "mpi", "nccl"}))
      ->capture_default_str();
  app_->add_option("--device", options_.device,
                   "where tensors live: cpu, or cuda (ranks map to GPUs round robin)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app_->add_option_function<std::string>(
      "--seed", [this](const std::string& text) { options_.seed = parse_seed(text); },
      "seed of every random tensor, 0 to 18446744073709551615 [0]");
  app_->add_flag("--json", options_.json, "print one JSON object on stdout (text goes to stderr)");
  app_->add_option("--csv-dir", options_.csv_dir, "folder for benchmark CSV files")
      ->capture_default_str();
  app_->add_flag("-q,--quiet", options_.quiet, "no human-readable text");
  app_->add_option("--timeout", options_.timeout_s,
                   "seconds a blocking call may wait before the job fails")
      ->check(cli::between(0.001, 86400.0))
      ->capture_default_str();
  app_->add_option("--memory-limit", options_.memory_limit_gib,
                   "GiB the run may use (0: what the machine can give now; also "
                   "SHARDLAB_MEMORY_LIMIT_GIB)")
      ->check(cli::between(0.0, 1e6))
      ->capture_default_str();
  app_->add_option("--flight-record", options_.flight_record,
                   "each rank keeps its last N calls; when the job fails they are compared "
                   "and the rank where the ranks part is named (0: off)")
      ->check(cli::whole(0, 1000000))
      ->capture_default_str();
  app_->add_option("--flight-dir", options_.flight_dir,
                   "where each rank writes its flight record (rank_R.json) when the job fails");
}

void Program::default_flight_record(int calls) {
  options_.flight_record = calls;
  app_->get_option("--flight-record")->default_str(std::to_string(calls));
}

Program::~Program() = default;

void Program::default_ranks(int ranks) {
  options_.ranks = ranks;
  app_->get_option("--ranks")->description(ranks_help(ranks));
}

void Program::on_paper() {
  options_.ranks = 1;
  app_->remove_option(app_->get_option("--ranks"));
}

int Program::run(int argc, char** argv, const Body& body) {
  const bool under_mpirun = started_by_mpirun();
  // Under mpirun only rank 0 reports usage errors, so the message appears once.
  const char* world_rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const bool speaks = !under_mpirun || world_rank == nullptr || std::string_view(world_rank) == "0";
  try {
    app_->parse(argc, argv);
    if (options_.backend == "auto") options_.backend = under_mpirun ? "mpi" : "threads";
    if (options_.backend == "mpi" && !mpi::available())
      throw UsageError(
          "--backend mpi: this build has no MPI backend (install OpenMPI and rebuild)");
    if (options_.backend == "threads" && under_mpirun)
      throw UsageError("--backend threads under mpirun: run one process, or drop --backend");
    if (options_.backend == "nccl") {
      if (!nccl::available())
        throw UsageError("--backend nccl: this build has no NCCL (install it and rebuild)");
      options_.device = "cuda";
      if (cuda_ && cuda::device_count() > 0 && !under_mpirun &&
          options_.ranks > cuda::device_count())
        throw UsageError(
            "--backend nccl needs one GPU per rank: " + std::to_string(options_.ranks) +
            " ranks, " + std::to_string(cuda::device_count()) + " GPU(s)");
    }
    if (options_.device == "cuda") {
      if (!cuda_) throw UsageError("--device cuda: this chapter runs on the CPU only so far");
      if (cuda::device_count() == 0)
        throw UsageError(std::string("--device cuda: no CUDA device found") +
                         (cuda::built() ? "" : " (this build has no CUDA)"));
      if (options_.backend == "mpi")
        throw UsageError(
            "--device cuda with MPI: use --backend nccl (this Open MPI is not CUDA-aware)");
    }
    if (options_.backend == "mpi" && !under_mpirun) {
      // Without mpirun, MPI starts one process (a singleton): that is the world.
      if (ranks_given_ && options_.ranks != 1)
        throw UsageError("--backend mpi without mpirun is one process: start " +
                         std::to_string(options_.ranks) + " with mpirun -np " +
                         std::to_string(options_.ranks) + ", or drop --ranks");
      options_.ranks = 1;
    }
    if (!ranks_given_ && !under_mpirun && default_ranks_from_)
      options_.ranks = default_ranks_from_(options_);
    if (under_mpirun) {
      const int processes = launched_processes();
      if (ranks_given_ && processes > 0 && options_.ranks != processes)
        throw UsageError("--ranks " + std::to_string(options_.ranks) + ", but mpirun started " +
                         std::to_string(processes) + " processes");
      if (processes > 0) options_.ranks = processes;
    }
    if (world_size_) world_size_(options_, options_.ranks);
    if (validate_) validate_(options_);
    host_matmul_kernel();  // SHARDLAB_GEMM, if set, names a kernel this CPU runs
    if (memory_estimate_) check_memory();
    if (writes_csv_ && writes_csv_()) check_writable_folder(options_.csv_dir);
  } catch (const CLI::CallForHelp& e) {
    if (speaks) std::cout << app_->help();
    return 0;
  } catch (const CLI::CallForAllHelp& e) {
    if (speaks) std::cout << app_->help("", CLI::AppFormatMode::All);
    return 0;
  } catch (const CLI::CallForVersion& e) {
    if (speaks) std::cout << app_->version() << "\n";
    return 0;
  } catch (const CLI::ParseError& e) {
    if (speaks) std::fprintf(stderr, "%s: error: %s (see --help)\n", name_.c_str(), e.what());
    return let_rank_0_speak(speaks, 2);
  } catch (const UsageError& e) {
    if (speaks) std::fprintf(stderr, "%s: error: %s\n", name_.c_str(), e.what());
    return let_rank_0_speak(speaks, 2);
  } catch (const std::exception& e) {  // a check of the program's own went wrong
    if (speaks) std::fprintf(stderr, "%s: %s\n", name_.c_str(), e.what());
    return let_rank_0_speak(speaks, 1);
  }
  if (instead_)
    if (const std::optional<int> code = instead_(options_)) return *code;
  // NCCL rides on a host communicator: MPI under mpirun, threads otherwise.
  const bool mpi = options_.backend == "mpi" || (options_.backend == "nccl" && under_mpirun);
  return mpi ? run_mpi(body) : run_threads(body);
}

void Program::check_memory() const {
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  const double need = memory_estimate_(options_);
  double limit = options_.memory_limit_gib * kGiB;
  std::string source = "--memory-limit " + format_number(options_.memory_limit_gib);
  const char* from_env = std::getenv("SHARDLAB_MEMORY_LIMIT_GIB");
  if (limit == 0 && from_env != nullptr && *from_env != '\0') {
    char* end = nullptr;
    const double gib = std::strtod(from_env, &end);
    if (*end != '\0' || !std::isfinite(gib) || gib < 0)
      throw UsageError("SHARDLAB_MEMORY_LIMIT_GIB='" + std::string(from_env) +
                       "' is not a number of GiB");
    limit = gib * kGiB;
    source = "SHARDLAB_MEMORY_LIMIT_GIB=" + std::string(from_env);
  }
  if (limit == 0) {  // a tenth left for the estimates' errors and everything else
    limit = 0.9 * memory_available();
    source = "";
  }
  if (need <= limit) return;
  auto amount = [](double bytes) {
    return bytes >= kGiB ? format_number(bytes / kGiB, 3) + " GiB"
                         : format_number(bytes / (1024.0 * 1024), 3) + " MiB";
  };
  throw UsageError("this run needs about " + amount(need) + " of memory, more than " +
                   (source.empty() ? "the " + amount(limit) +
                                         " this machine can give now (available memory, "
                                         "ulimit -v); use fewer ranks or smaller sizes, or "
                                         "allow more with --memory-limit GIB"
                                   : source + " GiB allows"));
}

int Program::run_threads(const Body& body) {
  for (options_.attempt = 0;; ++options_.attempt) {
    const auto [code, failure] = run_threads_once(body);
    if (failure.empty() || !restart_ || !restart_(options_.attempt + 1, failure)) return code;
  }
}

std::pair<int, std::string> Program::run_threads_once(const Body& body) {
  const int n = options_.ranks;
  std::vector<int> codes(static_cast<std::size_t>(n), 0);
  std::vector<std::exception_ptr> errors;
  std::vector<std::shared_ptr<FlightRecorder>> recorders(static_cast<std::size_t>(n));
  if (options_.flight_record > 0)
    for (int r = 0; r < n; ++r)
      recorders[static_cast<std::size_t>(r)] =
          std::make_shared<FlightRecorder>(r, static_cast<std::size_t>(options_.flight_record));
  try {
    errors = run_ranks(
        n, std::chrono::milliseconds(static_cast<long>(options_.timeout_s * 1000)),
        [&](Communicator& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          codes[r] = run_rank(comm, options_, body, recorders[r]);
        },
        name_);
  } catch (const std::exception& e) {  // the rank threads could not all start
    std::fprintf(stderr, "%s: %s\n", name_.c_str(), e.what());
    return {1, ""};
  }
  // Report the ranks that failed first-hand, not the ones stopped because of them; one
  // line per distinct error (the "rank r: " its message starts with aside), saying how
  // many ranks reported it.
  int code = 0;
  struct Report {
    std::string line;  // the first rank's message, as it was
    std::string key;   // the message without its rank prefix
    int ranks = 0;
    int code = 0;
  };
  std::vector<Report> reports;
  for (const std::exception_ptr& error : errors) {
    if (!error) continue;
    const Outcome f = classify(error);
    code = std::max(code, f.code);
    if (f.aborted) continue;
    std::string key = f.message;
    if (key.rfind("rank ", 0) == 0) {
      const std::size_t colon = key.find(": ");
      if (colon != std::string::npos && key.find_first_not_of("0123456789", 5) == colon)
        key = key.substr(colon + 2);
    }
    auto same =
        std::find_if(reports.begin(), reports.end(), [&](const Report& r) { return r.key == key; });
    if (same == reports.end())
      reports.push_back({f.message, key, 1, f.code});
    else
      ++same->ranks;
  }
  for (const Report& r : reports)
    std::fprintf(
        stderr, "%s: %s%s%s\n", name_.c_str(), r.code == 2 ? "error: " : "", r.line.c_str(),
        r.ranks > 1 ? (" (" + std::to_string(r.ranks) + " ranks reported this)").c_str() : "");
  for (int c : codes) code = std::max(code, c);
  const auto failed =
      std::find_if(reports.begin(), reports.end(), [](const Report& r) { return r.code == 1; });
  if (failed != reports.end() && options_.flight_record > 0) {
    // The ranks' records, written out and compared: where the ranks part.
    std::vector<std::optional<FlightRecord>> records;
    for (const auto& recorder : recorders) records.push_back(recorder->record());
    if (!options_.flight_dir.empty())
      for (const auto& record : records) write_flight_record(name_, options_.flight_dir, *record);
    const FlightVerdict verdict = compare_flights(records);
    if (verdict.anyone_waited)  // (not when every rank failed in its own code)
      for (const std::string& line : verdict.lines)
        std::fprintf(stderr, "%s: flight recorder: %s\n", name_.c_str(), line.c_str());
  }
  return {code, failed == reports.end() ? "" : failed->line};
}

int Program::run_mpi(const Body& body) {
  mpi::init(nullptr, nullptr,
            std::chrono::milliseconds(static_cast<long>(options_.timeout_s * 1000)), name_);
  const int rank = mpi::world_rank();
  if (ranks_given_ && options_.ranks != mpi::world_size()) {
    if (rank == 0)
      std::fprintf(stderr, "%s: error: --ranks %d, but mpirun started %d processes\n",
                   name_.c_str(), options_.ranks, mpi::world_size());
    let_rank_0_speak(rank == 0, 2);
    mpi::finalize();
    return 2;
  }
  int code = 0;
  std::shared_ptr<FlightRecorder> recorder;
  if (options_.flight_record > 0)
    recorder =
        std::make_shared<FlightRecorder>(rank, static_cast<std::size_t>(options_.flight_record));
  if (recorder) recorder->set_hosts(mpi::hosts());
  try {
    auto comm = mpi::world(std::chrono::milliseconds(static_cast<long>(options_.timeout_s * 1000)));
    code = run_rank(*comm, options_, body, recorder);
    // Every rank agreed on the code; rank 0 has written the results before the barrier.
    if (code != 0) {
      comm->barrier();
      mpi::end_job(code);
    }
  } catch (...) {
    // Under mpirun each process writes its own record, for a launcher to compare. The
    // others write theirs when their own waits run out, within one --timeout of this one:
    // the job is ended only after that, so that every rank that can still write has.
    if (recorder && !options_.flight_dir.empty()) {
      write_flight_record(name_, options_.flight_dir, recorder->record());
      std::this_thread::sleep_for(std::chrono::duration<double>(options_.timeout_s + 0.5));
    }
    const Outcome f = classify(std::current_exception());
    int order = 0;
    try {
      throw;
    } catch (const CommError& e) {
      order = e.report_order;
    } catch (...) {
    }
    mpi::fail(name_ + ": " + (f.code == 2 ? "error: " : "") + f.message + " (ending the job)",
              f.code, order);
  }
  mpi::finalize();
  return code;
}

// ---------------------------------------------------------------------------
// Flight records as JSON (flight.hpp), here where the JSON library is compiled already:
// the launcher writes them (--flight-dir).

nlohmann::json flight_record_json(const FlightRecord& record) {
  nlohmann::json j;
  j["rank"] = record.rank;
  j["started"] = record.started;
  j["groups"] = record.groups;
  if (!record.hosts.empty()) j["hosts"] = record.hosts;
  nlohmann::json flights = nlohmann::json::array();
  for (const Flight& f : record.flights)
    flights.push_back({{"group", f.group},
                       {"seq", f.seq},
                       {"op", std::string(op_name(f.op))},
                       {"peer", f.peer},
                       {"count", f.count},
                       {"type", std::string(dtype_name(f.type))},
                       {"start", f.start},
                       {"end", f.end}});
  j["flights"] = std::move(flights);
  return j;
}

FlightRecord flight_record_from_json(const nlohmann::json& j) {
  try {
    FlightRecord r;
    r.rank = j.at("rank").get<int>();
    r.started = j.at("started").get<std::map<std::string, std::uint64_t>>();
    r.groups = j.at("groups").get<std::map<std::string, std::vector<int>>>();
    if (j.contains("hosts")) r.hosts = j.at("hosts").get<std::vector<std::string>>();
    for (const nlohmann::json& f : j.at("flights")) {
      Flight x;
      x.group = f.at("group").get<std::string>();
      x.seq = f.at("seq").get<std::uint64_t>();
      const std::string op = f.at("op").get<std::string>();
      bool known = false;
      for (std::size_t o = 0; o < op_count; ++o)
        if (op_name(static_cast<Op>(o)) == op) {
          x.op = static_cast<Op>(o);
          known = true;
        }
      if (!known) throw Error("unknown operation '" + op + "'");
      x.peer = f.at("peer").get<int>();
      x.count = f.at("count").get<std::size_t>();
      const std::string type = f.at("type").get<std::string>();
      known = false;
      for (DType t :
           {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::u8})
        if (dtype_name(t) == type) {
          x.type = t;
          known = true;
        }
      if (!known) throw Error("unknown type '" + type + "'");
      x.start = f.at("start").get<double>();
      x.end = f.at("end").get<double>();
      r.flights.push_back(std::move(x));
    }
    return r;
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("a flight record: ") + e.what());
  }
}

}  // namespace shardlab
