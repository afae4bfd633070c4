// Chapter 07's own code: the capacity formula, the aux loss, and the single-device
// layer's gradients against finite differences (the reference the expert-parallel layer
// is compared with must itself be right).
//
// Checked against these wrong versions (each fails the case named):
//   the gate renormalisation left out of the router's backward (dL/dp = dL/dgate for
//     k = 2) -> "the layer's gradients match finite differences": dL/dWrouter, k := 2;
//   the aux loss's gradient left out -> the same case, dL/dWrouter, k := 1;
//   capacity rounded down -> "capacity C = ceil(k T / E x factor)": 2 for 2.5, 8 for 8.325;
//   the GPU tolerance 0 as on the CPU, or one ulp of the largest value -> "the GPU
//     tolerance covers another summation order": another order exceeds it (by up to 5e-7
//     relative, in dL/dWrouter); a tolerance of the magnitudes alone (sum |A||B|, no
//     K u) -> the same case: "says nothing about values of ...".
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "moe.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;

namespace {

/// L = sum of y . dy (in double) + the aux loss: what the backward differentiates.
double loss(const ch07::MoeConfig& c, const ch07::Weights& w, const Tensor& x, const Tensor& dy,
            int ranks) {
  const ch07::Result r = ch07::moe_reference(c, w, x, Tensor(), ranks);
  double s = 0;
  for (std::int64_t i = 0; i < r.y.size(); ++i) s += static_cast<double>(r.y[i]) * dy[i];
  return s + r.stats.aux_loss;
}

/// Columns (or rows, for `rows`) of t in the order `order`.
Tensor permuted(const Tensor& t, const std::vector<std::int64_t>& order, bool rows) {
  Tensor out(t.rows(), t.cols());
  for (std::int64_t i = 0; i < t.rows(); ++i)
    for (std::int64_t j = 0; j < t.cols(); ++j)
      out(i, j) = rows ? t(order[static_cast<std::size_t>(i)], j)
                       : t(i, order[static_cast<std::size_t>(j)]);
  return out;
}
std::vector<std::int64_t> shuffled(std::int64_t n, std::uint64_t seed) {
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
  const Tensor keys = randn(1, n, seed);
  std::sort(order.begin(), order.end(), [&](auto a, auto b) { return keys[a] < keys[b]; });
  return order;
}

}  // namespace

