// Chapter 03 — ring-AllReduce from scratch, measured like nccl-tests.
//
// The course names ring-AllReduce as the bandwidth-optimal way to synchronise gradients
// (CS336 lecture 7 §3.2 "使用Ring-AllReduce算法（带宽优化）"; so-large-lm ch. 8 §3 relies on
// NCCL's AllReduce). This chapter builds it on send/recv alone, next to the naive
// algorithm (everything through rank 0) and recursive doubling (what MPI libraries use
// for short messages), checks each against the backend's own allreduce, counts the
// bytes every rank sends against the formula, and benchmarks them the way nccl-tests
// does: algbw = S / t, busbw = algbw * 2(N-1)/N, with the backend's native allreduce
// (threads: shared memory; MPI: MPI_Allreduce) and, as a reference point, every rank
// copying S bytes (memcpy) in the same run.
//
// Run:
//   build/default/bin/ch03_ring_allreduce --ranks 4            correctness + bytes, every algorithm
//   build/default/bin/ch03_ring_allreduce --ranks 3 --count 10 --algo ring
//   build/default/bin/ch03_ring_allreduce --ranks 4 -b 1M -e 64M -f 2 --csv-dir results
//   mpirun -np 4 build/default/bin/ch03_ring_allreduce -b 1M -e 64M --csv-dir results
//
// Expected: every algorithm correct (the data are small integers, so every summation
// order gives the exact sum); ring bytes per rank = 2(N-1)/N * S.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ring_allreduce.hpp"
#include "shardlab/bench.hpp"
#include "shardlab/check.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/cuda.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/results.hpp"
#include "shardlab/tensor.hpp"

using namespace shardlab;

namespace {

const std::vector<std::string> all_algorithms = {"naive", "ring", "pipelined", "recursive_doubling",
                                                 "native"};

struct Settings {
  std::string algo = "all";
  std::size_t count = 1000003;  // a prime: no world size divides it
  bool benchmark = false;
  std::size_t min_bytes = 1 << 20, max_bytes = 64 << 20;
  double factor = 2;
  int iters = 20, warmup = 5;
  double segment_kb = 256;
};

/// Rank q's input: small integers, so every summation order gives the exact sum.
void fill(std::span<float> data, int rank) {
  for (std::size_t i = 0; i < data.size(); ++i)
    data[i] = static_cast<float>((rank + 1) * static_cast<int>(i % 13 + 1));
}
float expected(std::size_t i, int ranks) {
  return static_cast<float>(ranks * (ranks + 1) / 2 * static_cast<int>(i % 13 + 1));
}

void run_algorithm(const std::string& name, Communicator& comm, std::span<float> data,
                   const Settings& s, ch03::Workspace& scratch) {
  if (name == "naive")
    ch03::naive_allreduce(comm, data, scratch);
  else if (name == "ring")
    ch03::ring_allreduce(comm, data, scratch);
  else if (name == "pipelined")
    ch03::pipelined_ring_allreduce(
        comm, data, std::max<std::size_t>(1, static_cast<std::size_t>(s.segment_kb * 1024 / 4)),
        scratch);
  else if (name == "recursive_doubling")
    ch03::recursive_doubling_allreduce(comm, data, scratch);
  else
    comm.allreduce(data, ReduceOp::sum);
}

/// The buffers an algorithm runs on: host memory, or under --device cuda this rank's GPU
/// (there only the native allreduce and memcpy run: the from-scratch algorithms add on
/// the host).
struct Buffers {
  Memory memory;
  Tensor data, copy;  // copy: where memcpy writes
  ch03::Workspace scratch;

