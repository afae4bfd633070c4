// Chapter 06's own code: the underflow count, and the three runs of the default setup —
// fp16 without scaling stalls, with scaling it follows fp32; fp16 gradients cost half the
// bytes of fp32 ones.
//
// Checked against these wrong versions (each fails the case named, message quoted):
//   the loss gradient rounded to fp16 before the scale is applied (scaling too late)
//     -> "fp16 with scaling ends at 4.2411e-10, fp32 at 1.09918e-10";
//   the gradients allreduced in fp32 in the fp16 runs
//     -> "CHECK( 2 * c.grad_bytes_per_step == a.grad_bytes_per_step ): 24576 == 12288";
//   underflow counted as |g| < 2^-24 (the smallest subnormal is kept, half of it is not)
//     -> "underflow_fraction(g, 1.0f) == Approx(0.4)": 0.6.
#include <doctest/doctest.h>

#include <cmath>

#include "shardlab/testing.hpp"
#include "training.hpp"

using namespace shardlab;
using shardlab::testing::on_ranks;

TEST_SUITE("ch06") {
  TEST_CASE("underflow_fraction counts what rounds to zero in fp16") {
    const float tiny = std::ldexp(1.0f, -24);  // fp16's smallest subnormal
    const std::vector<float> g = {1e-9f, tiny, 0.6f * tiny, 0.5f * tiny, 1.0f, 0.0f};
    // 1e-9 and 2^-25 (a tie, to even: 0) are lost; 2^-24 and 0.6 * 2^-24 (-> 2^-24) stay.
    CHECK(ch06::underflow_fraction(g, 1.0f) == doctest::Approx(2.0 / 5.0));
    CHECK(ch06::underflow_fraction(g, 65536.0f) == 0.0);
  }

  TEST_CASE("scaling brings the gradients back: the default setup, fp32 vs fp16 with and without") {
    const ch06::ModelConfig model;
    on_ranks(2, [&](Communicator& comm) {
      ch06::RunConfig fp32, unscaled, scaled;
      fp32.fp16 = false;
      unscaled.scaler = ch06::Scaler::none;
      const auto a = ch06::train(comm, model, fp32, Memory::host);
      const auto b = ch06::train(comm, model, unscaled, Memory::host);
      const auto c = ch06::train(comm, model, scaled, Memory::host);
      // Rank 0's step-1 gradients: most below fp16's range, and the scale lifts all but
      // the very smallest (below 2^-41) into it.
      CHECK(ch06::underflow_fraction(a.first_gradients, 1.0f) > 0.8);
      CHECK(ch06::underflow_fraction(a.first_gradients, 65536.0f) < 0.25);
      CHECK_MESSAGE(b.losses.back() > 3 * a.losses.back(), "fp16 without scaling ends at "
                                                               << b.losses.back() << ", fp32 at "
                                                               << a.losses.back());
      CHECK_MESSAGE(c.losses.back() < 1.1 * a.losses.back(), "fp16 with scaling ends at "
                                                                 << c.losses.back() << ", fp32 at "
                                                                 << a.losses.back());
      CHECK(c.skipped.empty());
      // fp16 gradients move half the bytes.
      CHECK(2 * c.grad_bytes_per_step == a.grad_bytes_per_step);
      CHECK(a.grad_bytes_per_step ==
            4u * static_cast<std::uint64_t>(model.params()));  // 2 (N-1)/N P x 4, N = 2
    });
  }
}