TEST_SUITE("ch07") {
  TEST_CASE("capacity C = ceil(k T / E x factor), at least 1") {
    CHECK(ch07::expert_capacity(64, 2, 8, 1.25) == 20);
    CHECK(ch07::expert_capacity(64, 2, 8, 1.0) == 16);
    CHECK(ch07::expert_capacity(10, 1, 4, 1.0) == 3);  // 2.5 -> 3
    CHECK(ch07::expert_capacity(37, 2, 8, 0.9) == 9);  // 8.325 -> 9
    CHECK(ch07::expert_capacity(4, 1, 64, 0.1) == 1);
  }

  TEST_CASE("the aux loss is alpha E sum f_i P_i") {
    // Every probability 1/E (a zero router): whatever f is, alpha E sum f_i / E = alpha.
    ch07::MoeConfig c;
    c.tokens = 8;
    c.experts = 4;
    c.k = 1;
    c.aux_alpha = 0.3;
    ch07::Weights w = ch07::make_weights(c, 0, c.experts);
    w.router.zero();  // every probability 1/4; ties go to expert 0, so f = (1, 0, 0, 0)
    const Tensor x = randn(Shape{c.tokens, c.hidden}, 3);
    const ch07::Result r = ch07::moe_reference(c, w, x, Tensor(), 1);
    CHECK(r.stats.aux_loss == doctest::Approx(0.3 * 4 * (1.0 * 0.25)));
    // A real router: f from the first choices, P from the softmax, worked out here in double.
    const ch07::Weights w2 = ch07::make_weights(c, 0, c.experts);
    const ch07::Result r2 = ch07::moe_reference(c, w2, x, Tensor(), 1);
    std::vector<double> f(4, 0.0), P(4, 0.0);
    for (int t = 0; t < c.tokens; ++t) {
      double logits[4], top = -1e300, sum = 0;
      for (int e = 0; e < 4; ++e) {
        logits[e] = 0;
        for (int i = 0; i < c.hidden; ++i)
          logits[e] += static_cast<double>(x(t, i)) * w2.router(i, e);
        top = std::max(top, logits[e]);
      }
      for (int e = 0; e < 4; ++e) sum += std::exp(logits[e] - top);
      for (int e = 0; e < 4; ++e)
        P[static_cast<std::size_t>(e)] += std::exp(logits[e] - top) / sum / c.tokens;
      f[static_cast<std::size_t>(r2.routings[0].expert[static_cast<std::size_t>(t)])] +=
          1.0 / c.tokens;
    }
    double want = 0;
    for (int e = 0; e < 4; ++e)
      want += f[static_cast<std::size_t>(e)] * P[static_cast<std::size_t>(e)];
    CHECK(r2.stats.aux_loss == doctest::Approx(0.3 * 4 * want).epsilon(1e-5));
    CHECK(r2.stats.aux_loss > 0.3);  // not even: above alpha
  }

  TEST_CASE("each rank routes its own tokens with its own capacity (Megatron-LM, DeepSpeed)") {
    // 8 tokens on 2 ranks, every one's first choice expert 0 (k = 1, E = 2): each rank's
    // capacity is ceil(1 x 4 / 2) = 2, so each keeps its first two tokens for expert 0 and
    // drops the other two. (One capacity over all 8 tokens, 4, would keep rank 0's four and
    // drop every token of rank 1.)
    ch07::MoeConfig c;
    c.tokens = 8;
    c.experts = 2;
    c.k = 1;
    c.capacity_factor = 1.0;
    ch07::Weights w = ch07::make_weights(c, 0, c.experts);
    const Tensor x = full(Shape{c.tokens, c.hidden}, 1.0f);
    for (std::int64_t i = 0; i < c.hidden; ++i) w.router(i, 0) = 1.0f, w.router(i, 1) = -1.0f;
    const ch07::Result r = ch07::moe_reference(c, w, x, Tensor(), 2);
    REQUIRE(r.routings.size() == 2);
    CHECK(c.capacity(0, 2) == 2);
    for (int q = 0; q < 2; ++q) {
      CAPTURE(q);
      CHECK_MESSAGE(
          (r.routings[static_cast<std::size_t>(q)].slot == std::vector<int>{0, 1, -1, -1}),
          "rank q's first two tokens kept by expert 0, its last two dropped");
    }
    CHECK(r.stats.kept == std::vector<int>{4, 0});
    CHECK(r.stats.dropped == 4);
    CHECK(r.stats.passed_through == 4);
  }

  TEST_CASE("a rank with no tokens still takes part: 3 tokens on 4 ranks") {
    ch07::MoeConfig c;
    c.tokens = 3;
    c.experts = 4;
    const Tensor x = randn(Shape{c.tokens, c.hidden}, 9), dy = randn(Shape{c.tokens, c.hidden}, 10);
    const ch07::Result ref = ch07::moe_reference(c, ch07::make_weights(c, 0, c.experts), x, dy, 4);
    shardlab::testing::on_ranks(4, [&](Communicator& comm) {
      const ShardRange mine = shard_range(c.tokens, 4, comm.rank());
      const ch07::Result r = ch07::moe_parallel(comm, c, ch07::make_weights(c, comm.rank(), 1),
                                                x.slice(mine.offset, mine.length),
                                                dy.slice(mine.offset, mine.length), Memory::host);
      shardlab::testing::check_equal(r.y, ref.y.slice(mine.offset, mine.length), "outputs");
      shardlab::testing::check_close(r.drouter, ref.drouter, 1e-6f, 1e-5f, "dL/dWrouter");
    });
  }

  TEST_CASE("the layer's gradients match finite differences (k = 1, 2; aux loss on; 1, 2 ranks)") {
    // With 2 ranks each routes its own 6 tokens and has its own aux loss (weighted by its
    // share of the batch): the router's gradient must be that loss's.
    for (int ranks : {1, 2})
      for (int k : {1, 2}) {
        CAPTURE(k);
        CAPTURE(ranks);
        ch07::MoeConfig c;
        c.tokens = 12;
        c.hidden = 6;
        c.ffn = 8;
        c.experts = 4;
        c.k = k;
        c.capacity_factor = 4.0;  // C = T for k = 1 and 2: nothing dropped, the loss smooth here
        c.aux_alpha = 0.5;
        ch07::Weights w = ch07::make_weights(c, 0, c.experts);
        const Tensor x = randn(Shape{c.tokens, c.hidden}, 7),
                     dy = randn(Shape{c.tokens, c.hidden}, 8);
        const ch07::Result r = ch07::moe_reference(c, w, x, dy, ranks);
        const double eps = 1e-3;
        Tensor xv = x.clone();  // the input, perturbed like the weights for dL/dx
        // (L(t[i] + eps) - L(t[i] - eps)) / 2 eps, for t any of the weights or xv.
        auto fd = [&](Tensor& t, std::int64_t i) {
          const float keep = t.flat()[i];
          t.flat()[i] = keep + static_cast<float>(eps);
          const double up = loss(c, w, xv, dy, ranks);
          t.flat()[i] = keep - static_cast<float>(eps);
          const double down = loss(c, w, xv, dy, ranks);
          t.flat()[i] = keep;
          return (up - down) / (2 * eps);
        };
        for (std::int64_t i : {0, 5, 13, 22}) {
          const double want = fd(w.router, i);
          CHECK_MESSAGE(r.drouter.flat()[i] == doctest::Approx(want).epsilon(2e-2).scale(1e-2),
                        "dL/dWrouter[" << i << "] = " << r.drouter.flat()[i]
                                       << ", finite differences " << want);
        }
        for (std::int64_t i : {0, 17, 40}) {
          const double want = fd(w.w1[1], i);
          CHECK_MESSAGE(r.dw1[1].flat()[i] == doctest::Approx(want).epsilon(2e-2).scale(1e-2),
                        "dL/dW1 of expert 1 [" << i << "] = " << r.dw1[1].flat()[i]
                                               << ", finite differences " << want);
          const double want2 = fd(w.w2[2], i);
          CHECK_MESSAGE(r.dw2[2].flat()[i] == doctest::Approx(want2).epsilon(2e-2).scale(1e-2),
                        "dL/dW2 of expert 2 [" << i << "] = " << r.dw2[2].flat()[i]
                                               << ", finite differences " << want2);
        }
        for (std::int64_t i : {0, 7, 30, 71}) {
          const double want = fd(xv, i);
          CHECK_MESSAGE(
              r.dx.flat()[i] == doctest::Approx(want).epsilon(2e-2).scale(1e-2),
              "dL/dx[" << i << "] = " << r.dx.flat()[i] << ", finite differences " << want);
        }
      }
  }
}

