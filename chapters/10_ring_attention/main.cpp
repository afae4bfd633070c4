// Chapter 10 — long context: causal attention over a sequence split into cp chunks, the
// keys and values passed around a ring of ranks (ring_attention.hpp).
//
// Beyond the course's three axes (so-large-lm's chapter 8 and CS336 lecture 7 cut the
// batch, the weights and the layers; chapter 09 adds sequence parallelism, which Llama-1
// used): Liu et al. 2023's ring attention, Megatron-LM's `--context-parallel-size`.
// Attention is the one layer that mixes tokens, so cutting the sequence means each rank's
// queries must meet every other rank's keys. They travel around a ring, one block a step,
// while the rank computes with the block it holds, and the online softmax folds each
// block's result into a running one. Every rank also computes the whole attention on one
// device, and the two must agree.
//
// Run:
//   build/default/bin/ch10_ring_attention                     4 ranks, zigzag
//   build/default/bin/ch10_ring_attention --split plain       the naive split's imbalance
//   build/default/bin/ch10_ring_attention --ranks 8 --seq 256
//   build/default/bin/ch10_ring_attention --ranks 4 --seq 512 --benchmark --csv-dir results
//   mpirun -np 4 build/default/bin/ch10_ring_attention
//
// Expected: the output and dL/dq, dL/dk, dL/dv equal one device's to rounding; each
// rank's bytes equal the formula; zigzag gives every rank the same work, plain the last
// rank about 2cp - 1 times the first's (6.8x at cp 4, T 96); what a rank keeps for the backward is
// 1/cp of one device's.
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "ring_attention.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/memory.hpp"
#include "shardlab/timer.hpp"

using namespace shardlab;
using namespace ch10;

