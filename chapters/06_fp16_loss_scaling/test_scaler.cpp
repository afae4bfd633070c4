// Chapter 06 tests of the learner's dynamic loss scaler and unscale-and-check step:
// compiled against the solution (must pass) and the exercise stub (every case must fail).
// The reference is PyTorch's GradScaler rule (torch/amp/grad_scaler.py and the
// _amp_update_scale_ kernel), worked out by hand below.
//
// Wrong versions these tests were checked against (each fails with the message quoted):
//   the growth tracker not reset on an overflow
//     -> "after step 7 the growth tracker is 2, GradScaler's 0"
//   growing one step late (tracker > interval instead of ==)
//     -> "after step 3 (finite) the scale is 8, GradScaler's 16"
//   growing without the finite check
//     -> "the scale grew to inf"
//   the scale updated before the skip decision (a full interval grows the scale even on
//   the step that overflowed)
//     -> "after step 7 (inf) the scale is 8, GradScaler's 4"
//   unscaling by multiplying with the scale
//     -> "element 0: unscaled 262144, want 9.31323e-10 (the fp16 value / scale, in f32)"
//   unscaling in fp16 (the small gradients underflow again)
//     -> "element 0: unscaled 0, want 9.31323e-10 (the fp16 value / scale, in f32)"
//   agreeing with a sum of the flags compared with 1 (right for one bad rank only)
//     -> "rank 0 would step although ranks 0 and 1 hold a NaN in its gradients: the
//        replicas would go apart"
//   each rank deciding from its own gradients alone
//     -> "rank 1 would step although rank 0's gradients hold a NaN: the replicas would go
//        apart"
//   the backoff floored at a lowest scale (DeepSpeed's min_loss_scale; GradScaler has none)
//     -> "after 30 overflows the scale is 1, GradScaler's 7.45058e-09"
//   the factors multiplied in f32 (GradScaler's kernel multiplies in double, rounds once)
//     -> "after backoff 3 the scale is 1769.4722, GradScaler's 1769.472"
//   found-inf taken from the scaled gradients, not the unscaled result (they differ once
//   the scale is below 1)
//     -> "65504 in fp16 unscaled by 2^-120 is inf in f32: the step must be skipped"
//   returning before writing `out` on a step to skip
//     -> "on a skipped step out[0] is 7, not the unscaled 0.5 (GradScaler unscales always)"
//   `out = grads` (the handle rebound: the caller's gradients are scaled in place)
//     -> "the caller's gradients changed: element 0 is 1, was 4"
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "scaler.hpp"
#include "shardlab/half.hpp"
#include "shardlab/results.hpp"
#include "shardlab/testing.hpp"
#include "training.hpp"

using namespace shardlab;
using shardlab::testing::on_ranks;