TEST_CASE("the GPU tolerance covers another summation order of every sum") {
  // A GPU sums each matmul in its own order. The same layer with the hidden and the FFN
  // dimensions permuted (x's columns, W1's rows and columns, ...) computes the same
  // numbers with every inner sum in another order: the results, permuted back, must lie
  // within the bound `tolerance` derives for a GPU, and the routing must not change.
  for (int k : {1, 2}) {
    CAPTURE(k);
    ch07::MoeConfig c;
    c.k = k, c.tokens = 96, c.hidden = 48, c.ffn = 80, c.experts = 4, c.seed = 5;
    const ch07::Weights w = ch07::make_weights(c, 0, c.experts);
    const Tensor x = randn(c.tokens, c.hidden, 31), dy = scale(randn(c.tokens, c.hidden, 32), 0.1f);
    const ch07::Result ref = ch07::moe_reference(c, w, x, dy, 1);
    const ch07::Tolerance tol = ch07::tolerance(c, w, x, dy, ref, true);
    const auto P = shuffled(c.hidden, 41), Q = shuffled(c.ffn, 42);
    ch07::Weights v = w;
    v.router = permuted(w.router, P, true);
    for (int e = 0; e < c.experts; ++e) {
      v.w1[static_cast<std::size_t>(e)] =
          permuted(permuted(w.w1[static_cast<std::size_t>(e)], P, true), Q, false);
      v.w2[static_cast<std::size_t>(e)] =
          permuted(permuted(w.w2[static_cast<std::size_t>(e)], Q, true), P, false);
    }
    const ch07::Result other =
        ch07::moe_reference(c, v, permuted(x, P, false), permuted(dy, P, false), 1);
    REQUIRE_MESSAGE(other.routings[0].expert == ref.routings[0].expert,
                    "the permuted run routed otherwise");
    REQUIRE(other.routings[0].slot == ref.routings[0].slot);
    auto check = [](const std::string& what, const Tensor& got, const Tensor& want, double bound) {
      const double diff = max_abs_diff(got, want);
      CHECK_MESSAGE(diff <= bound, what << ": another order differs by " << diff
                                        << ", more than the GPU tolerance " << bound);
      // Not vacuous. The bound is a worst case (K u per sum, every error aligned), some
      // 10^3 to 10^5 times what another order gives here; still, a mistake of the layer (a
      // dropped term, a wrong row) moves a result by more than 5 % of the largest value.
      CHECK_MESSAGE(bound < 0.05 * std::max(1.0, max_abs(want)),
                    what << ": the GPU tolerance " << bound << " says nothing about values of "
                         << max_abs(want));
    };
    check("y", permuted(ref.y, P, false), other.y, tol.y);
    check("dL/dx", permuted(ref.dx, P, false), other.dx, tol.dx);
    check("dL/dWrouter", permuted(ref.drouter, P, true), other.drouter, tol.drouter);
    for (int e = 0; e < c.experts; ++e) {
      const auto i = static_cast<std::size_t>(e);
      check("dL/dW1", permuted(permuted(ref.dw1[i], P, true), Q, false), other.dw1[i], tol.dw);
      check("dL/dW2", permuted(permuted(ref.dw2[i], Q, true), P, false), other.dw2[i], tol.dw);
    }
  }
}
