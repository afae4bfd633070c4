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
#include <optional>

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
// The reference: rank q holds (q + 1)(i mod 13 + 1) at element i. Small integers, so
// every summation order gives the exact sum, N(N+1)/2 (i mod 13 + 1), on every rank.

void fill(std::span<float> data, int rank) {
  for (std::size_t i = 0; i < data.size(); ++i)
    data[i] = static_cast<float>((rank + 1) * static_cast<int>(i % 13 + 1));
}
float expected(std::size_t i, int ranks) {
  return static_cast<float>(ranks * (ranks + 1) / 2 * static_cast<int>(i % 13 + 1));
}

/// One rank's buffers: host memory, or under --device cuda this rank's GPU (there only
/// the native allreduce and memcpy run: the from-scratch algorithms add on the host).
struct Buffers {
  Memory memory;
  std::size_t segment;
  ch03::HostGroups* groups;     // for the hierarchical allreduce
  Tensor data = {}, copy = {};  // copy: where memcpy writes
  ch03::Workspace scratch = {};

  void resize(std::int64_t count) {
    if (data.size() == count && data.memory() == memory) return;
    data = empty(Shape{count}, DType::f32, memory);
    copy = empty(Shape{count}, DType::f32, memory);
  }
  void run(const std::string& name, Communicator& comm) {
    if (name == "memcpy")
      copy.copy_from(data);
    else
      ch03::allreduce(name, comm, data, segment, scratch, groups);
  }
  /// Runs `name` once on fresh data; returns the number of wrong elements on this rank.
  std::int64_t wrong_after_run(const std::string& name, Communicator& comm) {
    Tensor host = memory == Memory::host ? data : Tensor(data.size());  // data itself on the host
    fill(host.span(), comm.rank());
    data.copy_from(host);  // nothing to copy on the host
    run(name, comm);
    host.copy_from(data);
    std::int64_t wrong = 0;
    for (std::int64_t i = 0; i < host.size(); ++i)
      wrong += host[i] != expected(static_cast<std::size_t>(i), comm.size());
    return wrong;
  }
};

// ---------------------------------------------------------------------------
// Where the ranks sit: one host (threads, or mpirun on one machine), the hosts of a
// cluster (each process's host name), or hosts simulated by --ranks-per-node.

template <class T>
T sum_of(const std::vector<T>& v) {
  return std::accumulate(v.begin(), v.end(), T{0});
}

/// "2 hosts: ranks 0 1 | 2 3".
std::string describe(const ch03::Placement& p) {
  std::string text = std::to_string(p.hosts()) + " hosts: ranks";
  for (int h = 0; h < p.hosts(); ++h) {
    if (h > 0) text += " |";
    for (int q : p.ranks_on(h)) text += " " + std::to_string(q);
  }
  return text;
}

struct Hosts {
  ch03::Placement placement;
  bool real = false;  // hosts with network interfaces of their own (wire bytes can be read)
  std::optional<ch03::HostGroups> groups;
  int count() const { return placement.hosts(); }
};

Hosts find_hosts(Communicator& comm, const Settings& s) {
  Hosts h;
  if (s.ranks_per_node > 0) {
    h.placement = ch03::blocks(comm.size(), s.ranks_per_node);
  } else {
    h.placement = ch03::placement_of(host_names(comm));
    h.real = h.placement.hosts() > 1;
  }
  return h;
}

/// The bytes each rank sends to each other rank, counted message by message on the
/// communicator and on the hierarchical algorithm's groups (their ranks mapped back).
class PeerBytes {
 public:
  PeerBytes(Communicator& comm, Hosts& hosts) : comm_(comm), hosts_(hosts) {
    to_.assign(static_cast<std::size_t>(comm.size()), 0);
    watch(comm, {});
    if (hosts.groups) {
      watch(*hosts.groups->local, hosts.groups->local_ranks);
      watch(*hosts.groups->across, hosts.groups->across_ranks);
    }
  }
  ~PeerBytes() {
    comm_.trace_messages({});
    if (hosts_.groups) {
      hosts_.groups->local->trace_messages({});
      hosts_.groups->across->trace_messages({});
    }
  }
  PeerBytes(const PeerBytes&) = delete;
  PeerBytes& operator=(const PeerBytes&) = delete;
  const std::vector<std::size_t>& to() const { return to_; }

 private:
  void watch(Communicator& c, std::vector<int> members) {
    c.trace_messages([this, members](const MessageEvent& e) {
      if (e.op != Op::send) return;
      const int peer = members.empty() ? e.peer : members[static_cast<std::size_t>(e.peer)];
      to_[static_cast<std::size_t>(peer)] += e.bytes;
    });
  }
  Communicator& comm_;
  Hosts& hosts_;
  std::vector<std::size_t> to_;
};

/// Bytes sent on this host's network interfaces (scripts/cluster.sh's hosts), read by every
/// rank once the others have stopped sending (a barrier, uncounted).
std::uint64_t wire_now(Communicator& comm) {
  Communicator::Uncounted quiet(comm);
  comm.barrier();
  return network_bytes_sent();
}

