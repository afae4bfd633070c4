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
//     -> "underflow_fraction(g, 1.0f) == Approx(0.4)": 0.6;
//   divergence judged by the last step's loss alone (--lr 1 goes up 8e9 times and comes back)
//     -> "the run that rose 10^6 times and came back": no failure reported;
//   a dead run counted as "skipped.size() > steps" (never true)
//     -> "every step skipped, fixed scale": no failure reported;
//   format_steps with a range for two in a row, or the last run dropped
//     -> "1-2" for {1, 2}; "1-4, 8-9" for {1, 2, 3, 4, 8, 9}.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

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

  TEST_CASE("format_steps writes three or more steps in a row as a range") {
    CHECK(ch06::format_steps({}) == "none");
    CHECK(ch06::format_steps({7}) == "7");
    CHECK(ch06::format_steps({1, 2}) == "1, 2");
    CHECK(ch06::format_steps({1, 2, 3, 4, 8, 9}) == "1-4, 8, 9");
    CHECK(ch06::format_steps({1, 2, 3, 5, 6, 7, 10}) == "1-3, 5-7, 10");
  }

  TEST_CASE("failed_checks: a run thrown about or never updated is a failure, never ok") {
    ch06::RunConfig run;
    run.steps = 4;
    ch06::RunResult fp32, scaled;
    fp32.losses = scaled.losses = {1.0, 0.5, 0.25, 0.125};
    fp32.scales = {1, 1, 1, 1};
    scaled.scales = {65536, 65536, 65536, 65536};
    fp32.grad_bytes_per_step = 8;
    scaled.grad_bytes_per_step = 4;
    CHECK(ch06::failed_checks(run, fp32, scaled).empty());
    auto only = [&](const ch06::RunResult& a, const ch06::RunResult& c, const std::string& part) {
      const std::vector<std::string> failures = ch06::failed_checks(run, a, c);
      REQUIRE_MESSAGE(failures.size() == 1, "expected one failure naming \"" << part << "\"");
      CHECK_MESSAGE(failures[0].find(part) != std::string::npos, failures[0]);
    };
    SUBCASE("the run that rose 10^6 times and came back") {
      ch06::RunResult thrown = fp32;
      thrown.losses = {1.0, 1e6, 0.5, 0.1};
      only(thrown, scaled, "the fp32 run diverged at step 2 (loss 1e+06, from 1 at step 1)");
    }
    SUBCASE("a NaN at the last step") {
      ch06::RunResult nan = scaled;
      nan.losses.back() = std::nan("");
      only(fp32, nan, "the fp16 run diverged at step 4");
    }
    SUBCASE("every step skipped, fixed scale") {
      run.scaler = ch06::Scaler::fixed;
      ch06::RunResult dead = scaled;
      dead.skipped = {1, 2, 3, 4};
      only(fp32, dead, "every one of the 4 steps was skipped");
      only(fp32, dead, "use a lower --scale");
      dead.skipped = {1, 2, 3};  // one step taken: a run, if a poor one
      CHECK(ch06::failed_checks(run, fp32, dead).empty());
    }
    SUBCASE("every step skipped, dynamic scale") {
      ch06::RunResult dead = scaled;
      dead.skipped = {1, 2, 3, 4};
      only(fp32, dead, "start lower (--init-scale) or train longer");
    }
    SUBCASE("the scale backed off to 0: one message, not two") {
      ch06::RunResult zero = scaled;
      zero.scales = {2, 1, 0, 0};
      zero.skipped = {1, 2, 3, 4};
      only(fp32, zero, "the loss scale backed off to 0 at step 3");
    }
    SUBCASE("an injected overflow not skipped") {
      run.inject_overflow = {2};
      only(fp32, scaled, "step 2 had its gradients made non-finite but was not skipped");
    }
    SUBCASE("without a scaler, only fp32's checks and the bytes") {
      run.scaler = ch06::Scaler::none;
      ch06::RunResult dead = scaled;
      dead.skipped = {1, 2, 3, 4};
      dead.losses = {1.0, 1e9, 1e9, 1e9};
      CHECK(ch06::failed_checks(run, fp32, dead).empty());
    }
  }
}
