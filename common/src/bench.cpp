// bench: the timing loop, and each row written once (see bench.hpp).
#include "shardlab/bench.hpp"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "shardlab/check.hpp"
#include "shardlab/cuda.hpp"
#include "shardlab/results.hpp"
#include "shardlab/tensor.hpp"
#include "shardlab/timer.hpp"

namespace shardlab::bench {

namespace {

std::string header(const Context& ctx, const Config& c) {
  std::ostringstream os;
  os << "# " << c.title << "\n# " << ctx.size() << " rank(s), " << ctx.options().backend
     << " backend; time per iteration: best of " << c.rounds << " rounds of " << c.iterations
     << " iterations (after " << c.warmup << " warm-up), cases taking turns\n";
  if (c.measure == Measure::bandwidth)
    os << "#\n#        size         count    type   redop  case                    time     algbw"
          "     busbw  #wrong\n"
          "#         (B)    (elements)                                          (us)    (GB/s)"
          "    (GB/s)";
  else
    os << "#\n#   size  case                      time (us)    TFLOP/s   peak TFLOP/s  fraction"
          "  #wrong";
  return os.str();
}

std::string line(const Config& c, const Row& r) {
  char buf[256];
  if (c.measure == Measure::bandwidth)
    std::snprintf(buf, sizeof buf, "%13llu  %12lld  %6s  %6s  %-20s %9.1f  %8.2f  %8.2f  %6llu",
                  static_cast<unsigned long long>(r.bytes), static_cast<long long>(r.count),
                  c.type.c_str(), c.redop.c_str(), r.name.c_str(), r.time_us, r.algbw_GBps,
                  r.busbw_GBps, static_cast<unsigned long long>(r.wrong));
  else
    std::snprintf(buf, sizeof buf, "  %6lld  %-22s %11.1f  %9.3f  %13s  %8s  %6llu",
                  static_cast<long long>(r.count), r.name.c_str(), r.time_us, r.tflops,
                  c.peak_tflops > 0 ? format_number(c.peak_tflops, 4).c_str() : "unknown",
                  c.peak_tflops > 0 ? format_number(r.fraction, 3).c_str() : "-",
                  static_cast<unsigned long long>(r.wrong));
  return buf;
}

/// The rows as one Table: the CSV the notebooks read and the JSON, from the same cells.
/// Every row says what it ran on and how it was timed, so a plot can say it too.
Table table_of(const Context& ctx, const Config& c, const std::vector<Row>& rows) {
  const bool bw = c.measure == Measure::bandwidth;
  const std::string machine = machine_description();
  const std::string timing = std::to_string(c.rounds) + "x" + std::to_string(c.iterations);
  const std::string& backend = ctx.options().backend;
  Table t(bw ? std::vector<std::string>{"algorithm", "ranks", "backend", "bytes", "count",
                                        "time_us", "algbw_GBps", "busbw_GBps", "wrong", "machine",
                                        "rounds_x_iterations"}
             : std::vector<std::string>{"case", "ranks", "backend", "size", "time_us", "tflops",
                                        "peak_tflops", "fraction_of_peak", "wrong", "machine",
                                        "rounds_x_iterations"});
  for (const Row& r : rows) {
    if (bw)
      t.add({r.name, ctx.size(), backend, r.bytes, r.count, r.time_us, r.algbw_GBps, r.busbw_GBps,
             r.wrong, machine, timing});
    else
      t.add({r.name, ctx.size(), backend, r.count, r.time_us, r.tflops, c.peak_tflops, r.fraction,
             r.wrong, machine, timing});
  }
  return t;
}
}  // namespace

std::vector<std::int64_t> sweep(std::uint64_t min_bytes, std::uint64_t max_bytes, double factor,
                                std::size_t element_bytes) {
  require(factor > 1 && min_bytes >= 1 && min_bytes <= max_bytes,
          "bench::sweep: needs 1 <= min <= max and a factor above 1");
  std::vector<std::int64_t> counts;
  for (double b = static_cast<double>(min_bytes); b <= static_cast<double>(max_bytes) * (1 + 1e-9);
       b *= factor)
    counts.push_back(std::max<std::int64_t>(
        1, static_cast<std::int64_t>(b) / static_cast<std::int64_t>(element_bytes)));
  return counts;
}

std::vector<Row> run(Context& ctx, const Config& c, const std::vector<Case>& cases,
                     const std::vector<std::int64_t>& sizes) {
  Communicator& comm = ctx.comm();
  require(c.rounds >= 1 && c.iterations >= 1 && c.warmup >= 0,
          "bench: needs at least one round of one iteration");
  ctx.say(header(ctx, c));
  std::vector<Row> rows;
  for (std::int64_t size : sizes) {
    // Correctness first, on fresh data.
    std::vector<std::uint64_t> wrong(cases.size(), 0);
    for (std::size_t k = 0; k < cases.size(); ++k) {
      cases[k].prepare(size);
      if (cases[k].wrong)
        wrong[k] = static_cast<std::uint64_t>(
            comm.agree(static_cast<std::int64_t>(cases[k].wrong()), ReduceOp::sum));
    }
    // Timing: the cases take turns within each round; each keeps its best round.
    std::vector<double> best(cases.size(), 0.0);
    for (int round = 0; round < c.rounds; ++round) {
      for (std::size_t k = 0; k < cases.size(); ++k) {
        const Case& cs = cases[k];
        if (cases.size() > 1 || round == 0) cs.prepare(size);
        if (round == 0) {
          Communicator::Unchecked fast(comm);
          for (int i = 0; i < c.warmup; ++i) cs.run();
        }
        if (c.synchronize) c.synchronize();
        {
          Communicator::Uncounted not_counted(comm);
          comm.barrier();
        }
        std::optional<cuda::EventTimer> gpu_clock;
        if (c.device_clock) gpu_clock.emplace().start();
        const Stopwatch watch;
        {
          Communicator::Unchecked fast(comm);  // checked already, in the correctness run
          for (int i = 0; i < c.iterations; ++i) cs.run();
        }
        const double elapsed = gpu_clock ? gpu_clock->stop() : 0.0;
        if (c.synchronize) c.synchronize();
        const double mine = (gpu_clock ? elapsed : watch.seconds()) / c.iterations;
        const double t = comm.agree(mine, ReduceOp::max);  // the slowest rank ends it
        best[k] = round == 0 ? t : std::min(best[k], t);
      }
    }
    for (std::size_t k = 0; k < cases.size(); ++k) {
      Row r;
      r.name = cases[k].name;
      r.count = size;
      r.bytes = static_cast<std::uint64_t>(size) * c.element_bytes;
      r.time_us = best[k] * 1e6;
      r.wrong = wrong[k];
      if (c.measure == Measure::bandwidth) {
        r.algbw_GBps = static_cast<double>(r.bytes) / best[k] / 1e9;
        r.busbw_GBps = r.algbw_GBps * cases[k].bus_factor;
      } else {
        r.tflops = c.flops ? c.flops(size) / best[k] / 1e12 : 0;
        r.fraction = c.peak_tflops > 0 ? r.tflops / c.peak_tflops : 0;
      }
      ctx.say(line(c, r));
      ctx.verify(r.wrong == 0, r.name + " at size " + std::to_string(size) + ": " +
                                   std::to_string(r.wrong) + " wrong elements");
      rows.push_back(r);
    }
  }

  // Closing lines, as nccl-tests ends: wrong values, then the averages.
  std::uint64_t total_wrong = 0;
  for (const Row& r : rows) total_wrong += r.wrong;
  std::ostringstream tail;
  tail << "# Out of bounds values : " << total_wrong << (total_wrong == 0 ? " OK" : " FAILED");
  tail << (c.measure == Measure::bandwidth ? "\n# Avg bus bandwidth    :"
                                           : "\n# Avg TFLOP/s          :");
  for (const Case& cs : cases)
    tail << " " << cs.name << " " << format_number(mean(rows, cs.name), 4);
  tail << (c.measure == Measure::bandwidth ? " (GB/s)" : "");
  ctx.say(tail.str());

  if (!c.csv_name.empty() || !c.json_key.empty()) {
    const Table table = table_of(ctx, c, rows);
    if (!c.csv_name.empty()) ctx.save_csv(table, c.csv_name);
    if (!c.json_key.empty()) ctx.json()[c.json_key] = table.json();
  }
  return rows;
}

std::vector<Row> rows_of(const std::vector<Row>& rows, const std::string& name) {
  std::vector<Row> out;
  for (const Row& r : rows)
    if (r.name == name) out.push_back(r);
  return out;
}

double mean(const std::vector<Row>& rows, const std::string& name) {
  const std::vector<Row> mine = rows_of(rows, name);
  double sum = 0;
  for (const Row& r : mine) sum += r.busbw_GBps > 0 ? r.busbw_GBps : r.tflops;
  return mine.empty() ? 0 : sum / static_cast<double>(mine.size());
}

double mean_ratio(const std::vector<Row>& rows, const std::string& a, const std::string& b) {
  const std::vector<Row> x = rows_of(rows, a), y = rows_of(rows, b);
  if (x.empty() || x.size() != y.size()) return 0;
  double sum = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const bool bw = x[i].busbw_GBps > 0 || y[i].busbw_GBps > 0;
    sum += bw ? x[i].busbw_GBps / y[i].busbw_GBps : x[i].tflops / y[i].tflops;
  }
  return sum / static_cast<double>(x.size());
}

