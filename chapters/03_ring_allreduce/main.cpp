// Chapter 03 — ring-AllReduce from scratch, measured like nccl-tests.
//
// The course names ring-AllReduce as the bandwidth-optimal way to synchronise gradients
// (CS336 lecture 7 §3.2 "使用Ring-AllReduce算法（带宽优化）"; so-large-lm ch. 8 §3 relies on
// NCCL's AllReduce). This chapter builds it on send/recv alone, next to the naive
// algorithm (everything through rank 0) and recursive doubling (what MPI libraries use
// for short messages), checks each against the backend's own allreduce, counts the
// bytes every rank sends against the formula, and benchmarks them the way nccl-tests
// does: algbw = S / t, busbw = algbw * 2(N-1)/N, with the backend's native allreduce
// (threads: shared memory; MPI: MPI_Allreduce) and a memcpy of the same size — the
// machine's limit — in the same run.
//
// Run:
//   build/default/bin/ch03_ring_allreduce --ranks 4                  correctness + bytes, every
//   algorithm build/default/bin/ch03_ring_allreduce --ranks 3 --count 10 --algo ring
//   build/default/bin/ch03_ring_allreduce --ranks 2 -b 1M -e 64M -f 2 --csv-dir results
//   mpirun -np 2 build/default/bin/ch03_ring_allreduce -b 1M -e 64M --csv-dir results
//
// Expected: every algorithm correct (the data are small integers, so every summation
// order gives the exact sum); ring bytes per rank = 2(N-1)/N * S.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <sstream>

#include "ring_allreduce.hpp"
#include "shardlab/check.hpp"
#include "shardlab/cuda.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/results.hpp"
#include "shardlab/tensor.hpp"

using namespace shardlab;

namespace {

using Clock = std::chrono::steady_clock;
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
                   const Settings& s) {
  if (name == "naive")
    ch03::naive_allreduce(comm, data);
  else if (name == "ring")
    ch03::ring_allreduce(comm, data);
  else if (name == "pipelined")
    ch03::pipelined_ring_allreduce(
        comm, data, std::max<std::size_t>(1, static_cast<std::size_t>(s.segment_kb * 1024 / 4)));
  else if (name == "recursive_doubling")
    ch03::recursive_doubling_allreduce(comm, data);
  else
    comm.allreduce(data, ReduceOp::sum);
}

/// The buffers an algorithm runs on: host memory, or under --device cuda this rank's GPU
/// (there only the native allreduce and memcpy run: the from-scratch algorithms add on
/// the host).
struct Buffers {
  bool gpu;
  std::vector<float> host, other;
  cuda::DeviceTensor device, device_other;

