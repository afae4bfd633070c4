// Chapter 10 — long context: causal attention over a sequence split into cp chunks, the
// keys and values passed around a ring of ranks (ring_attention.hpp).
//
// Beyond the course's three axes (so-large-lm's chapter 8 and CS336 lecture 7 cut the
// batch, the weights and the layers; chapter 09 adds sequence parallelism, which Llama-1
// used): Liu et al. 2023's ring attention, Megatron-LM's `--context-parallel-size`.
// Attention is the one layer that mixes tokens, so cutting the sequence means each rank's
// queries must meet every other rank's keys. They travel around a ring, one block a step,
// while the rank computes with the block it holds, and the online softmax folds each
// block's result into a running one. The ring's result is checked against the exact one
// (double), to what float rounding alone does to one device's.
//
// Run:
//   build/default/bin/ch10_ring_attention                     4 ranks, zigzag
//   build/default/bin/ch10_ring_attention --split plain       the naive split's imbalance
//   build/default/bin/ch10_ring_attention --ranks 8 --seq 256
//   build/default/bin/ch10_ring_attention --ranks 4 --seq 512 --benchmark --csv-dir results
//   mpirun -np 4 build/default/bin/ch10_ring_attention
//
// Expected: the output and dL/dq, dL/dk, dL/dv equal the exact result as closely as one
// device's float result does; each rank's bytes equal the formula; zigzag gives every rank
// the same work, plain the last rank about 2cp - 1 times the first's (6.8x at cp 4, T 96);
// what a rank keeps for the backward is 1/cp of one device's.
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

/// The sequence every rank makes up alike: q, k, v and dL/dout, T rows of H D each.
struct Inputs {
  std::vector<float> q, k, v, dout;
};

/// What the ring did on this rank: its rows' positions, their attention and the gradients
/// of its q, k and v, the bytes it sent forward and backward, the score entries it
/// computed (its causal work), and what the memory ledger saw it keep for the backward.
struct RingRun {
  std::vector<std::int64_t> pos;
  std::vector<float> out;
  RingGrads grads;
  std::uint64_t forward_bytes = 0, backward_bytes = 0, kept = 0;
  std::int64_t work = 0;
};

RingRun run_ring(Context& ctx, const Inputs& in, const RingShape& shape) {
  const std::int64_t C = shape.heads * shape.head_dim;
  RingRun run;
  run.pos = rank_positions(shape.T, ctx.size(), ctx.rank(), shape.split);
  RingSaved saved;
  memory::Tracker tracker;  // what the forward keeps for the backward: the ledger's count
  const auto start = ctx.comm().stats().total().bytes_sent;
  run.out = ring_attention(ctx.comm(), rows_at(in.q, run.pos, C), rows_at(in.k, run.pos, C),
                           rows_at(in.v, run.pos, C), shape, &saved, &run.work);
  run.forward_bytes = ctx.comm().stats().total().bytes_sent - start;
  run.kept = tracker.usage().live(memory::Category::activations);
  run.grads = ring_attention_backward(ctx.comm(), saved, rows_at(in.dout, run.pos, C), shape);
  run.backward_bytes = ctx.comm().stats().total().bytes_sent - start - run.forward_bytes;
  return run;
}