namespace {

struct Settings {
  std::int64_t seq = 96, heads = 4, head_dim = 16;
  std::string split = "zigzag";
  bool benchmark = false;
};

/// The largest |got - want| over the largest |want| (at least 1); NaN if any is.
template <class W>
double max_rel_diff(const std::vector<float>& got, const std::vector<W>& want) {
  double worst = 0, largest = 1;
  for (W w : want) largest = std::max(largest, double(std::abs(w)));
  for (std::size_t e = 0; e < got.size(); ++e) {
    const double d = std::abs(double(got[e]) - double(want[e]));
    worst = d != d || worst != worst ? NAN : std::max(worst, d);
  }
  return worst / largest;
}

void run(Context& ctx, const Settings& s) {
  const Split split = s.split == "zigzag" ? Split::zigzag : Split::plain;
  const std::int64_t T = s.seq, H = s.heads, D = s.head_dim, C = H * D;
  const int cp = ctx.size(), r = ctx.rank();
  const auto q = random_rows(T, C, 1), k = random_rows(T, C, 2), v = random_rows(T, C, 3),
             dout = random_rows(T, C, 4);
  // 1. One device: the whole sequence on a ring of one.
  auto self = ctx.comm().split(r, 0);
  RingSaved whole_saved;
  const std::vector<float> whole_out =
      ring_attention(*self, q, k, v, {T, Split::plain, H, D}, &whole_saved);
  const RingGrads whole =
      ring_attention_backward(*self, whole_saved, dout, {T, Split::plain, H, D});

  // 2. The ring: this rank's rows.
  const std::vector<std::int64_t> pos = rank_positions(T, cp, r, split);
  RingSaved saved;
  std::int64_t work = 0;
  memory::Tracker tracker;  // what the forward keeps for the backward: the ledger's count
  const auto start = ctx.comm().stats().total().bytes_sent;
  const std::vector<float> out =
      ring_attention(ctx.comm(), rows_at(q, pos, C), rows_at(k, pos, C), rows_at(v, pos, C),
                     {T, split, H, D}, &saved, &work);
  const auto forward = ctx.comm().stats().total().bytes_sent - start;
  const std::uint64_t kept = tracker.usage().live(memory::Category::activations);
  const RingGrads g =
      ring_attention_backward(ctx.comm(), saved, rows_at(dout, pos, C), {T, split, H, D});
  const auto backward = ctx.comm().stats().total().bytes_sent - start - forward;

  // 3. Against one device, every element. The two add the same terms in other orders
  // (the ring merges block by block), so they differ by float rounding; how far rounding
  // alone takes one device from the exact result (double, exact_attention, rank 0) is the
  // yardstick: the ring is held to kOrder times it, and never to less than kTolerance.
  constexpr double kTolerance = 1e-5, kOrder = 10;
  Exact exact;
  if (r == 0) exact = exact_attention(q, k, v, dout, T, H, D);
  Table vs({"what", "max_rel_diff", "rounding_alone", "tolerance"});
  auto compare = [&](const std::string& what, const std::vector<float>& got,
                     const std::vector<float>& want, const std::vector<double>& exact_values) {
    const double alone =
        ctx.comm().agree(r == 0 ? max_rel_diff(want, exact_values) : 0.0, shardlab::ReduceOp::max);
    const double tolerance = std::max(kTolerance, kOrder * alone);
    vs.add({what, ctx.verify_close(what, max_rel_diff(got, rows_at(want, pos, C)), tolerance),
            alone, tolerance});
  };
  compare("the attention's output", out, whole_out, exact.out);
  compare("dL/dq", g.dq, whole.dq, exact.dq);
  compare("dL/dk", g.dk, whole.dk, exact.dk);
  compare("dL/dv", g.dv, whole.dv, exact.dv);
  ctx.report(
      vs, "vs_single_device",
      "Chapter 10 - ring attention, cp " + std::to_string(cp) + " (" + s.split + "), T " +
          std::to_string(T) + ", " + std::to_string(H) + " heads of " + std::to_string(D) +
          "\n\nthe ring against one device, relative to the largest value; rounding alone: one "
          "device against the exact result (double), x " +
          format_number(kOrder) + " the tolerance, at least " + format_number(kTolerance));

  // 4. Per rank: bytes against the formula, the work, what it keeps for the backward.
  const std::uint64_t block = pos.size() * static_cast<std::uint64_t>(C) * sizeof(float);
  const std::uint64_t kept_whole = whole_saved.bytes();
  std::vector<std::vector<std::int64_t>> every;
  for (std::uint64_t x :
       {std::uint64_t(forward), ring_forward_bytes(cp, block), std::uint64_t(backward),
        ring_backward_bytes(cp, block), std::uint64_t(work), kept})
    every.push_back(ctx.comm().gather_values(static_cast<std::int64_t>(x)));
  Table ranks({"rank", "chunks", "forward_bytes", "forward_formula", "backward_bytes",
               "backward_formula", "scores", "kept_bytes", "kept_formula"});
  for (int q_rank = 0; q_rank < cp; ++q_rank) {
    const auto i = static_cast<std::size_t>(q_rank);
    std::string chunks;
    if (split == Split::zigzag)
      for (int c : zigzag_chunks(cp, q_rank))
        chunks += (chunks.empty() ? "" : " ") + std::to_string(c);
    else
      chunks = std::to_string(q_rank);
    ranks.add({q_rank, chunks, every[0][i], every[1][i], every[2][i], every[3][i], every[4][i],
               every[5][i],
               static_cast<std::int64_t>(kept_whole / static_cast<std::uint64_t>(cp))});
  }
  ctx.report(ranks, "per_rank",
             "\nper rank: bytes sent (forward: k and v passed on cp - 1 times; backward: k, v "
             "and their gradients cp - 1 times, the gradients once more home), the score "
             "entries it computed (the causal work), and the bytes it keeps for the backward "
             "(q, k, v, out, log-sum-exp of its rows: one device's over cp)");
  ctx.verify(every[0] == every[1] && every[2] == every[3],
             "a rank sent other than the formula (per_rank)");
  ctx.verify(every[5][static_cast<std::size_t>(r)] ==
                 static_cast<std::int64_t>(kept_whole / static_cast<std::uint64_t>(cp)),
             "a rank keeps other than 1/cp of one device's activations (per_rank)");
  const auto [lo, hi] = std::minmax_element(every[4].begin(), every[4].end());
  ctx.json()["work_imbalance"] = double(*hi) / double(*lo);
  ctx.say("\nthe busiest rank computes " + format_number(double(*hi) / double(*lo), 3) +
          "x the scores of the least busy" +
          (split == Split::zigzag ? " (zigzag: every rank one early and one late chunk)"
                                  : " (plain: the last rank's queries see every key)"));
}

/// --benchmark: on rings of 1, 2, 4, ... of the ranks (the first cp), both splits, the
/// forward and backward timed (the median of 5 after one untimed) on every rank, with the
/// scores it computed: 10_ring_attention.csv.
void benchmark(Context& ctx, const Settings& s) {
  const std::int64_t T = s.seq, H = s.heads, D = s.head_dim, C = H * D;
  const auto q = random_rows(T, C, 1);
  Table table({"split", "cp", "rank", "scores", "seconds"});
  for (int cp = 1; cp <= ctx.size(); cp *= 2) {
    if (T % (2 * cp) != 0) break;
    auto ring = ctx.comm().split(ctx.rank() < cp ? 0 : 1, ctx.rank());
    for (Split split : {Split::zigzag, Split::plain}) {
      std::vector<double> times;
      std::int64_t work = 0;
      if (ctx.rank() < cp) {
        const auto mine = rows_at(q, rank_positions(T, cp, ring->rank(), split), C);
        for (int i = 0; i < 6; ++i) {
          RingSaved saved;
          std::int64_t w = 0;
          Stopwatch timer;
          ring_attention(*ring, mine, mine, mine, {T, split, H, D}, &saved, &w);
          ring_attention_backward(*ring, saved, mine, {T, split, H, D});
          if (i > 0) times.push_back(timer.seconds());
          work = w;
        }
        std::sort(times.begin(), times.end());
      }
      const double seconds = times.empty() ? 0 : times[times.size() / 2];
      const auto all_work = ctx.comm().gather_values(work);
      const auto all_seconds = ctx.comm().gather_values(seconds);
      for (int r = 0; r < cp; ++r)
        table.add({split == Split::zigzag ? "zigzag" : "plain", cp, r,
                   all_work[static_cast<std::size_t>(r)],
                   all_seconds[static_cast<std::size_t>(r)]});
    }
  }
  ctx.report(table, "benchmark",
             "Chapter 10 - ring attention, T " + std::to_string(T) +
                 ": each rank's scores and its forward and backward time (median of 5), "
                 "rings of 1, 2, 4, ... ranks, zigzag and plain");
  ctx.save_csv(table, "10_ring_attention");
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch10_ring_attention",
                  "Chapter 10: ring attention over a sequence split into cp chunks, equal to one "
                  "device");
  program.default_ranks(4);
  Settings s;
  auto& cli = program.cli();
  cli.add_option("--seq", s.seq, "sequence length T (2 cp must divide it under zigzag)")
      ->check(shardlab::cli::whole(1, 4096))
      ->capture_default_str();
  cli.add_option("--heads", s.heads, "attention heads")
      ->check(shardlab::cli::whole(1, 64))
      ->capture_default_str();
  cli.add_option("--head-dim", s.head_dim, "width of a head")
      ->check(shardlab::cli::whole(1, 256))
      ->capture_default_str();
  cli.add_option("--split", s.split, "how the sequence is cut: zigzag or plain")
      ->check(CLI::IsMember({"zigzag", "plain"}))
      ->capture_default_str();
  cli.add_flag("--benchmark", s.benchmark,
               "time rings of 1, 2, 4, ... ranks, both splits (CSV for the notebook)");
  program.writes_csv([&] { return s.benchmark; });
  program.world_size([&](const Options&, int ranks) {
    // The scores, each computed in full on the host, several times over (one device on
    // every rank, the ring, the exact result, their backwards): a bound of seconds.
    const auto products = static_cast<double>(s.seq * s.seq * s.heads * s.head_dim);
    require_usage(products <= 0x1p28,
                  "--seq, --heads and --head-dim ask for T^2 H D = " + format_number(products) +
                      " products a pass, more than 2^28: make them smaller");
    const std::int64_t chunks = s.split == "zigzag" ? 2 * ranks : ranks;
    require_usage(s.seq % chunks == 0, "--seq " + std::to_string(s.seq) + " must cut into " +
                                           std::to_string(chunks) + " equal chunks (" +
                                           std::to_string(ranks) + " ranks, " + s.split + ")");
  });
  program.memory_estimate([&](const Options& o) {
    // q, k, v, dout and their one-device results (whole sequence) on every rank.
    return (o.backend == "threads" || o.backend == "auto" ? o.ranks : 1) * 16.0 *
           static_cast<double>(s.seq * s.heads * s.head_dim) * 4;
  });
  return program.run(argc, argv, [&](Context& ctx) {
    ctx.json()["chapter"] = "10_ring_attention";
    if (s.benchmark) return benchmark(ctx, s);
    run(ctx, s);
  });
}