  Buffers(std::size_t count, bool on_gpu) : gpu(on_gpu), host(count), other(on_gpu ? 0 : count) {
    if (!gpu) return;
    device = cuda::DeviceTensor(1, static_cast<std::int64_t>(count));
    device_other = cuda::DeviceTensor(1, static_cast<std::int64_t>(count));
  }
  std::size_t bytes() const { return host.size() * sizeof(float); }
  void run(const std::string& name, Communicator& comm, const Settings& s) {
    if (name == "memcpy") {
      if (gpu)
        cuda::copy(device_other.data(), device.data(), bytes());
      else
        std::memcpy(other.data(), host.data(), bytes());
    } else if (gpu) {
      comm.allreduce(device, ReduceOp::sum);
    } else {
      run_algorithm(name, comm, host, s);
    }
  }
  /// Runs `name` once on fresh data; returns the number of wrong elements on this rank.
  std::size_t wrong_after_run(const std::string& name, Communicator& comm, const Settings& s) {
    fill(host, comm.rank());
    if (gpu) cuda::copy(device.data(), host.data(), bytes());
    run(name, comm, s);
    if (gpu) cuda::copy(host.data(), device.data(), bytes());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < host.size(); ++i) wrong += host[i] != expected(i, comm.size());
    return wrong;
  }
  /// Zeros: sums of zeros stay zero, however many timed iterations run in place.
  void zero() {
    std::fill(host.begin(), host.end(), 0.0f);
    if (gpu) cuda::copy(device.data(), host.data(), bytes());
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
       << "algorithm            correct   bytes sent per rank (measured)        formula per rank\n";
  ctx.say(head.str());
  Buffers buf(s.count, ctx.on_gpu());
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
    const bool modeled =
        name == "native" && comm.stats().modeled[static_cast<std::size_t>(Op::allreduce)];
    std::string measured, predicted;
    for (int q = 0; q < N; ++q) {
      measured += (q ? " " : "") + std::to_string(all_sent[static_cast<std::size_t>(q)]);
      predicted += (q ? " " : "") + std::to_string(formula[static_cast<std::size_t>(q)]);
    }
    char line[400];
    std::snprintf(line, sizeof line, "%-20s %-9s %-37s %s%s", name.c_str(),
                  wrong == 0 ? "yes" : "NO", measured.c_str(), predicted.c_str(),
                  modeled ? "  [modeled: MPI hides its algorithm]" : "");
    ctx.say(line);
    ctx.verify(wrong == 0, name + ": " + std::to_string(wrong) + " wrong elements");
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
// Benchmark, in nccl-tests' format.

constexpr int rounds = 3;

struct Row {
  std::size_t bytes;
  double time_us, algbw, busbw;
  std::uint64_t wrong;
};

void benchmark(Context& ctx, const std::vector<std::string>& algorithms, const Settings& s) {
  Communicator& comm = ctx.comm();
  const int N = ctx.size();
  const double bus_factor = N > 1 ? 2.0 * (N - 1) / N : 1.0;
  std::vector<std::string> names = algorithms;
  names.push_back("memcpy");
  std::map<std::string, std::vector<Row>> rows;
  CsvTable csv({"algorithm", "ranks", "backend", "bytes", "count", "time_us", "algbw_GBps",
                "busbw_GBps", "wrong"});

  std::ostringstream head;
  head << "# ch03_ring_allreduce benchmark: " << N << " ranks, " << comm.backend()
       << " backend, -b " << s.min_bytes << " -e " << s.max_bytes << " -f " << s.factor << " -n "
       << s.iters << " -w " << s.warmup << ", pipelined segments of " << format_number(s.segment_kb)
       << " KiB\n"
       << "# time: per iteration, the best of " << rounds
       << " rounds of -n iterations, algorithms taking turns\n"
       << "# busbw = algbw * 2(N-1)/N = algbw * " << format_number(bus_factor, 4)
       << "; memcpy: each rank copies S bytes "
       << (ctx.on_gpu() ? "device to device on its GPU" : "(the machine's limit)")
       << ", busbw = algbw\n#\n"
       << "#       size         count    type   redop            algorithm     time    algbw    "
          "busbw  #wrong\n"
       << "#        (B)    (elements)                                          (us)   (GB/s)   "
          "(GB/s)";
  ctx.say(head.str());
  for (double b = static_cast<double>(s.min_bytes);
       b <= static_cast<double>(s.max_bytes) * (1 + 1e-9); b *= s.factor) {
    const std::size_t count = std::max<std::size_t>(1, static_cast<std::size_t>(b) / 4);
    const std::size_t bytes = count * 4;
    Buffers buf(count, ctx.on_gpu());
    // Correctness first, on fresh data; then the buffer is zeroed for the timing.
    std::map<std::string, std::uint64_t> wrong;
    for (const std::string& name : names) {
      if (name == "memcpy") continue;
      wrong[name] = static_cast<std::uint64_t>(
          comm.agree(static_cast<std::int64_t>(buf.wrong_after_run(name, comm, s)), ReduceOp::sum));
    }
    buf.zero();
    auto once = [&](const std::string& name) { buf.run(name, comm, s); };
    // Timing: rounds of -n iterations, the algorithms taking turns within each round (so
    // a slow spell of a shared machine hits them alike); each keeps its best round.
    std::map<std::string, double> best;
    for (int round = 0; round < rounds; ++round) {
      for (const std::string& name : names) {
        if (round == 0)
          for (int i = 0; i < s.warmup; ++i) once(name);
        {
          Communicator::Uncounted quiet(comm);
          comm.barrier();
        }
        const Clock::time_point t0 = Clock::now();
        for (int i = 0; i < s.iters; ++i) once(name);
        const double mine = std::chrono::duration<double>(Clock::now() - t0).count() / s.iters;
        const double t =
            comm.agree(mine, ReduceOp::max);  // the slowest rank finishes the collective
        best[name] = round == 0 ? t : std::min(best[name], t);
      }
    }
    for (const std::string& name : names) {
      const double t = best[name];
      const double algbw = static_cast<double>(bytes) / t / 1e9;
      const double busbw = name == "memcpy" ? algbw : algbw * bus_factor;
      rows[name].push_back({bytes, t * 1e6, algbw, busbw, wrong[name]});
      char line[200];
      std::snprintf(line, sizeof line,
                    "%12zu  %12zu   float     sum  %19s  %8.1f  %7.2f  %7.2f  %6llu", bytes, count,
                    name.c_str(), t * 1e6, algbw, busbw,
                    static_cast<unsigned long long>(wrong[name]));
      ctx.say(line);
      csv.add({name, std::to_string(N), std::string(comm.backend()), std::to_string(bytes),
               std::to_string(count), format_number(t * 1e6, 8), format_number(algbw, 8),
               format_number(busbw, 8), std::to_string(wrong[name])});
      ctx.verify(wrong[name] == 0, name + " at " + std::to_string(bytes) +
                                       " bytes: " + std::to_string(wrong[name]) + " wrong values");
    }
  }

  // Closing lines: wrong values, average bus bandwidth, ratios to the peer and the limit.
  std::uint64_t total_wrong = 0;
  std::map<std::string, double> avg;
  for (const auto& [name, list] : rows) {
    double sum = 0;
    for (const Row& r : list) sum += r.busbw, total_wrong += r.wrong;
    avg[name] = sum / static_cast<double>(list.size());
  }
  std::ostringstream tail;
  tail << "# Out of bounds values : " << total_wrong << (total_wrong == 0 ? " OK" : " FAILED")
       << "\n"
       << "# Avg bus bandwidth    :";
  for (const std::string& name : names) tail << " " << name << " " << format_number(avg[name], 4);
  tail << " (GB/s)\n#\n# busbw ratios, averaged over sizes:        vs native    vs memcpy\n";
  for (const std::string& name : names) {
    if (name == "memcpy") continue;
    double vs_native = 0, vs_memcpy = 0;
    const auto& mine = rows[name];
    for (std::size_t i = 0; i < mine.size(); ++i) {
      vs_native += mine[i].busbw / rows["native"][i].busbw;
      vs_memcpy += mine[i].busbw / rows["memcpy"][i].busbw;
    }
    const double n = static_cast<double>(mine.size());
    char line[160];
    std::snprintf(line, sizeof line, "#   %-20s                      %8.3f x   %8.3f x",
                  name.c_str(), vs_native / n, vs_memcpy / n);
    tail << line << "\n";
    ctx.json()["algorithms"][name]["busbw_ratio_vs_native"] = vs_native / n;
    ctx.json()["algorithms"][name]["busbw_ratio_vs_memcpy"] = vs_memcpy / n;
  }
  ctx.say(tail.str());

  for (const auto& [name, list] : rows) {
    auto& j = ctx.json()["algorithms"][name]["benchmark"];
    j = nlohmann::json::array();
    for (const Row& r : list)
      j.push_back({{"bytes", r.bytes},
                   {"time_us", r.time_us},
                   {"algbw_GBps", r.algbw},
                   {"busbw_GBps", r.busbw},
                   {"wrong", r.wrong}});
    ctx.json()["algorithms"][name]["avg_busbw_GBps"] = avg[name];
  }
  ctx.save_csv(csv, "03_ring_allreduce");
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
  cli.add_option("-f,--stepfactor", s.factor, "size multiplier between rows (>= 2)")
      ->check(CLI::Range(1.0, 1024.0))
      ->capture_default_str();
  cli.add_option("-n,--iters", s.iters, "timed iterations per size")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  cli.add_option("-w,--warmup_iters", s.warmup, "untimed iterations first")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  cli.add_option("--segment-kb", s.segment_kb, "pipelined ring: segment size in KiB")
      ->check(CLI::Range(0.004, 1048576.0))
      ->capture_default_str();
  program.validate([&](const Options&) {
    if (b->count() || e->count()) s.benchmark = true;
    require(s.min_bytes <= s.max_bytes, "-b (" + std::to_string(s.min_bytes) +
                                            ") is larger than -e (" + std::to_string(s.max_bytes) +
                                            ")");
    require(s.factor >= 2, "-f must be at least 2 (got " + format_number(s.factor) + ")");
  });

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