  explicit Buffers(Memory m) : memory(m) {}
  void resize(std::size_t count) {
    if (static_cast<std::size_t>(data.size()) == count && data.memory() == memory) return;
    data = empty(Shape{static_cast<std::int64_t>(count)}, DType::f32, memory);
    copy = empty(Shape{static_cast<std::int64_t>(count)}, DType::f32, memory);
  }
  void run(const std::string& name, Communicator& comm, const Settings& s) {
    if (name == "memcpy")
      copy.copy_from(data);
    else if (memory == Memory::device)
      comm.allreduce(data, ReduceOp::sum);
    else
      run_algorithm(name, comm, data.span(), s, scratch);
  }
  /// Runs `name` once on fresh data; returns the number of wrong elements on this rank.
  std::size_t wrong_after_run(const std::string& name, Communicator& comm, const Settings& s) {
    if (memory == Memory::host) {
      fill(data.span(), comm.rank());
    } else {
      Tensor host(data.size());
      fill(host.span(), comm.rank());
      data.copy_from(host.to(memory));
    }
    run(name, comm, s);
    const Tensor host = data.to(Memory::host);  // data itself when it is on the host
    std::size_t wrong = 0;
    for (std::int64_t i = 0; i < host.size(); ++i)
      wrong += host[i] != expected(static_cast<std::size_t>(i), comm.size());
    return wrong;
  }
};

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (b >= 1024 && u < 3) b /= 1024, ++u;
  return format_number(b, 4) + " " + units[u];
}

// ---------------------------------------------------------------------------
// Correctness and bytes, one run per algorithm.

void correctness(Context& ctx, const std::vector<std::string>& algorithms, const Settings& s) {
  Communicator& comm = ctx.comm();
  const int N = ctx.size();
  std::ostringstream head;
  head << "Chapter 03 - allreduce (sum) of " << s.count << " floats ("
       << human_bytes(4.0 * static_cast<double>(s.count)) << ") on " << N << " ranks ("
       << comm.backend() << " backend" << (ctx.on_gpu() ? ", device buffers on GPUs" : "")
       << ")\n\n"
       << "algorithm            correct   bytes sent per rank                   formula per rank\n";
  ctx.say(head.str());
  Buffers buf(ctx.memory());
  buf.resize(s.count);
  for (const std::string& name : algorithms) {
    const CommStats before = comm.stats();
    const auto wrong = static_cast<std::uint64_t>(
        comm.agree(static_cast<std::int64_t>(buf.wrong_after_run(name, comm, s)), ReduceOp::sum));
    const CommStats delta = comm.stats().since(before);
    const std::vector<std::int64_t> all_sent =
        comm.gather_values(static_cast<std::int64_t>(delta.total().bytes_sent));
    std::vector<std::int64_t> formula;
    for (int q = 0; q < N; ++q) {
      formula.push_back(
          name == "native"
              ? static_cast<std::int64_t>(collective_traffic(Op::allreduce, s.count, 4, q, N).sent)
              : static_cast<std::int64_t>(ch03::formula_bytes_sent(name, s.count, q, N)));
    }
    // Point-to-point bytes are always measured; a library's collective (MPI's, NCCL's)
    // hides its algorithm, so its bytes are the formula's, marked modeled.
    const bool modeled = delta.any_modeled();
    std::string measured, predicted;
    for (int q = 0; q < N; ++q) {
      measured += (q ? " " : "") + std::to_string(all_sent[static_cast<std::size_t>(q)]);
      predicted += (q ? " " : "") + std::to_string(formula[static_cast<std::size_t>(q)]);
    }
    char line[400];
    const std::string note =
        modeled ? "  [modeled: " + std::string(comm.backend()) + " hides its algorithm]"
                : "  (measured)";
    std::snprintf(line, sizeof line, "%-20s %-9s %-37s %s%s", name.c_str(),
                  wrong == 0 ? "yes" : "NO", measured.c_str(), predicted.c_str(), note.c_str());
    ctx.say(line);
    ctx.verify(wrong == 0, name + ": " + std::to_string(wrong) + " wrong elements in all (" +
                               std::to_string(N) + " ranks' buffers of " + std::to_string(s.count) +
                               ")");
    ctx.verify(all_sent == formula, name + ": bytes sent differ from the formula");
    auto& j = ctx.json()["algorithms"][name];
    j["correct"] = wrong == 0;
    j["wrong"] = wrong;
    j["bytes_sent_per_rank"] = all_sent;
    j["formula_bytes_per_rank"] = formula;
    j["traffic_modeled"] = modeled;
  }
  const double ideal = 2.0 * (N - 1) / N * 4.0 * static_cast<double>(s.count);
  ctx.say("\nring ideal: 2(N-1)/N x S = " + format_number(ideal, 10) +
          " bytes per rank (naive: rank 0 sends (N-1) x S = " +
          format_number((N - 1) * 4.0 * static_cast<double>(s.count), 10) + ")");
}

