// Chapter 10's ring attention against one device, forward and backward, every element,
// on cp 1 to 4 ranks, zigzag and plain; the bytes each rank sends and the activations it
// keeps (the memory ledger's count) against their formulas.
//
// The reference is causal attention over the whole sequence in double, its gradients by
// the textbook formulas (dP = dO V^T, dS = P (dP - rowsum(dO O)) / sqrt(D)):
// exact_attention, which shares nothing with the ring's code.
//
// Wrong versions this test was checked against, and what each gives:
//   the ring turned the wrong way (the block held at step s taken as rank r + s's): "out
//     on zigzag cp 3, rank 1: 64 of 64 elements differ from one device's, by up to 1.13"
//   the gradients of k and v not sent home after the last step: "dL/dk on zigzag cp 2,
//     rank 1: 96 of 96 elements differ"
//   the backward's mask one off (a query not seeing its own key): "dL/dq on zigzag cp 1,
//     rank 0: 184 of 192 elements differ"
//   several sequences, each attending to the first sequence's keys and values (the
//     block's offset left out): "out of sequence 1 on cp 1, rank 0: 192 of 192 elements
//     differ from one device's, by up to 2.0"
#include <doctest/doctest.h>

#include <cmath>

#include "ring_attention.hpp"
#include "shardlab/memory.hpp"
#include "shardlab/testing.hpp"

using namespace ch10;
using shardlab::Communicator;
using shardlab::testing::on_ranks;

namespace {

constexpr std::int64_t T = 24, H = 2, D = 4, C = H * D;

void check(const std::vector<float>& got, const std::vector<double>& want,
           const std::string& what) {
  REQUIRE(got.size() == want.size());
  int wrong = 0;
  double worst = 0;
  for (std::size_t e = 0; e < got.size(); ++e) {
    const double diff = std::abs(got[e] - want[e]);
    worst = std::max(worst, diff);
    if (!(diff <= 1e-5 * (1 + std::abs(want[e])))) ++wrong;
  }
  CHECK_MESSAGE(wrong == 0, what << ": " << wrong << " of " << got.size()
                                 << " elements differ from one device's, by up to " << worst);
}

}  // namespace

TEST_CASE("ring attention equals one device's causal attention, forward and backward") {
  const auto q = random_rows(T, C, 1), k = random_rows(T, C, 2), v = random_rows(T, C, 3),
             dout = random_rows(T, C, 4);
  const Exact want = exact_attention(q, k, v, dout, T, H, D);
  for (Split split : {Split::zigzag, Split::plain})
    for (int cp : {1, 2, 3, 4}) {
      const std::string name =
          std::string(split == Split::zigzag ? "zigzag" : "plain") + " cp " + std::to_string(cp);
      on_ranks(cp, [&](Communicator& ring) {
        const auto pos = rank_positions(T, cp, ring.rank(), split);
        const std::string on = name + ", rank " + std::to_string(ring.rank());
        RingSaved saved;
        const auto before = ring.stats().total().bytes_sent;
        shardlab::memory::Tracker tracker;
        const std::vector<float> out = ring_attention(ring, rows_at(q, pos, C), rows_at(k, pos, C),
                                                      rows_at(v, pos, C), {T, split, H, D}, &saved);
        const auto forward = ring.stats().total().bytes_sent - before;
        // What it keeps for the backward, by the ledger: q, k, v and out of its T/cp rows
        // (C floats each) and a log-sum-exp a row and head: 1/cp of one device's.
        CHECK_MESSAGE(tracker.usage().live(shardlab::memory::Category::activations) ==
                          (4 * C + H) * (T / cp) * sizeof(float),
                      "activations kept on " << on);
        check(out, rows_at(want.out, pos, C), "out on " + on);
        const RingGrads g =
            ring_attention_backward(ring, saved, rows_at(dout, pos, C), {T, split, H, D});
        const auto backward = ring.stats().total().bytes_sent - before - forward;
        check(g.dq, rows_at(want.dq, pos, C), "dL/dq on " + on);
        check(g.dk, rows_at(want.dk, pos, C), "dL/dk on " + on);
        check(g.dv, rows_at(want.dv, pos, C), "dL/dv on " + on);
        const std::uint64_t block = pos.size() * C * sizeof(float);
        CHECK_MESSAGE(forward == ring_forward_bytes(cp, block), "forward bytes on " << on);
        CHECK_MESSAGE(backward == ring_backward_bytes(cp, block), "backward bytes on " << on);
      });
    }
}

