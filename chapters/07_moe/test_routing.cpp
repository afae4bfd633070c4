// Chapter 07 tests of the learner's routing and dispatch plan: compiled against the
// solution (must pass) and the exercise stub (every case must fail).
//
// Wrong versions these tests were checked against (each fails with the message quoted):
//   slots given token by token (t0's choices, then t1's, ...) instead of first choices first
//     -> "token 1 choice 1 (expert 2): slot 0, want 1 (first choices by position, then
//        second choices; -1 dropped)"
//   ties to the higher expert index
//     -> "token 0 choice 1 (expert 1): slot 1, want 0 ..." and a wrong expert for token 4
//   gates not renormalised for k = 2
//     -> "token 0 choice 0: gate 0.5, want 0.625 (p / the sum of the token's k chosen p)"
//   capacity off by one (n <= capacity)
//     -> "token 4 choice 0 (expert 0): slot 3, want -1"
//   std::sort instead of std::stable_sort (ties in any order)
//     -> "the experts differ from the brute-force router's (ties: the lower index first)"
//   a loop written for k <= 2 only -> "the experts of the top-3 choices"
//   top-k by masking each chosen probability with 0 and taking the largest again (a row
//   with fewer than k non-zero probabilities then picks an expert twice)
//     -> "token 0 (probabilities 1 0 0 0) chose experts 0 0 0, want 0 1 2 ..."
//   plan_dispatch sending an expert's rows by token instead of by slot
//     -> "send order 1 2 5 3 0 4, want 2 1 5 3 0 4 (by destination rank, expert, slot)";
//     in the layer, "dL/dW1: 298 of 512 elements differ": the expert adds its rows in
//     another order than one device
//   plan_dispatch counting dropped choices
//     -> "rows per expert 2 1 1 2 with choice 5 dropped, want 2 0 1 2"
//   plan_dispatch counting rows by the sending rank's experts instead of the destination's
//     -> "send counts 6 0, want 3 3"
//   plan_arrivals laying the receive buffer out expert by expert instead of rank by rank
//     -> "local expert 0's rows 0 1 2, want 0 4 5 (rank 0's, then rank 1's, ...)"
//   plan_arrivals reading the counts as expert-major (counts[l N + q])
//     -> "rows from each rank 2 4 0, want 3 1 2"
#include <doctest/doctest.h>

#include <numeric>
#include <vector>

#include "moe.hpp"
#include "routing.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using shardlab::testing::on_ranks;

namespace {

Tensor probs_of(const std::vector<std::vector<float>>& rows) {
  Tensor p(static_cast<std::int64_t>(rows.size()), static_cast<std::int64_t>(rows[0].size()));
  for (std::size_t t = 0; t < rows.size(); ++t)
    for (std::size_t e = 0; e < rows[t].size(); ++e)
      p(static_cast<std::int64_t>(t), static_cast<std::int64_t>(e)) = rows[t][e];
  return p;
}

}  // namespace