// ---------------------------------------------------------------------------
// Each algorithm once, distributed: compared with the exact sum, and the bytes every rank
// sent next to the formula that predicts them: in all, to each peer, and between hosts.

void correctness(Context& ctx, const std::vector<std::string>& algorithms, const Settings& s,
                 Hosts& hosts) {
  Communicator& comm = ctx.comm();
  const int N = ctx.size(), r = ctx.rank();
  const double S = 4.0 * static_cast<double>(s.count);
  Buffers buf{ctx.memory(), s.segment, hosts.groups ? &*hosts.groups : nullptr};
  buf.resize(static_cast<std::int64_t>(s.count));
  Table table({"algorithm", "rank", "wrong", "bytes_sent", "formula_bytes", "traffic_modeled"});
  Table links({"algorithm", "between_hosts", "formula", "on_the_wire", "wire_over_counted"});
  auto stats = [&] {
    CommStats all = comm.stats();
    if (hosts.groups) all += hosts.groups->local->stats(), all += hosts.groups->across->stats();
    return all;
  };
  const int my_host = hosts.placement.host[static_cast<std::size_t>(r)];
  for (const std::string& name : algorithms) {
    const std::uint64_t wire_before = wire_now(comm);
    const CommStats before = stats();
    std::int64_t wrong = 0;
    std::vector<std::size_t> to;
    {
      PeerBytes peers(comm, hosts);
      wrong = buf.wrong_after_run(name, comm);
      to = peers.to();
    }
    const CommStats delta = stats().since(before);
    const std::uint64_t wire = wire_now(comm) - wire_before;
    const auto sent = static_cast<std::int64_t>(delta.total().bytes_sent);
    const auto formula = static_cast<std::int64_t>(
        name == "native" ? ch03::formula_bytes_sent(name, s.count, r, N)
                         : sum_of(ch03::formula_bytes_to(name, s.count, r, hosts.placement)));
    const std::string on = name + " on rank " + std::to_string(r) + ": ";
    ctx.verify(wrong == 0, on + std::to_string(wrong) + " of " + std::to_string(s.count) +
                               " elements differ from the exact sum");
    ctx.verify(sent == formula, on + "sent " + std::to_string(sent) + " bytes, the formula says " +
                                    std::to_string(formula));
    // To whom: every message of the from-scratch algorithms, peer by peer.
    std::int64_t off_host = 0;
    if (name != "native") {
      const std::vector<std::size_t> want =
          ch03::formula_bytes_to(name, s.count, r, hosts.placement);
      for (int q = 0; q < N; ++q) {
        const auto i = static_cast<std::size_t>(q);
        ctx.verify(to[i] == want[i], on + "sent " + std::to_string(to[i]) + " bytes to rank " +
                                         std::to_string(q) + ", the formula says " +
                                         std::to_string(want[i]));
        if (hosts.placement.host[i] != my_host) off_host += static_cast<std::int64_t>(to[i]);
      }
    }
    // Point-to-point bytes are always measured; a library's collective (MPI's, NCCL's)
    // hides its algorithm, so its bytes are the formula's, marked modeled.
    const auto all_wrong = comm.gather_values(wrong), all_sent = comm.gather_values(sent),
               all_formula = comm.gather_values(formula), all_off = comm.gather_values(off_host);
    // The wire: one reading per host (its ranks share the interfaces), from its first rank.
    const auto all_wire = comm.gather_values(static_cast<std::int64_t>(wire));
    for (std::size_t q = 0; q < all_sent.size(); ++q)
      table.add({name, q, all_wrong[q], all_sent[q], all_formula[q], delta.any_modeled()});
    if (hosts.count() > 1) {
      std::int64_t on_wire = 0;
      for (int h = 0; h < hosts.count(); ++h)
        on_wire += all_wire[static_cast<std::size_t>(hosts.placement.ranks_on(h)[0])];
      const std::vector<std::size_t> from =
          ch03::formula_link_bytes(name, s.count, hosts.placement);
      const std::int64_t counted = sum_of(all_off);
      auto cell = [&](std::int64_t v, bool known) {
        return known ? Cell(v) : Cell(std::string("-"));
      };
      links.add({name, cell(counted, name != "native"),
                 cell(static_cast<std::int64_t>(sum_of(from)), name != "native"),
                 cell(on_wire, hosts.real),
                 hosts.real && name != "native" && counted > 0
                     ? Cell(static_cast<double>(on_wire) / static_cast<double>(counted))
                     : Cell(std::string("-"))});
      if (name != "native")
        ctx.verify(counted == static_cast<std::int64_t>(sum_of(from)),
                   name + ": " + std::to_string(counted) +
                       " bytes crossed between hosts, the "
                       "formula says " +
                       std::to_string(sum_of(from)));
    }
  }
  ctx.report(table, "algorithms",
             "Chapter 03 - allreduce (sum) of " + std::to_string(s.count) + " floats (" +
                 format_number(S, 10) + " bytes) on " + std::to_string(N) + " ranks (" +
                 std::string(comm.backend()) + " backend" +
                 (ctx.on_gpu() ? ", device buffers on GPUs" : "") + ")\n");
  ctx.say("\nring ideal: 2(N-1)/N x S = " + format_number(2.0 * (N - 1) / N * S, 10) +
          " bytes per rank (naive: rank 0 sends (N-1) x S = " + format_number((N - 1) * S, 10) +
          ")");
  if (hosts.count() > 1)
    ctx.report(links, "between_hosts",
               "\nbytes between hosts (" + describe(hosts.placement) +
                   (hosts.real ? "" : ", simulated: --ranks-per-node") +
                   "): counted message by message, the formula, and " +
                   (hosts.real ? "what the hosts' network interfaces sent (headers and "
                                 "acknowledgements included; MPI's own allreduce only here)"
                               : "no wire to read (one machine)"));
}