TEST_CASE("a microbatch of sequences passes as one block, each sequence its own attention") {
  constexpr std::int64_t S = 3;
  std::vector<std::vector<float>> q, k, v, dout;
  std::vector<Exact> want;
  for (std::uint64_t s = 0; s < S; ++s) {
    q.push_back(random_rows(T, C, 10 + 4 * s));
    k.push_back(random_rows(T, C, 11 + 4 * s));
    v.push_back(random_rows(T, C, 12 + 4 * s));
    dout.push_back(random_rows(T, C, 13 + 4 * s));
    want.push_back(exact_attention(q[s], k[s], v[s], dout[s], T, H, D));
  }
  for (int cp : {1, 2, 3}) {
    on_ranks(cp, [&](Communicator& ring) {
      const auto pos = rank_positions(T, cp, ring.rank(), Split::zigzag);
      // This rank's rows of each sequence, one sequence after another.
      auto mine = [&](const std::vector<std::vector<float>>& all) {
        std::vector<float> out;
        for (const auto& one : all) {
          const auto rows = rows_at(one, pos, C);
          out.insert(out.end(), rows.begin(), rows.end());
        }
        return out;
      };
      const RingShape shape{T, Split::zigzag, H, D, S};
      const auto before = ring.stats().total().bytes_sent;
      RingSaved saved;
      const std::vector<float> out = ring_attention(ring, mine(q), mine(k), mine(v), shape, &saved);
      const RingGrads g = ring_attention_backward(ring, saved, mine(dout), shape);
      const std::uint64_t block = S * pos.size() * C * sizeof(float);
      CHECK(ring.stats().total().bytes_sent - before ==
            ring_forward_bytes(cp, block) + ring_backward_bytes(cp, block));
      const auto size = static_cast<std::ptrdiff_t>(pos.size() * C);
      for (std::ptrdiff_t s = 0; s < S; ++s) {
        const std::string on = " of sequence " + std::to_string(s) + " on cp " +
                               std::to_string(cp) + ", rank " + std::to_string(ring.rank());
        auto part = [&](const std::vector<float>& all) {
          return std::vector<float>(all.begin() + s * size, all.begin() + (s + 1) * size);
        };
        const Exact& w = want[static_cast<std::size_t>(s)];
        check(part(out), rows_at(w.out, pos, C), "out" + on);
        check(part(g.dq), rows_at(w.dq, pos, C), "dL/dq" + on);
        check(part(g.dk), rows_at(w.dk, pos, C), "dL/dk" + on);
        check(part(g.dv), rows_at(w.dv, pos, C), "dL/dv" + on);
      }
    });
  }
}

TEST_CASE("the zigzag balances the causal work; the plain split does not") {
  for (int cp : {2, 4}) {
    std::vector<std::int64_t> zig(static_cast<std::size_t>(cp)), plain(zig.size());
    on_ranks(cp, [&](Communicator& ring) {
      const auto q = random_rows(T / cp, C, 7);
      for (Split split : {Split::zigzag, Split::plain}) {
        std::int64_t work = 0;
        ring_attention(ring, q, q, q, {T, split, H, D}, nullptr, &work);
        (split == Split::zigzag ? zig : plain)[static_cast<std::size_t>(ring.rank())] = work;
      }
    });
    CAPTURE(cp);
    for (int r = 1; r < cp; ++r) CHECK(zig[static_cast<std::size_t>(r)] == zig[0]);
    CHECK(plain.back() > 2 * plain.front());
  }
}