// ---------------------------------------------------------------------------
// Benchmark, in nccl-tests' format, on the common harness.

void benchmark(Context& ctx, const std::vector<std::string>& algorithms, const Settings& s) {
  Communicator& comm = ctx.comm();
  const int N = ctx.size();
  const double bus_factor = N > 1 ? 2.0 * (N - 1) / N : 1.0;
  Buffers buf(ctx.memory());
  std::vector<bench::Case> cases;
  auto prepare = [&](std::int64_t count) {
    buf.resize(static_cast<std::size_t>(count));
    buf.data.zero();  // sums of zeros stay zero, however many iterations
  };
  for (const std::string& name : algorithms) {
    bench::Case c;
    c.name = name;
    c.prepare = prepare;
    c.run = [&, name] { buf.run(name, comm, s); };
    c.wrong = [&, name] { return static_cast<std::uint64_t>(buf.wrong_after_run(name, comm, s)); };
    c.bus_factor = bus_factor;
    cases.push_back(c);
  }
  // The reference point: each rank copies S bytes (busbw = algbw).
  bench::Case copy;
  copy.name = "memcpy";
  copy.prepare = prepare;
  copy.run = [&] { buf.run("memcpy", comm, s); };
  cases.push_back(copy);
  bench::Config config;
  config.title =
      "ch03_ring_allreduce benchmark: allreduce (sum) of floats, pipelined segments of " +
      format_number(s.segment_kb) + " KiB; busbw = algbw x 2(N-1)/N = algbw x " +
      format_number(bus_factor, 4) + "; memcpy: each rank copies S bytes " +
      (ctx.on_gpu() ? "device to device on its GPU" : "on the host") + " (busbw = algbw)";
  config.iterations = s.iters;
  config.warmup = s.warmup;
  config.synchronize = [&] {
    if (ctx.on_gpu()) cuda::synchronize();
  };
  config.csv_name = "03_ring_allreduce";
  const std::vector<bench::Row> rows =
      bench::run(ctx, config, cases, bench::sweep(s.min_bytes, s.max_bytes, s.factor, 4));

  // Ratios to the peer (the backend's own allreduce) and to the machine's copy.
  std::ostringstream tail;
  tail << "#\n# busbw ratios, averaged over sizes:        vs native    vs memcpy\n";
  for (const std::string& name : algorithms) {
    const double vs_native = bench::mean_ratio(rows, name, "native");
    const double vs_memcpy = bench::mean_ratio(rows, name, "memcpy");
    char line[160];
    std::snprintf(line, sizeof line, "#   %-20s                      %8.3f x   %8.3f x",
                  name.c_str(), vs_native, vs_memcpy);
    tail << line << "\n";
    auto& j = ctx.json()["algorithms"][name];
    j["busbw_ratio_vs_native"] = vs_native;
    j["busbw_ratio_vs_memcpy"] = vs_memcpy;
    j["benchmark"] = nlohmann::json::array();
    double sum = 0;
    for (const bench::Row& r : bench::rows_of(rows, name)) {
      j["benchmark"].push_back({{"bytes", r.bytes},
                                {"time_us", r.time_us},
                                {"algbw_GBps", r.algbw_GBps},
                                {"busbw_GBps", r.busbw_GBps},
                                {"wrong", r.wrong}});
      sum += r.busbw_GBps;
    }
    j["avg_busbw_GBps"] = sum / static_cast<double>(bench::rows_of(rows, name).size());
  }
  ctx.say(tail.str());
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch03_ring_allreduce",
                  "Chapter 03: ring-AllReduce from scratch, measured like nccl-tests");
  Settings s;
  auto& cli = program.cli();
  cli.add_option("--algo", s.algo, "naive, ring, pipelined, recursive_doubling, native or all")
      ->check(CLI::IsMember({"naive", "ring", "pipelined", "recursive_doubling", "native", "all"}))
      ->capture_default_str();
  cli.add_option("--count", s.count, "floats in the correctness run")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 30))
      ->capture_default_str();
  cli.add_flag("--benchmark", s.benchmark, "benchmark over the sizes -b..-e (implied by -b or -e)");
  auto* b =
      cli.add_option("-b,--minbytes", s.min_bytes, "smallest message, bytes (K, M, G suffixes)")
          ->transform(CLI::AsSizeValue(false))
          ->check(CLI::Range(std::size_t{4}, std::size_t{1} << 32));
  auto* e =
      cli.add_option("-e,--maxbytes", s.max_bytes, "largest message, bytes (K, M, G suffixes)")
          ->transform(CLI::AsSizeValue(false))
          ->check(CLI::Range(std::size_t{4}, std::size_t{1} << 32));
  cli.add_option("-f,--stepfactor", s.factor, "size multiplier between rows")
      ->check(cli::between(2.0, 1024.0))
      ->capture_default_str();
  cli.add_option("-n,--iters", s.iters, "timed iterations per size")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  cli.add_option("-w,--warmup_iters", s.warmup, "untimed iterations first")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  cli.add_option("--segment-kb", s.segment_kb, "pipelined ring: segment size in KiB")
      ->check(cli::between(0.004, 1048576.0))
      ->capture_default_str();
  program.validate([&](const Options& o) {
    if (b->count() || e->count()) s.benchmark = true;
    require_usage(s.min_bytes <= s.max_bytes, "-b (" + std::to_string(s.min_bytes) +
                                                  ") is larger than -e (" +
                                                  std::to_string(s.max_bytes) + ")");
    // Tiny segments on large chunks mean millions of messages per allreduce: minutes of
    // per-message overhead that teach nothing. The pipelined ring cuts each chunk into
    // at most kMaxSegments segments.
    if (s.algo != "pipelined" && s.algo != "all") return;
    constexpr double kMaxSegments = 16384;
    const double largest = std::max(4.0 * static_cast<double>(s.count),
                                    s.benchmark ? static_cast<double>(s.max_bytes) : 0.0);
    const double chunk = std::ceil(largest / std::max(1, o.ranks));
    const double segment = std::max(4.0, std::floor(s.segment_kb * 1024 / 4) * 4);
    if (chunk / segment > kMaxSegments)
      throw UsageError("--segment-kb " + format_number(s.segment_kb) + " cuts a " +
                       std::to_string(static_cast<long long>(std::ceil(chunk / 1024))) +
                       " KiB chunk into " +
                       std::to_string(static_cast<long long>(std::ceil(chunk / segment))) +
                       " segments, each a message: use --segment-kb " +
                       format_number(std::ceil(chunk / kMaxSegments / 1024 * 1000) / 1000) +
                       " or more for these sizes");
  });

  // Memory: every rank holds the data, a copy (memcpy's) and scratch as large as the data
  // (the naive algorithm's rank 0), for the correctness count and the largest benchmark
  // size, and a half more for the program itself and the backend's buffers (3.4x the data
  // per rank measured at 200 MiB); the ranks of a threads job share this machine.
  program.memory_estimate([&](const Options& o) {
    const double largest =
        std::max(4.0 * static_cast<double>(s.count),
                 s.benchmark || b->count() || e->count() ? static_cast<double>(s.max_bytes) : 0.0);
    return 3.5 * largest * (o.backend == "threads" || o.backend == "auto" ? o.ranks : 1);
  });
  program.writes_csv([&] { return s.benchmark || b->count() > 0 || e->count() > 0; });
  program.supports_cuda();
  return program.run(argc, argv, [&](Context& ctx) {
    std::vector<std::string> algorithms =
        s.algo == "all" ? all_algorithms : std::vector<std::string>{s.algo};
    if (ctx.on_gpu()) {
      // On device buffers: the backend's allreduce (threads: copies and kernels; nccl:
      // ncclAllReduce) and the device memcpy. The from-scratch algorithms add on the host.
      if (s.algo != "all" && s.algo != "native")
        throw UsageError(
            "--device cuda: only --algo native runs on device buffers (the from-scratch algorithms "
            "add on the host)");
      algorithms = {"native"};
    }
    // The benchmark compares against the native allreduce, so it always runs it.
    if (s.benchmark &&
        std::find(algorithms.begin(), algorithms.end(), "native") == algorithms.end())
      algorithms.push_back("native");
    ctx.json()["chapter"] = "03_ring_allreduce";
    ctx.json()["count"] = s.count;
    correctness(ctx, algorithms, s);
    if (s.benchmark) {
      ctx.say("");
      benchmark(ctx, algorithms, s);
    }
  });
}