const HostCpu& host_cpu() {
  static const HostCpu cpu = [] {
    HostCpu c;
    std::string flags, vendor;
    double mhz = 0;
    int family = 0;
    std::ifstream info("/proc/cpuinfo");
    for (std::string line; std::getline(info, line);) {
      const auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      const std::string value = line.substr(std::min(line.size(), colon + 2));
      if (line.rfind("model name", 0) == 0 && c.name.empty()) c.name = value;
      if (line.rfind("flags", 0) == 0 && flags.empty()) flags = " " + value + " ";
      if (line.rfind("cpu MHz", 0) == 0) mhz = std::max(mhz, std::atof(value.c_str()));
      if (line.rfind("vendor_id", 0) == 0) vendor = value;
      if (line.rfind("cpu family", 0) == 0) family = std::atoi(value.c_str());
    }
    double khz = 0;
    std::ifstream max("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq");
    c.clock_ghz = max >> khz && khz > 0 ? khz / 1e6 : mhz / 1e3;
    auto has = [&](const char* flag) {
      return flags.find(std::string(" ") + flag + " ") != std::string::npos;
    };
    c.fp32_lanes = has("avx512f") ? 16 : has("avx2") && has("fma") ? 8 : 4;
    // AMD's Zen 4 (family 25 with AVX-512) runs a 512-bit FMA as two halves on its two
    // 256-bit units: one 16-lane FMA a cycle.
    if (vendor == "AuthenticAMD" && family == 25 && c.fp32_lanes == 16) c.fma_units = 1;
    cpu_set_t set;
    c.cores = sched_getaffinity(0, sizeof set, &set) == 0
                  ? std::max(1, CPU_COUNT(&set))
                  : int(std::max(1u, std::thread::hardware_concurrency()));
    if (c.name.empty()) c.name = "unknown CPU";
    return c;
  }();
  return cpu;
}

double host_gemm_peak_gflops() {
  static const double peak = [] {
    const std::int64_t n = 512;
    const Tensor a = randn(n, n, 1), b = randn(n, n, 2);
    Tensor out = empty(Shape{n, n});
    matmul_into(out, a, b);  // warm: the packing buffers, the caches
    double best = 1e30;
    for (int run = 0; run < 8; ++run) {
      Stopwatch watch;
      matmul_into(out, a, b);
      best = std::min(best, watch.seconds());
    }
    return 2.0 * double(n) * double(n) * double(n) / best * 1e-9;
  }();
  return peak;
}

}  // namespace shardlab::bench
