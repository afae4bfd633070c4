// Chapter 03 — ring-AllReduce from scratch, measured like nccl-tests.
//
// CS336 lecture 7 §3.2 names ring-AllReduce the bandwidth-optimal way to synchronise
// gradients ("使用Ring-AllReduce算法（带宽优化）"; so-large-lm ch. 8 §3 leaves it to NCCL).
// Here it is built on send/recv alone (ring_allreduce.hpp), beside the naive algorithm
// (all through rank 0) and recursive doubling (MPI's for short messages). Each is checked
// against the exact sum and its bytes per rank against the formula, then benchmarked as
// nccl-tests does (algbw = S / t, busbw = algbw x 2(N-1)/N) next to the backend's own
// allreduce (threads: shared memory; MPI: MPI_Allreduce) and a copy of S bytes per rank
// (memcpy). Chapter 02's gradient sync takes ch03::ring_allreduce as its allreduce.
//
// Run:
//   build/default/bin/ch03_ring_allreduce --ranks 4      correctness + bytes, every algorithm
//   build/default/bin/ch03_ring_allreduce --ranks 3 --count 10 --algo ring
//   build/default/bin/ch03_ring_allreduce --ranks 4 -b 1M -e 64M -f 2 --csv-dir results
//   mpirun -np 4 build/default/bin/ch03_ring_allreduce -b 1M -e 64M --csv-dir results
//
// Expected: 0 wrong elements everywhere (small integers: every summation order gives the
// exact sum); every rank's bytes equal to the formula's, for the ring 2(N-1)/N x S.
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>

#include "across_hosts.hpp"
#include "buffers.hpp"
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

struct Settings {
  std::string algo = "all";
  std::size_t count = 1000003;  // a prime: no world size divides it
  bool benchmark = false;
  std::size_t min_bytes = 1 << 20, max_bytes = 64 << 20;
  double factor = 2;
  int iters = 20, warmup = 5;
  double segment_kb = 256;
  std::size_t segment = 65536;  // the pipelined ring's segment in floats, from segment_kb
  int ranks_per_node = 0;       // 0: the real hosts
  double link_gbit = 0;         // the link between hosts, Gbit/s each way; 0: not known
};

// ---------------------------------------------------------------------------
// Each algorithm once, distributed: compared with the exact sum (each rank's values and the
// sum they give: buffers.hpp), and the bytes every rank sent next to the formula that
// predicts them: in all, to each peer, and between hosts (across_hosts.hpp).

void correctness(Context& ctx, const std::vector<std::string>& algorithms, const Settings& s,
                 ch03::Hosts& hosts) {
  Communicator& comm = ctx.comm();
  const int N = ctx.size(), r = ctx.rank();
  const double S = 4.0 * static_cast<double>(s.count);
  ch03::Buffers buf{ctx.memory(), s.segment, hosts.hierarchical()};
  buf.resize(static_cast<std::int64_t>(s.count));
  Table table({"algorithm", "rank", "wrong", "bytes_sent", "formula_bytes", "traffic_modeled"});
  ch03::BetweenHosts links(hosts);
  for (const std::string& name : algorithms) {
    ch03::Traffic traffic(comm, hosts);
    const std::int64_t wrong = buf.wrong_after_run(name, comm);
    traffic.stop();
    const CommStats& delta = traffic.stats();
    const auto sent = static_cast<std::int64_t>(delta.total().bytes_sent);
    const std::vector<std::size_t> to_each =
        ch03::formula_bytes_to(name, s.count, r, hosts.placement);
    const auto formula = static_cast<std::int64_t>(
        name == "native" ? ch03::formula_bytes_sent(name, s.count, r, N)
                         : std::accumulate(to_each.begin(), to_each.end(), std::size_t{0}));
    const std::string on = name + " on rank " + std::to_string(r) + ": ";
    ctx.verify(wrong == 0, on + std::to_string(wrong) + " of " + std::to_string(s.count) +
                               " elements differ from the exact sum");
    ctx.verify(sent == formula, on + "sent " + std::to_string(sent) + " bytes, the formula says " +
                                    std::to_string(formula));
    // To whom, and between hosts: each next to its formula.
    links.add(ctx, name, s.count, traffic);
    // Point-to-point bytes are always measured; a library's collective (MPI's, NCCL's)
    // hides its algorithm, so its bytes are the formula's, marked modeled.
    const auto all_wrong = comm.gather_values(wrong), all_sent = comm.gather_values(sent),
               all_formula = comm.gather_values(formula);
    for (std::size_t q = 0; q < all_sent.size(); ++q)
      table.add({name, q, all_wrong[q], all_sent[q], all_formula[q], delta.any_modeled()});
  }
  ctx.report(table, "algorithms",
             "Chapter 03 - allreduce (sum) of " + std::to_string(s.count) + " floats (" +
                 format_number(S, 10) + " bytes) on " + std::to_string(N) + " ranks (" +
                 std::string(comm.backend()) + " backend" +
                 (ctx.on_gpu() ? ", device buffers on GPUs" : "") + ")\n");
  ctx.say("\nring ideal: 2(N-1)/N x S = " + format_number(2.0 * (N - 1) / N * S, 10) +
          " bytes per rank (naive: rank 0 sends (N-1) x S = " + format_number((N - 1) * S, 10) +
          ")");
  links.report(ctx);
}