/// One device in float, by the chapter's own code and without the merge: every key in
/// one block (attend), normalised, and the ring's backward on a ring of one. Its distance
/// from the exact result is what float rounding alone does; `kept`, the bytes it keeps
/// for the backward.
struct OneDevice {
  std::vector<float> out;
  RingGrads grads;
  std::uint64_t kept = 0;
};
OneDevice one_device(Communicator& self, const Inputs& in, std::int64_t T, std::int64_t H,
                     std::int64_t D) {
  std::vector<std::int64_t> all(static_cast<std::size_t>(T));
  for (std::int64_t t = 0; t < T; ++t) all[static_cast<std::size_t>(t)] = t;
  const Partial p = attend(in.q, in.k, in.v, all, all, H, D);
  OneDevice one;
  one.out.resize(in.q.size());
  std::vector<float> lse(static_cast<std::size_t>(T * H));
  for (std::size_t i = 0; i < lse.size(); ++i) {
    lse[i] = p.max[i] + std::log(p.sum[i]);
    for (std::size_t d = 0; d < static_cast<std::size_t>(D); ++d)
      one.out[i * static_cast<std::size_t>(D) + d] =
          p.out[i * static_cast<std::size_t>(D) + d] / p.sum[i];
  }
  const RingSaved saved{Tensor::from_vector(in.q), Tensor::from_vector(in.k),
                        Tensor::from_vector(in.v), Tensor::from_vector(one.out),
                        Tensor::from_vector(lse),  all};
  one.grads = ring_attention_backward(self, saved, in.dout, {T, Split::plain, H, D});
  one.kept = saved.bytes();
  return one;
}

/// The verdict: the ring's output and gradients against the exact result (double, the
/// chapter's exact_attention), every element of every rank's rows. Float rounding alone,
/// one device's float result against the same exact one (rank 0's), is the yardstick:
/// the ring is held to kOrder times it, and never to less than kTolerance. Neither side
/// of it runs the merge, so a merge that is wrong cannot widen its own tolerance.
void compare_with_exact(Context& ctx, const Settings& s, const Inputs& in, const RingRun& ring,
                        const OneDevice& one) {
  constexpr double kTolerance = 1e-5, kOrder = 10;
  const std::int64_t T = s.seq, H = s.heads, D = s.head_dim, C = H * D;
  const Exact exact = exact_attention(in.q, in.k, in.v, in.dout, T, H, D);
  Table vs({"what", "max_rel_diff", "rounding_alone", "tolerance"});
  auto compare = [&](const std::string& what, const std::vector<float>& got,
                     const std::vector<float>& one_device, const std::vector<double>& want) {
    const double alone = ctx.comm().agree(ctx.rank() == 0 ? max_rel_diff(one_device, want) : 0.0,
                                          shardlab::ReduceOp::max);
    const double tolerance = std::max(kTolerance, kOrder * alone);
    const double diff = max_rel_diff(got, rows_at(want, ring.pos, C));
    vs.add({what, ctx.verify_close(what, diff, tolerance, "the exact result's"), alone, tolerance});
  };
  compare("the attention's output", ring.out, one.out, exact.out);
  compare("dL/dq", ring.grads.dq, one.grads.dq, exact.dq);
  compare("dL/dk", ring.grads.dk, one.grads.dk, exact.dk);
  compare("dL/dv", ring.grads.dv, one.grads.dv, exact.dv);
  ctx.report(vs, "vs_single_device",
             "Chapter 10 - ring attention, cp " + std::to_string(ctx.size()) + " (" + s.split +
                 "), T " + std::to_string(T) + ", " + std::to_string(H) + " heads of " +
                 std::to_string(D) +
                 "\n\nthe ring against the exact result (double), relative to the largest "
                 "value; rounding alone: one device in float against it, x " +
                 format_number(kOrder) + " the tolerance, at least " + format_number(kTolerance));
}

/// How evenly the ranks share the causal work (`work`: the scores each computed): said,
/// and under the zigzag checked equal, which is what the zigzag is for.
void report_balance(Context& ctx, Split split, const std::vector<std::int64_t>& work) {
  const auto [lo, hi] = std::minmax_element(work.begin(), work.end());
  const double ratio = double(*hi) / double(*lo);
  ctx.json()["work_imbalance"] = ratio;
  ctx.say("\nthe busiest rank computes " + format_number(ratio, 3) +
          "x the scores of the least busy" +
          (split == Split::zigzag ? " (zigzag: every rank one early and one late chunk)"
                                  : " (plain: the last rank's queries see every key)"));
  if (split == Split::zigzag)
    ctx.verify(*hi == *lo, "under the zigzag rank " + std::to_string(hi - work.begin()) +
                               " computes " + format_number(ratio, 3) + "x the scores of rank " +
                               std::to_string(lo - work.begin()) +
                               ": zigzag_chunks must give every rank the same causal work "
                               "(per_rank)");
}