// ---------------------------------------------------------------------------
// Benchmark, in nccl-tests' format, on the common harness.

/// Between hosts, the link is the bottleneck: an algorithm that sends B bytes out of its
/// busiest host needs at least B / (the link's bytes per second), so its busbw is at most
/// 2(N-1)/N S over that. At the largest size, what each algorithm reached of its bound.
void link_bound(Context& ctx, const std::vector<std::string>& algorithms, const Settings& s,
                const Hosts& hosts, const std::vector<bench::Row>& rows) {
  const double N = ctx.size(), link = s.link_gbit * 1e9 / 8;  // bytes per second, each way
  Table t({"algorithm", "busbw_GBps", "busiest_host_sends_S", "busbw_bound_GBps", "of_bound"});
  for (const std::string& name : algorithms) {
    const std::vector<bench::Row> mine = bench::rows_of(rows, name);
    if (mine.empty() || name == "native") continue;
    const bench::Row& last = mine.back();
    const std::vector<std::size_t> from =
        ch03::formula_link_bytes(name, static_cast<std::size_t>(last.count), hosts.placement);
    const double busiest = static_cast<double>(*std::max_element(from.begin(), from.end()));
    const double S = static_cast<double>(last.bytes);
    const double bound = busiest > 0 ? 2 * (N - 1) / N * S / (busiest / link) / 1e9 : 0;
    t.add({name, last.busbw_GBps, busiest / S, bound, bound > 0 ? last.busbw_GBps / bound : 0});
  }
  ctx.report(t, "link_bound",
             "#\n# against the link (" + format_number(s.link_gbit) +
                 " Gbit/s each way = " + format_number(link / 1e9, 4) + " GB/s) at " +
                 format_number(static_cast<double>(rows.back().bytes), 10) +
                 " bytes: the busiest host sends busiest_host_sends_S x S to the others, "
                 "so busbw <= 2(N-1)/N S / (that / the link)");
}

void benchmark(Context& ctx, const std::vector<std::string>& algorithms, const Settings& s,
               Hosts& hosts) {
  ctx.say("");
  Communicator& comm = ctx.comm();
  const double N = ctx.size(), bus_factor = 2 * (N - 1) / N;  // 0 for one rank, as nccl-tests
  if (N == 1) ctx.say("one rank: an allreduce moves no data (NCCL's is a no-op): busbw is 0");
  Buffers buf{ctx.memory(), s.segment, hosts.groups ? &*hosts.groups : nullptr};
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
  if (hosts.count() > 1 && s.link_gbit > 0) link_bound(ctx, algorithms, s, hosts, rows);
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
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 30))
      ->capture_default_str();
  cli.add_flag("--benchmark", s.benchmark, "benchmark over the sizes -b..-e (implied by -b or -e)");
  auto* b = cli.add_option("-b,--minbytes", s.min_bytes, "smallest message, bytes (64K, 1M, 2^20)")
                ->transform(cli::quantity(cli::Units::binary))
                ->check(CLI::Range(std::size_t{4}, std::size_t{1} << 32));
  auto* e = cli.add_option("-e,--maxbytes", s.max_bytes, "largest message, bytes (64M, 1G, 2^26)")
                ->transform(cli::quantity(cli::Units::binary))
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
  cli.add_option("--ranks-per-node", s.ranks_per_node,
                 "hosts simulated on one machine: ranks 0..K-1 on the first, ... (default: the "
                 "hosts the ranks run on)")
      ->check(CLI::Range(1, 1024));
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
    Hosts hosts = find_hosts(ctx.comm(), s);
    // The hierarchical allreduce needs as many ranks on every host: left out of "all"
    // where they differ, an error where it was asked for.
    if (std::ranges::find(algorithms, "hierarchical") != algorithms.end()) {
      const std::string uneven = hosts.placement.uneven();
      if (uneven.empty())
        hosts.groups = ch03::group_by_host(ctx.comm(), hosts.placement);
      else if (s.algo == "hierarchical")
        throw UsageError(uneven + " (" + describe(hosts.placement) + ")");
      else
        std::erase(algorithms, "hierarchical"), ctx.say(uneven + ": left out\n");
    }
    correctness(ctx, algorithms, s, hosts);
    if (s.benchmark) benchmark(ctx, algorithms, s, hosts);
  });
}