// ---------------------------------------------------------------------------
// Benchmark, in nccl-tests' format, on the common harness.

void benchmark(Context& ctx, const std::vector<std::string>& algorithms, const Settings& s,
               ch03::Hosts& hosts) {
  ctx.say("");
  Communicator& comm = ctx.comm();
  const double N = ctx.size(), bus_factor = 2 * (N - 1) / N;  // 0 for one rank, as nccl-tests
  if (N == 1) ctx.say("one rank: an allreduce moves no data (NCCL's is a no-op): busbw is 0");
  ch03::Buffers buf{ctx.memory(), s.segment, hosts.hierarchical()};
  auto prepare = [&](std::int64_t count) {
    buf.resize(count);
    buf.data.zero();  // sums of zeros stay zero, however many iterations
  };
  std::vector<bench::Case> cases;
  for (const std::string& name : algorithms)
    cases.push_back(
        {name, prepare, [&, name] { buf.run(name, comm); },
         [&, name] { return static_cast<std::uint64_t>(buf.wrong_after_run(name, comm)); },
         bus_factor});
  // The reference point: each rank copies S bytes (busbw = algbw).
  cases.push_back({"memcpy", prepare, [&] { buf.run("memcpy", comm); }, {}, 1.0});
  bench::Config config;
  config.title = "allreduce (sum) of floats, pipelined segments of " + format_number(s.segment_kb) +
                 " KiB; busbw = algbw x 2(N-1)/N = algbw x " + format_number(bus_factor, 4) +
                 "; memcpy: each rank copies S bytes " +
                 (ctx.on_gpu() ? "device to device on its GPU" : "on the host") +
                 " (busbw = algbw)";
  config.iterations = s.iters, config.warmup = s.warmup;
  if (ctx.on_gpu()) config.synchronize = cuda::synchronize;  // the clock stops when the GPU is done
  config.csv_name = "03_ring_allreduce", config.json_key = "benchmark";
  const std::vector<bench::Row> rows =
      bench::run(ctx, config, cases, bench::sweep(s.min_bytes, s.max_bytes, s.factor, 4));

  // busbw over the peer's (the backend's own allreduce) and the copy's, to 3 decimals.
  auto ratio = [&](const std::string& name, const std::string& to) {
    return std::round(1000 * bench::mean_ratio(rows, name, to)) / 1000;
  };
  if (N == 1) return;  // no bus bandwidth to compare
  Table ratios({"algorithm", "busbw_vs_native", "busbw_vs_memcpy"});
  for (const std::string& name : algorithms)
    ratios.add({name, ratio(name, "native"), ratio(name, "memcpy")});
  ctx.report(ratios, "busbw_ratios", "#\n# busbw ratios, averaged over sizes");
  if (hosts.count() > 1 && s.link_gbit > 0)
    ch03::report_link_bound(ctx, algorithms, s.link_gbit, hosts, rows);
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch03_ring_allreduce",
                  "Chapter 03: ring-AllReduce from scratch, measured like nccl-tests");
  Settings s;
  auto& cli = program.cli();
  cli.add_option("--algo", s.algo,
                 "naive, ring, pipelined, recursive_doubling, hierarchical, native or all")
      ->check(CLI::IsMember(
          {"naive", "ring", "pipelined", "recursive_doubling", "hierarchical", "native", "all"}))
      ->capture_default_str();
  cli.add_option("--count", s.count, "floats in the correctness run")
      ->check(shardlab::cli::whole(0, 1LL << 30))
      ->capture_default_str();
  cli.add_flag("--benchmark", s.benchmark, "benchmark over the sizes -b..-e (implied by -b or -e)");
  auto* b = cli.add_option("-b,--minbytes", s.min_bytes, "smallest message, bytes (64K, 1M, 2^20)")
                ->transform(cli::quantity(cli::Units::binary))
                ->check(shardlab::cli::whole(4, 1LL << 32));
  auto* e = cli.add_option("-e,--maxbytes", s.max_bytes, "largest message, bytes (64M, 1G, 2^26)")
                ->transform(cli::quantity(cli::Units::binary))
                ->check(shardlab::cli::whole(4, 1LL << 32));
  cli.add_option("-f,--stepfactor", s.factor, "size multiplier between rows")
      ->check(cli::between(2.0, 1024.0))
      ->capture_default_str();
  cli.add_option("-n,--iters", s.iters, "timed iterations per size")
      ->check(shardlab::cli::whole(1, 100000))
      ->capture_default_str();
  cli.add_option("-w,--warmup_iters", s.warmup, "untimed iterations first")
      ->check(shardlab::cli::whole(0, 100000))
      ->capture_default_str();
  cli.add_option("--segment-kb", s.segment_kb, "pipelined ring: segment size in KiB")
      ->check(cli::between(0.004, 1048576.0))
      ->capture_default_str();
  cli.add_option("--ranks-per-node", s.ranks_per_node,
                 "hosts simulated on one machine: ranks 0..K-1 on the first, ... (default: the "
                 "hosts the ranks run on)")
      ->check(shardlab::cli::whole(1, 1024));
  cli.add_option("--link-gbit", s.link_gbit,
                 "the link between hosts, Gbit/s each way (scripts/cluster.sh gives it): the "
                 "benchmark compares busbw with what it allows")
      ->check(cli::between(0.001, 1e6));
  auto benchmarking = [&] { return s.benchmark || b->count() > 0 || e->count() > 0; };
  // The largest buffer of the run: the correctness count, or the benchmark's largest size.
  auto largest_bytes = [&] {
    return std::max(4.0 * static_cast<double>(s.count),
                    benchmarking() ? static_cast<double>(s.max_bytes) : 0.0);
  };
  program.validate([&](const Options& o) {
    s.benchmark = benchmarking();
    s.segment = std::max<std::size_t>(1, static_cast<std::size_t>(s.segment_kb * 1024 / 4));
    require_usage(
        s.min_bytes <= s.max_bytes,
        "-b " + std::to_string(s.min_bytes) + " is larger than -e " + std::to_string(s.max_bytes));
    // On device buffers only the backend's allreduce and a device memcpy run.
    require_usage(o.device != "cuda" || s.algo == "all" || s.algo == "native",
                  "--device cuda: only --algo native runs on device buffers (the from-scratch "
                  "algorithms add on the host)");
  });
  // The pipelined ring's segments: at most 16384 per chunk of the largest buffer.
  program.world_size([&](const Options&, int ranks) {
    require_usage(s.ranks_per_node == 0 || ranks % s.ranks_per_node == 0,
                  "--ranks-per-node " + std::to_string(s.ranks_per_node) + " does not divide " +
                      std::to_string(ranks) + " ranks");
    if (s.algo != "pipelined" && s.algo != "all") return;
    const std::string why = ch03::too_many_segments(largest_bytes(), ranks, s.segment_kb);
    require_usage(why.empty(), why);
  });
  // Memory: every rank holds the data, memcpy's copy and scratch as large as the data (the
  // naive algorithm's rank 0), and a half more for the program and the backend's buffers
  // (3.4x the data per rank measured at 200 MiB); a threads job's ranks share the machine.
  program.memory_estimate([&](const Options& o) {
    return 3.5 * largest_bytes() * (o.backend == "threads" || o.backend == "auto" ? o.ranks : 1);
  });
  program.writes_csv(benchmarking);
  program.supports_cuda();
  return program.run(argc, argv, [&](Context& ctx) {
    std::vector<std::string> algorithms(std::begin(ch03::algorithms), std::end(ch03::algorithms));
    if (s.algo != "all" || ctx.on_gpu()) algorithms = {ctx.on_gpu() ? "native" : s.algo};
    // The benchmark compares against the native allreduce, so it always runs it.
    if (s.benchmark && std::ranges::find(algorithms, "native") == algorithms.end())
      algorithms.push_back("native");
    ctx.json()["chapter"] = "03_ring_allreduce";
    ctx.json()["count"] = s.count;
    ch03::Hosts hosts = ch03::find_hosts(ctx.comm(), s.ranks_per_node);
    ch03::prepare_hierarchical(ctx, hosts, algorithms, s.algo == "hierarchical");
    correctness(ctx, algorithms, s, hosts);
    if (s.benchmark) benchmark(ctx, algorithms, s, hosts);
  });
}