/// Per rank: the bytes it sent against the formulas, its chunks and causal work, and what
/// it keeps for the backward against one device's over cp; each checked, and under the
/// zigzag the work checked equal on every rank.
void report_ranks(Context& ctx, Split split, const RingRun& ring, std::uint64_t kept_whole) {
  const int cp = ctx.size();
  const std::int64_t C = static_cast<std::int64_t>(ring.out.size() / ring.pos.size());
  const std::uint64_t block = ring.pos.size() * static_cast<std::uint64_t>(C) * sizeof(float);
  const auto kept_formula = static_cast<std::int64_t>(kept_whole / static_cast<std::uint64_t>(cp));
  std::vector<std::vector<std::int64_t>> every;
  for (std::uint64_t x : {ring.forward_bytes, ring_forward_bytes(cp, block), ring.backward_bytes,
                          ring_backward_bytes(cp, block), std::uint64_t(ring.work), ring.kept})
    every.push_back(ctx.comm().gather_values(static_cast<std::int64_t>(x)));
  Table ranks({"rank", "chunks", "forward_bytes", "forward_formula", "backward_bytes",
               "backward_formula", "scores", "kept_bytes", "kept_formula"});
  for (int q = 0; q < cp; ++q) {
    const auto i = static_cast<std::size_t>(q);
    std::string chunks;
    for (int c : rank_chunks(cp, q, split))
      chunks += (chunks.empty() ? "" : " ") + std::to_string(c);
    ranks.add({q, chunks, every[0][i], every[1][i], every[2][i], every[3][i], every[4][i],
               every[5][i], kept_formula});
  }
  ctx.report(ranks, "per_rank",
             "\nper rank: bytes sent (forward: k and v passed on cp - 1 times; backward: k, v "
             "and their gradients cp - 1 times, the gradients once more home), the score "
             "entries it computed (the causal work), and the bytes it keeps for the backward "
             "(q, k, v, out, log-sum-exp of its rows: one device's over cp)");
  ctx.verify(every[0] == every[1] && every[2] == every[3],
             "a rank sent other than the formula (per_rank)");
  ctx.verify(static_cast<std::int64_t>(ring.kept) == kept_formula,
             "a rank keeps other than 1/cp of one device's activations (per_rank)");
  report_balance(ctx, split, every[4]);
}

void run(Context& ctx, const Settings& s) {
  const Split split = s.split == "zigzag" ? Split::zigzag : Split::plain;
  const std::int64_t T = s.seq, H = s.heads, D = s.head_dim, C = H * D;
  const Inputs in{random_rows(T, C, 1), random_rows(T, C, 2), random_rows(T, C, 3),
                  random_rows(T, C, 4)};
  // 1. The ring: this rank's rows.
  const RingRun ring = run_ring(ctx, in, {T, split, H, D});
  // 2. One device in float, on rank 0: how far rounding alone takes it from the exact
  // result, and what it keeps for the backward.
  auto self = ctx.comm().split(ctx.rank(), 0);
  OneDevice one;
  if (ctx.rank() == 0) one = one_device(*self, in, T, H, D);
  // 3. Both against the exact result, every element.
  compare_with_exact(ctx, s, in, ring, one);
  // 4. Per rank: bytes against the formulas, the work, what it keeps for the backward.
  const auto kept_whole =
      static_cast<std::uint64_t>(ctx.comm().agree(double(one.kept), shardlab::ReduceOp::max));
  report_ranks(ctx, split, ring, kept_whole);
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
