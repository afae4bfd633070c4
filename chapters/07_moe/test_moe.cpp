// Chapter 07's own code: the capacity formula, the aux loss, and the single-device
// layer's gradients against finite differences (the reference the expert-parallel layer
// is compared with must itself be right).
//
// Checked against these wrong versions (each fails the case named):
//   the gate renormalisation left out of the router's backward (dL/dp = dL/dgate for
//     k = 2) -> "the layer's gradients match finite differences": dL/dWrouter, k := 2;
//   the aux loss's gradient left out -> the same case, dL/dWrouter, k := 1;
//   capacity rounded down -> "capacity C = ceil(k T / E x factor)": 19, not 20.
#include <doctest/doctest.h>

#include <cmath>

#include "moe.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;

namespace {

/// L = sum of y . dy (in double) + the aux loss: what the backward differentiates.
double loss(const ch07::MoeConfig& c, const ch07::Weights& w, const Tensor& x, const Tensor& dy) {
  const ch07::Result r = ch07::moe_reference(c, w, x, Tensor());
  double s = 0;
  for (std::int64_t i = 0; i < r.y.size(); ++i) s += static_cast<double>(r.y[i]) * dy[i];
  return s + r.aux_loss;
}

}  // namespace

TEST_SUITE("ch07") {
  TEST_CASE("capacity C = ceil(k T / E x factor), at least 1") {
    CHECK(ch07::expert_capacity(64, 2, 8, 1.25) == 20);
    CHECK(ch07::expert_capacity(64, 2, 8, 1.0) == 16);
    CHECK(ch07::expert_capacity(10, 1, 4, 1.0) == 3);  // 2.5 -> 3
    CHECK(ch07::expert_capacity(37, 2, 8, 0.9) == 9);   // 8.325 -> 9
    CHECK(ch07::expert_capacity(4, 1, 64, 0.1) == 1);
  }

  TEST_CASE("the aux loss is alpha when the routing is perfectly even") {
    // f_i = 1/E and P_i = 1/E for every expert: alpha E sum (1/E)(1/E) = alpha.
    ch07::MoeConfig c;
    c.tokens = 8;
    c.experts = 4;
    c.k = 1;
    c.aux_alpha = 0.3;
    ch07::Weights w = ch07::make_weights(c, 0, c.experts);
    w.router.zero();  // every probability 1/4; ties go to expert 0, so f = (1, 0, 0, 0)
    const Tensor x = randn(Shape{c.tokens, c.hidden}, 3);
    const ch07::Result r = ch07::moe_reference(c, w, x, Tensor());
    CHECK(r.aux_loss == doctest::Approx(0.3 * 4 * (1.0 * 0.25)));
  }

  TEST_CASE("the layer's gradients match finite differences (k = 1, 2; aux loss on)") {
    for (int k : {1, 2}) {
      CAPTURE(k);
      ch07::MoeConfig c;
      c.tokens = 12;
      c.hidden = 6;
      c.ffn = 8;
      c.experts = 4;
      c.k = k;
      c.capacity_factor = 2.0;  // nothing dropped: the loss is smooth around the point
      c.aux_alpha = 0.5;
      ch07::Weights w = ch07::make_weights(c, 0, c.experts);
      const Tensor x = randn(Shape{c.tokens, c.hidden}, 7), dy = randn(Shape{c.tokens, c.hidden}, 8);
      const ch07::Result r = ch07::moe_reference(c, w, x, dy);
      const double eps = 1e-3;
      auto fd = [&](Tensor& t, std::int64_t i) {
        const float keep = t.flat()[i];
        t.flat()[i] = keep + static_cast<float>(eps);
        const double up = loss(c, w, x, dy);
        t.flat()[i] = keep - static_cast<float>(eps);
        const double down = loss(c, w, x, dy);
        t.flat()[i] = keep;
        return (up - down) / (2 * eps);
      };
      for (std::int64_t i : {0, 5, 13, 22}) {
        const double want = fd(w.router, i);
        CHECK_MESSAGE(r.drouter.flat()[i] == doctest::Approx(want).epsilon(2e-2).scale(1e-2),
                      "dL/dWrouter[" << i << "] = " << r.drouter.flat()[i] << ", finite differences " << want);
      }
      for (std::int64_t i : {0, 17, 40}) {
        const double want = fd(w.w1[1], i);
        CHECK_MESSAGE(r.dw1[1].flat()[i] == doctest::Approx(want).epsilon(2e-2).scale(1e-2),
                      "dL/dW1 of expert 1 [" << i << "] = " << r.dw1[1].flat()[i] << ", finite differences " << want);
        const double want2 = fd(w.w2[2], i);
        CHECK_MESSAGE(r.dw2[2].flat()[i] == doctest::Approx(want2).epsilon(2e-2).scale(1e-2),
                      "dL/dW2 of expert 2 [" << i << "] = " << r.dw2[2].flat()[i] << ", finite differences " << want2);
      }
      Tensor xv = x.clone();
      for (std::int64_t i : {0, 7, 30, 71}) {
        const float keep = xv.flat()[i];
        xv.flat()[i] = keep + static_cast<float>(eps);
        const double up = loss(c, w, xv, dy);
        xv.flat()[i] = keep - static_cast<float>(eps);
        const double down = loss(c, w, xv, dy);
        xv.flat()[i] = keep;
        const double want = (up - down) / (2 * eps);
        CHECK_MESSAGE(r.dx.flat()[i] == doctest::Approx(want).epsilon(2e-2).scale(1e-2),
                      "dL/dx[" << i << "] = " << r.dx.flat()[i] << ", finite differences " << want);
      }
    }
  }
}
