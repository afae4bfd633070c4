// bench: one benchmark harness, measuring the way nccl-tests does.
//
// A chapter describes what to time — one Case per algorithm: how to prepare a size, how
// to run one iteration, how to count wrong elements — and the harness times it: for every
// size, correctness first on fresh data (#wrong, summed over ranks), then `rounds` rounds
// of `iterations` timed iterations after `warmup` untimed ones, the cases taking turns
// within a round (a slow spell of a shared machine hits them all alike), each case keeping
// its best round. A round's time is the slowest rank's (the collective is over when the
// last rank is done). One Row per case and size, written once: a line of nccl-tests'
// table as soon as the size is timed, and at the end one Table of all the rows, which is
// the CSV (for the notebooks) and the JSON (for scripts), with the same columns:
//
//   bandwidth   algorithm ranks backend bytes count time_us algbw_GBps busbw_GBps wrong
//               machine rounds_x_iterations
//   throughput  case ranks backend size time_us tflops peak_tflops fraction_of_peak wrong
//               machine rounds_x_iterations
//
//   bandwidth   algbw = S / t, busbw = algbw x the case's bus factor (nccl-tests'
//               PERFORMANCE.md: 2(N-1)/N for allreduce, (N-1)/N for allgather,
//               reduce-scatter and alltoall, 1 for a copy)
//   throughput  TFLOP/s = flops(size) / t, and its fraction of a peak
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shardlab/launch.hpp"

namespace shardlab::bench {

/// One operation to time, as nccl-tests describes a collective.
struct Case {
  std::string name;  ///< The row label in the table, and what rows_of and mean look it up by.
  /// Before a size is timed: allocate and fill what `run` needs for `count` elements (or
  /// an n x n x n problem, for throughput).
  std::function<void(std::int64_t count)> prepare;
  /// One iteration.
  std::function<void()> run;
  /// Optional: run once on fresh data and return the number of wrong elements on this rank.
  std::function<std::uint64_t()> wrong;
  /// bandwidth: busbw = algbw x this.
  double bus_factor = 1.0;
};

/// What a benchmark reports.
enum class Measure {
  bandwidth,  ///< Communication: algbw and busbw in GB/s; a size is a count of elements.
  throughput  ///< Computation: TFLOP/s and their fraction of a peak; a size is n (n x n x n).
};

/// How to time a set of cases, and where the results go.
struct Config {
  std::string title;                               ///< The table's first line.
  Measure measure = Measure::bandwidth;            ///< Which columns the rows have.
  std::string type = "float";                      ///< The table's type column (bandwidth).
  std::string redop = "sum";                       ///< The table's redop column (bandwidth).
  std::size_t element_bytes = 4;                   ///< S = count x this (bandwidth).
  std::function<double(std::int64_t size)> flops;  ///< Throughput: flops of one iteration.
  double peak_tflops = 0;                          ///< Throughput: 0 when not known.

  int iterations = 20;  ///< Timed iterations in a round (at least 1).
  int warmup = 5;       ///< Untimed iterations before a case's first round (0 or more).
  int rounds = 3;       ///< Rounds per case and size (at least 1); a case keeps its best.
  /// Called after the timed iterations on every rank (a GPU's stream: the work must be
  /// done before the clock stops).
  std::function<void()> synchronize;
  /// Time the iterations with CUDA events on each rank's stream (cuda::EventTimer): the
  /// GPU's own time for the work, for a computation (not a collective, whose time includes
  /// waiting for the other ranks).
  bool device_clock = false;
  std::string csv_name;  ///< CSV_DIR/csv_name.csv; empty: no CSV.
  std::string json_key;  ///< ctx.json()[json_key] gets the rows (the CSV's columns); empty: none.
};

/// One case at one size: a line of the table, and a row of the CSV and the JSON.
struct Row {
  std::string name;         ///< The case's name.
  std::int64_t count = 0;   ///< The size: elements (bandwidth), or n (throughput).
  std::uint64_t bytes = 0;  ///< S = count x Config::element_bytes.
  double time_us = 0;       ///< One iteration, in microseconds: the best round's, slowest rank's.
  double algbw_GBps = 0;    ///< Bandwidth: S / time, in GB/s.
  double busbw_GBps = 0;    ///< Bandwidth: algbw x the case's bus factor, in GB/s.
  double tflops = 0;        ///< Throughput: flops(size) / time, in TFLOP/s (0 without flops).
  double fraction = 0;      ///< Throughput: tflops / peak_tflops (0 when the peak is not known).
  std::uint64_t wrong = 0;  ///< Wrong elements, summed over ranks (0 without a check).
};

/// Times every case at every size (see the top), prints the table, saves the CSV and the
/// JSON (the same Table), verifies that nothing was wrong (ctx.verify), and returns the
/// rows, by size then case.
std::vector<Row> run(Context& ctx, const Config& config, const std::vector<Case>& cases,
                     const std::vector<std::int64_t>& sizes);

/// nccl-tests' -b/-e/-f sweep as element counts: min_bytes, x factor, ... up to max_bytes.
std::vector<std::int64_t> sweep(std::uint64_t min_bytes, std::uint64_t max_bytes, double factor,
                                std::size_t element_bytes);

/// The rows of one case, in size order.
std::vector<Row> rows_of(const std::vector<Row>& rows, const std::string& name);

/// Mean over sizes of `name`'s busbw (bandwidth), or of its TFLOP/s; 0 without rows.
double mean(const std::vector<Row>& rows, const std::string& name);

/// Mean over sizes of `a`'s busbw divided by `b`'s (bandwidth), or of their TFLOP/s.
double mean_ratio(const std::vector<Row>& rows, const std::string& a, const std::string& b);

/// The processor this runs on, as Linux describes it (/proc/cpuinfo, cpufreq): what the
/// theoretical peak that PaLM's MFU divides by is made of.
struct HostCpu {
  std::string name;      ///< "model name"
  int cores = 1;         ///< the cores this process may run on (its affinity)
  double clock_ghz = 0;  ///< the highest clock reported: cpufreq's maximum, else "cpu MHz"
  int fp32_lanes = 4;    ///< float lanes of the widest FMA: AVX-512 16, AVX2 with FMA 8, else 4
  /// FMA units of that width a core: not in /proc/cpuinfo; 2 on current x86 cores, 1 on
  /// AMD's Zen 4 at 512 bits (two 256-bit units)
  int fma_units = 2;
  /// clock x lanes x FMA units x 2 (an FMA is two FLOPs), GFLOP/s of one core.
  double peak_gflops_per_core() const { return clock_ghz * fp32_lanes * fma_units * 2; }
};
/// This machine's HostCpu (read once).
const HostCpu& host_cpu();

/// One core's measured FP32 peak, GFLOP/s: the host matmul (its fastest kernel) on
/// 512 x 512 x 512, the best of eight runs: what MFU divides by on a CPU, whose clock under
/// turbo and sharing no table gives. Measured once per process (about 30 ms).
double host_gemm_peak_gflops();

}  // namespace shardlab::bench