TEST_SUITE("ch07") {
  TEST_CASE("top-2 routing with capacity 3: a hand-worked example") {
    // 5 tokens, 3 experts, capacity 3. Choices, best first (ties to the lower index):
    //   t0 [.5 .3 .2] -> 0, 1    t1 [.6 .1 .3] -> 0, 2    t2 [.2 .2 .6] -> 2, 0 (tie: 0)
    //   t3 [.7 .2 .1] -> 0, 1    t4 [.4 .4 .2] -> 0 (tie), 1
    // Slots, first choices by position, then second choices by position:
    //   first:  t0 e0:0, t1 e0:1, t2 e2:0, t3 e0:2, t4 e0: full -> dropped
    //   second: t0 e1:0, t1 e2:1, t2 e0: full -> dropped, t3 e1:1, t4 e1:2
    const Tensor p = probs_of(
        {{.5f, .3f, .2f}, {.6f, .1f, .3f}, {.2f, .2f, .6f}, {.7f, .2f, .1f}, {.4f, .4f, .2f}});
    const ch07::Routing r = ch07::route(p, 2, 3);
    const std::vector<int> expert = {0, 1, 0, 2, 2, 0, 0, 1, 0, 1};
    const std::vector<int> slot = {0, 0, 1, 1, 0, -1, 2, 1, -1, 2};
    const std::vector<float> gate = {.5f / .8f, .3f / .8f, .6f / .9f, .3f / .9f, .6f / .8f,
                                     .2f / .8f, .7f / .9f, .2f / .9f, .4f / .8f, .4f / .8f};
    REQUIRE(r.expert.size() == 10);
    for (int t = 0; t < 5; ++t)
      for (int j = 0; j < 2; ++j) {
        const auto c = static_cast<std::size_t>(t * 2 + j);
        CHECK_MESSAGE(r.expert[c] == expert[c], "token " << t << " choice " << j << ": expert "
                                                         << r.expert[c] << ", want " << expert[c]
                                                         << " (k best, ties to the lower index)");
        CHECK_MESSAGE(r.slot[c] == slot[c],
                      "token " << t << " choice " << j << " (expert " << expert[c] << "): slot "
                               << r.slot[c] << ", want " << slot[c]
                               << " (first choices by position, then second choices; -1 dropped)");
        CHECK_MESSAGE(r.gate[c] == doctest::Approx(gate[c]).epsilon(1e-6),
                      "token " << t << " choice " << j << ": gate " << r.gate[c] << ", want "
                               << gate[c] << " (p / the sum of the token's k chosen p)");
      }
  }

  TEST_CASE("top-1 routing: the gate is the probability, and capacity drops the later tokens") {
    const Tensor p = probs_of({{.1f, .9f}, {.3f, .7f}, {.6f, .4f}, {.2f, .8f}});
    const ch07::Routing r = ch07::route(p, 1, 2);
    CHECK((r.expert == std::vector<int>{1, 1, 0, 1}));
    CHECK_MESSAGE((r.slot == std::vector<int>{0, 1, 0, -1}),
                  "expert 1 has room for tokens 0 and 1 only");
    CHECK_MESSAGE(r.gate[0] == doctest::Approx(0.9f),
                  "k = 1: the gate is p itself (Switch), got " << r.gate[0]);
    CHECK(r.gate[2] == doctest::Approx(0.6f));
  }

  TEST_CASE("top-3 of 4 experts, capacity 2: a hand-worked example") {
    //   t0 [.1 .4 .3 .2] -> 1, 2, 3    t1 [.25 .25 .25 .25] -> 0, 1, 2 (ties: lower first)
    //   t2 [.4 .1 .2 .3] -> 0, 3, 2
    // first:  t0 e1:0, t1 e0:0, t2 e0:1     second: t0 e2:0, t1 e1:1, t2 e3:0
    // third:  t0 e3:1, t1 e2:1, t2 e2: full -> dropped
    const Tensor p =
        probs_of({{.1f, .4f, .3f, .2f}, {.25f, .25f, .25f, .25f}, {.4f, .1f, .2f, .3f}});
    const ch07::Routing r = ch07::route(p, 3, 2);
    CHECK_MESSAGE((r.expert == std::vector<int>{1, 2, 3, 0, 1, 2, 0, 3, 2}),
                  "the experts of the top-3 choices");
    CHECK_MESSAGE((r.slot == std::vector<int>{0, 0, 1, 0, 1, 1, 1, 0, -1}),
                  "the slots of the top-3 choices");
    CHECK_MESSAGE(r.gate[0] == doctest::Approx(.4f / .9f),
                  "k = 3: the gates are p / the sum of the three, got " << r.gate[0]);
    CHECK(r.gate[3] == doctest::Approx(1.0f / 3));
  }

  TEST_CASE("a token with fewer than k non-zero probabilities still gets k different experts") {
    // Softmax outputs underflow to 0 for a confident router; the chosen experts must leave
    // the running all the same, and ties among the zeros go to the lower index.
    Tensor p(3, 4);
    const float rows[3][4] = {{1, 0, 0, 0}, {0, 0, 1, 0}, {0, 0.5f, 0, 0.5f}};
    for (int t = 0; t < 3; ++t)
      for (int e = 0; e < 4; ++e) p(t, e) = rows[t][e];
    const ch07::Routing r = ch07::route(p, 3, 3);
    const std::vector<std::vector<int>> want = {{0, 1, 2}, {2, 0, 1}, {1, 3, 0}};
    for (int t = 0; t < 3; ++t) {
      std::vector<int> got;
      for (int j = 0; j < 3; ++j) got.push_back(r.expert[static_cast<std::size_t>(r.at(t, j))]);
      CHECK_MESSAGE(got == want[static_cast<std::size_t>(t)],
                    "token " << t << " (probabilities " << rows[t][0] << " " << rows[t][1] << " "
                             << rows[t][2] << " " << rows[t][3] << ") chose experts " << got[0]
                             << " " << got[1] << " " << got[2] << ", want "
                             << want[static_cast<std::size_t>(t)][0] << " "
                             << want[static_cast<std::size_t>(t)][1] << " "
                             << want[static_cast<std::size_t>(t)][2]
                             << " (k different experts, ties to the lower index)");
    }
    CHECK(r.gate[static_cast<std::size_t>(r.at(0, 1))] == 0.0f);
  }

  TEST_CASE("route agrees with a brute-force router on random probabilities with many ties") {
    // An independent router: repeatedly take the largest remaining probability (the first
    // one found, so the lower index on a tie), then fill slots choice level by level.
    for (int k : {1, 2, 3, 5}) {
      const int T = 60, E = 24,
                C = 5;  // E > 16: std::sort no longer falls back to a stable insertion sort
      Tensor p(T, E);
      std::uint64_t state = 12345 + static_cast<std::uint64_t>(k);
      for (std::int64_t i = 0; i < p.size(); ++i) {
        state = state * 6364136223846793005ULL + 1442695040888963407ULL;
        p.flat()[i] =
            static_cast<float>((state >> 33) % 4) / 4.0f + 0.25f;  // 4 values: ties everywhere
      }
      const ch07::Routing r = ch07::route(p, k, C);
      std::vector<int> expert(static_cast<std::size_t>(T * k)),
          slot(static_cast<std::size_t>(T * k), -1);
      for (int t = 0; t < T; ++t) {
        std::vector<bool> taken(static_cast<std::size_t>(E), false);
        for (int j = 0; j < k; ++j) {
          int best = -1;
          for (int e = 0; e < E; ++e)
            if (!taken[static_cast<std::size_t>(e)] && (best < 0 || p(t, e) > p(t, best))) best = e;
          taken[static_cast<std::size_t>(best)] = true;
          expert[static_cast<std::size_t>(t * k + j)] = best;
        }
      }
      std::vector<int> used(static_cast<std::size_t>(E), 0);
      for (int j = 0; j < k; ++j)
        for (int t = 0; t < T; ++t) {
          const auto c = static_cast<std::size_t>(t * k + j);
          if (used[static_cast<std::size_t>(expert[c])] < C)
            slot[c] = used[static_cast<std::size_t>(expert[c])]++;
        }
      CAPTURE(k);
      CHECK_MESSAGE(
          r.expert == expert,
          "the experts differ from the brute-force router's (ties: the lower index first)");
      CHECK_MESSAGE(r.slot == slot, "the slots differ from the brute-force router's");
    }
  }

  TEST_CASE("the dispatch plan of a hand-worked example: 3 tokens, 4 experts, 2 ranks") {
    // This rank's tokens, top-2 of experts 0-3 (rank 0 holds experts 0, 1; rank 1 2, 3):
    //   t0 -> 3, 0    t1 -> 0, 2    t2 -> 3, 1      (choices c = 2 t + j)
    // Slots, first choices first: e3: c0 (0), c4 (1); e0: c2 (0), c1 (1); e2: c3; e1: c5.
    ch07::Routing r{
        3, 4, 2, 2, {3, 0, 0, 2, 3, 1}, {.6f, .4f, .5f, .5f, .7f, .3f}, {0, 1, 0, 0, 1, 0}};
    auto text = [](const auto& v) {
      std::string t;
      for (const auto& x : v) t += (t.empty() ? "" : " ") + std::to_string(x);
      return t;
    };
    const ch07::Dispatch d = ch07::plan_dispatch(r, 2);
    const std::vector<int> order = {2, 1, 5, 3, 0, 4};
    CHECK_MESSAGE(d.send_order == order, "send order " << text(d.send_order) << ", want "
                                                       << text(order)
                                                       << " (by destination rank, expert, slot)");
    CHECK_MESSAGE((d.per_expert == std::vector<std::size_t>{2, 1, 1, 2}),
                  "rows per expert " << text(d.per_expert) << ", want 2 1 1 2");
    CHECK_MESSAGE((d.send_counts == std::vector<std::size_t>{3, 3}),
                  "send counts " << text(d.send_counts) << ", want 3 3");
    // A dropped choice is neither counted nor sent.
    r.slot[5] = -1;
    const ch07::Dispatch e = ch07::plan_dispatch(r, 2);
    CHECK_MESSAGE(
        (e.per_expert == std::vector<std::size_t>{2, 0, 1, 2}),
        "rows per expert " << text(e.per_expert) << " with choice 5 dropped, want 2 0 1 2");
    CHECK_MESSAGE((e.send_counts == std::vector<std::size_t>{2, 3}), "a dropped choice was sent");
    CHECK((e.send_order == std::vector<int>{2, 1, 3, 0, 4}));
    // One rank holds every expert: everything goes to itself.
    const ch07::Dispatch f = ch07::plan_dispatch(r, 1);
    CHECK((f.send_counts == std::vector<std::size_t>{5}));
  }

  TEST_CASE("the arrivals of a hand-worked exchange of counts: 3 ranks, 2 experts each") {
    // counts[q 2 + l]: rank 0 sends 1 row for local expert 0 and 2 for expert 1, rank 1
    // 0 and 1, rank 2 2 and 0. The buffer holds rank 0's rows (e0: row 0; e1: 1, 2), then
    // rank 1's (e1: 3), then rank 2's (e0: 4, 5).
    auto text = [](const auto& v) {
      std::string t;
      for (const auto& x : v) t += (t.empty() ? "" : " ") + std::to_string(x);
      return t;
    };
    const ch07::Arrivals a = ch07::plan_arrivals({1, 2, 0, 1, 2, 0}, 3);
    CHECK_MESSAGE((a.recv_counts == std::vector<std::size_t>{3, 1, 2}),
                  "rows from each rank " << text(a.recv_counts) << ", want 3 1 2");
    REQUIRE_MESSAGE(a.expert_rows.size() == 2, "one list of rows per local expert");
    CHECK_MESSAGE((a.expert_rows[0] == std::vector<int>{0, 4, 5}),
                  "local expert 0's rows " << text(a.expert_rows[0])
                                           << ", want 0 4 5 (rank 0's, then rank 1's, ...)");
    CHECK_MESSAGE((a.expert_rows[1] == std::vector<int>{1, 2, 3}),
                  "local expert 1's rows " << text(a.expert_rows[1]) << ", want 1 2 3");
    const ch07::Arrivals none = ch07::plan_arrivals({0, 0, 0, 0}, 2);
    CHECK((none.recv_counts == std::vector<std::size_t>{0, 0}));
    CHECK((none.expert_rows.size() == 2 && none.expert_rows[0].empty()));
  }

  TEST_CASE(
      "expert parallel equals one device, forward and backward, N = 1, 2, 4, 8 and k = 1, 2") {
    for (int N : {1, 2, 4, 8})
      for (int k : {1, 2}) {
        CAPTURE(N);
        CAPTURE(k);
        ch07::MoeConfig c;
        c.tokens = 37;  // uneven shares
        c.experts = 8;
        c.k = k;
        c.capacity_factor = 0.9;  // some choices dropped
        const Tensor x = randn(Shape{c.tokens, c.hidden}, 5),
                     dy = randn(Shape{c.tokens, c.hidden}, 6);
        const ch07::Result ref =
            ch07::moe_reference(c, ch07::make_weights(c, 0, c.experts), x, dy, N);
        on_ranks(N, [&](Communicator& comm) {
          const int per = c.experts / N;
          const ShardRange mine = shard_range(c.tokens, N, comm.rank());
          const ch07::Result r = ch07::moe_parallel(
              comm, c, ch07::make_weights(c, comm.rank() * per, per),
              x.slice(mine.offset, mine.length), dy.slice(mine.offset, mine.length), Memory::host);
          shardlab::testing::check_equal(r.y, ref.y.slice(mine.offset, mine.length), "outputs y");
          shardlab::testing::check_close(r.dx, ref.dx.slice(mine.offset, mine.length), 1e-6f, 1e-5f,
                                         "dL/dx");
          shardlab::testing::check_close(r.drouter, ref.drouter, 1e-6f, 1e-5f, "dL/dWrouter");
          for (int l = 0; l < per; ++l) {
            shardlab::testing::check_equal(r.dw1[static_cast<std::size_t>(l)],
                                           ref.dw1[static_cast<std::size_t>(comm.rank() * per + l)],
                                           "dL/dW1");
            shardlab::testing::check_equal(r.dw2[static_cast<std::size_t>(l)],
                                           ref.dw2[static_cast<std::size_t>(comm.rank() * per + l)],
                                           "dL/dW2");
          }
          // The all-to-alls move only the rows the routing sends to other ranks, counted
          // here from the reference's routings alone: rows this rank's experts take from
          // other ranks' tokens, and rows of its tokens other ranks' experts take, 4 passes;
          // and the counts: E/N of 8 bytes from each other rank.
          std::uint64_t rows = 0;
          for (int q = 0; q < N; ++q) {
            const ch07::Routing& rq = ref.routings[static_cast<std::size_t>(q)];
            for (std::size_t ch = 0; ch < rq.slot.size(); ++ch) {
              if (rq.slot[ch] < 0) continue;
              const int owner = rq.expert[ch] / per;
              if (owner != q && (owner == comm.rank() || q == comm.rank())) ++rows;
            }
          }
          const std::uint64_t want = 2 * rows * static_cast<std::uint64_t>(c.hidden) * 4 +
                                     static_cast<std::uint64_t>((N - 1) * per) * 8;
          CHECK_MESSAGE(r.alltoall_received == want,
                        "rank " << comm.rank() << " received " << r.alltoall_received
                                << " bytes in its all-to-alls; the routing sends it " << want
                                << " (every token to every rank?)");
        });
      }
  }
}