TEST_SUITE("ch06") {
  TEST_CASE(
      "the scale follows GradScaler's rule over a scripted run of finite and non-finite steps") {
    // init 8, growth x2 after 3 finite steps, backoff x0.5. Worked by hand:
    //   step        1  2  3   4  5  6  7  8  9  10 11 12
    //   found inf   .  .  .   X  .  .  X  X  .  .  .  .
    //   scale after 8  8  16  8  8  8  4  2  2  2  4  4
    //   tracker     1  2  0   0  1  2  0  0  1  2  0  1
    ch06::DynamicScaler s(
        {.init_scale = 8, .growth_factor = 2, .backoff_factor = 0.5f, .growth_interval = 3});
    const bool inf[12] = {false, false, false, true,  false, false,
                          true,  true,  false, false, false, false};
    const float scale[12] = {8, 8, 16, 8, 8, 8, 4, 2, 2, 2, 4, 4};
    const int tracker[12] = {1, 2, 0, 0, 1, 2, 0, 0, 1, 2, 0, 1};
    CHECK(s.scale() == 8);
    for (int t = 0; t < 12; ++t) {
      s.update(inf[t]);
      const std::string what = inf[t] ? " (inf)" : " (finite)";
      CHECK_MESSAGE(s.scale() == scale[t], "after step " << t + 1 << what << " the scale is "
                                                         << s.scale() << ", GradScaler's "
                                                         << scale[t]);
      CHECK_MESSAGE(s.growth_tracker() == tracker[t],
                    "after step " << t + 1 << " the growth tracker is " << s.growth_tracker()
                                  << ", GradScaler's " << tracker[t]);
    }
  }

  TEST_CASE("the defaults grow the scale after 2000 finite steps, and never to infinity") {
    ch06::DynamicScaler s;
    for (int t = 1; t < 2000; ++t) s.update(false);
    CHECK_MESSAGE(s.scale() == 65536.0f, "after 1999 finite steps the scale is " << s.scale());
    s.update(false);
    CHECK_MESSAGE(s.scale() == 131072.0f, "after 2000 finite steps the scale is " << s.scale());
    ch06::DynamicScaler top({.init_scale = std::ldexp(1.0f, 127), .growth_interval = 1});
    top.update(false);
    CHECK_MESSAGE(std::isfinite(top.scale()), "the scale grew to " << top.scale());
    CHECK_MESSAGE(top.scale() == std::ldexp(1.0f, 127),
                  "a growth to infinity is not taken: the scale stays 2^127, not " << top.scale());
    CHECK_MESSAGE(
        top.growth_tracker() == 0,
        "the count restarts when the interval is full, grown or not: " << top.growth_tracker());
  }

  TEST_CASE("the factors multiply in double, rounded to f32 once, and no floor stops the scale") {
    // backoff 0.3 (a double, as GradScaler's): float(double(scale) x 0.3) each time.
    ch06::DynamicScaler s({.init_scale = 65536, .backoff_factor = 0.3, .growth_interval = 5});
    double want = 65536;
    bool float_math_differs = false;  // this sequence tells the two apart (the test's own check)
    for (int t = 1; t <= 12; ++t) {
      const float before = static_cast<float>(want);
      want = static_cast<float>(want * 0.3);
      float_math_differs |= before * 0.3f != static_cast<float>(want);
      s.update(true);
      CHECK_MESSAGE(s.scale() == static_cast<float>(want),
                    "after backoff " << t << " the scale is " << format_number(s.scale(), 8)
                                     << ", GradScaler's " << format_number(want, 8));
    }
    CHECK(float_math_differs);
    ch06::DynamicScaler low({.init_scale = 8, .growth_interval = 5});
    for (int t = 0; t < 30; ++t) low.update(true);
    CHECK_MESSAGE(low.scale() == std::ldexp(1.0f, -27), "after 30 overflows the scale is "
                                                            << low.scale() << ", GradScaler's "
                                                            << std::ldexp(1.0f, -27));
  }

  TEST_CASE("unscaling writes out always, checks what it wrote, and leaves the gradients alone") {
    on_ranks(1, [](Communicator& comm) {
      // Below a scale of 1 the unscaled gradient can overflow where the scaled one did not.
      Tensor big = cast(Tensor::from_1d({65504.0f, 1.0f}), DType::f16), out(2);
      CHECK_MESSAGE(ch06::unscale_and_check(comm, big, out, std::ldexp(1.0f, -120)),
                    "65504 in fp16 unscaled by 2^-120 is inf in f32: the step must be skipped");
      // A step to skip still has its gradients unscaled (GradScaler.unscale_ writes them).
      Tensor bad =
          cast(Tensor::from_1d({1.0f, std::numeric_limits<float>::infinity()}), DType::f16);
      Tensor o = Tensor::from_1d({7.0f, 7.0f});
      CHECK(ch06::unscale_and_check(comm, bad, o, 2.0f));
      CHECK_MESSAGE(o[0] == 0.5f, "on a skipped step out[0] is "
                                      << o[0]
                                      << ", not the unscaled 0.5 (GradScaler unscales "
                                         "always)");
      // f32 gradients: out is the caller's buffer, filled; the gradients stay as they were.
      const Tensor grads = Tensor::from_1d({4.0f, -8.0f});
      Tensor mine(2);
      const float* where = mine.data();
      CHECK(!ch06::unscale_and_check(comm, grads, mine, 4.0f));
      CHECK_MESSAGE(grads[0] == 4.0f,
                    "the caller's gradients changed: element 0 is " << grads[0] << ", was 4");
      CHECK_MESSAGE(mine.data() == where,
                    "out now points elsewhere: write into the caller's "
                    "buffer, do not rebind it");
      CHECK(mine[0] == 1.0f);
      CHECK(mine[1] == -2.0f);
    });
  }

  TEST_CASE("unscaling restores the gradients, in f32, and finds inf and NaN") {
    on_ranks(1, [](Communicator& comm) {
      // g * 2^24 in fp16, back: 2^-30 is 0 in fp16, so dividing there would lose it.
      const std::vector<float> g = {std::ldexp(1.0f, -30), 1e-7f, -3.5e-6f, 0.0f, 2e-3f, -1.0f};
      const float scale = std::ldexp(1.0f, 24);
      Tensor scaled16(Shape{static_cast<std::int64_t>(g.size())}, DType::f16);
      for (std::size_t i = 0; i < g.size(); ++i)
        scaled16.data<Half>()[i] = from_float<Half>(g[i] * (i == 5 ? 1.0f / 65536 : scale));
      Tensor out(static_cast<std::int64_t>(g.size()));
      const bool found = ch06::unscale_and_check(comm, scaled16, out, scale);
      CHECK_MESSAGE(!found, "finite gradients reported as non-finite");
      for (std::size_t i = 0; i < g.size(); ++i) {
        const double want = static_cast<double>(to_float(scaled16.data<Half>()[i])) / scale;
        CHECK_MESSAGE(out[static_cast<std::int64_t>(i)] == want,
                      "element " << i << ": unscaled " << out[static_cast<std::int64_t>(i)]
                                 << ", want " << want << " (the fp16 value / scale, in f32)");
      }
      CHECK_MESSAGE(out[0] == std::ldexp(1.0f, -30),
                    "2^-30 came back as " << out[0] << " (divided in fp16?)");
      // f32 gradients too.
      Tensor g32 = Tensor::from_1d({4.0f, -8.0f}), out32(2);
      CHECK_MESSAGE(!ch06::unscale_and_check(comm, g32, out32, 4.0f),
                    "finite f32 gradients: nothing to skip");
      CHECK_MESSAGE(
          (out32[0] == 1.0f && out32[1] == -2.0f),
          "f32 gradients 4, -8 at scale 4 unscale to 1, -2, not " << out32[0] << ", " << out32[1]);
      for (float bad :
           {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
            std::numeric_limits<float>::quiet_NaN()}) {
        Tensor t = cast(Tensor::from_1d({1.0f, bad, 2.0f}), DType::f16), o(3);
        CHECK_MESSAGE(ch06::unscale_and_check(comm, t, o, 2.0f),
                      "a gradient of " << bad << " went unnoticed");
      }
    });
  }

  TEST_CASE("one rank's non-finite gradient makes every rank skip, and so do several") {
    for (int N : {2, 3, 4, 8}) {
      CAPTURE(N);
      // Which ranks hold a NaN: the first, the last, two of them, all of them.
      for (int pattern = 0; pattern < 4; ++pattern) {
        auto bad = [&](int q) {
          switch (pattern) {
            case 0:
              return q == 0;
            case 1:
              return q == N - 1;
            case 2:
              return q == 0 || q == 1;
            default:
              return true;
          }
        };
        on_ranks(N, [&](Communicator& comm) {
          Tensor g = cast(Tensor::from_1d({0.5f, 0.25f, 1.0f}), DType::f16), out(3);
          if (bad(comm.rank()))
            g.data<Half>()[1] = from_float<Half>(std::numeric_limits<float>::quiet_NaN());
          const bool found = ch06::unscale_and_check(comm, g, out, 2.0f);
          const std::string who = pattern == 3   ? "every rank holds"
                                  : pattern == 2 ? "ranks 0 and 1 hold"
                                                 : "one rank holds";
          CHECK_MESSAGE(found, "rank " << comm.rank() << " would step although " << who
                                       << " a NaN in its gradients: the replicas would go apart");
          Tensor fine = cast(Tensor::from_1d({0.5f}), DType::f16), o(1);
          CHECK_MESSAGE(!ch06::unscale_and_check(comm, fine, o, 2.0f),
                        "finite gradients on every rank, yet a skip");
        });
      }
    }
  }

  TEST_CASE("a skipped step leaves the weights untouched on every rank, and halves the scale") {
    ch06::ModelConfig model;
    model.hidden = 16;
    on_ranks(3, [&](Communicator& comm) {
      ch06::RunConfig run;
      run.steps = 4;
      const ch06::RunResult before = ch06::train(comm, model, run, Memory::host);
      run.steps = 5;
      run.inject_overflow = {5};  // the last rank's gradients turn inf at step 5
      const ch06::RunResult skipped = ch06::train(comm, model, run, Memory::host);
      CHECK_MESSAGE(skipped.skipped == std::vector<int>{5}, "rank " << comm.rank() << " skipped "
                                                                    << skipped.skipped.size()
                                                                    << " steps, not step 5 alone");
      CHECK_MESSAGE(skipped.weights.bitwise_equal(before.weights),
                    "rank " << comm.rank()
                            << ": step 5 was to be skipped, but the weights changed by "
                            << max_abs_diff(skipped.weights, before.weights));
      run.steps = 6;
      const ch06::RunResult after = ch06::train(comm, model, run, Memory::host);
      CHECK_MESSAGE(after.scales[5] == 32768.0f, "the step after the skip uses the scale "
                                                     << after.scales[5]
                                                     << ", half of 65536 expected");
      CHECK_MESSAGE(after.scales[4] == 65536.0f,
                    "the skipped step itself used the scale " << after.scales[4]);
    });
  }
}
