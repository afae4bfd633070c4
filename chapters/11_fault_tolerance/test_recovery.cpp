// Chapter 11's exercise: the checkpoint interval and the step a restarted run goes on from,
// against numbers computed here independently (Young's and Daly's own figures, a grid
// search of the waste, a run of steps simulated one at a time).
//
// Wrong versions this test was checked against, and what each gives:
//   Young's interval without the 2 (√(δM)): "Young: 5 min checkpoints, failures every
//     24 h" 84.85 for 120
//   Daly's interval without its "− δ" (the period, not the work between checkpoints):
//     "Daly's figure: M = 24 h gives 121.69"
//   Daly's first correction 1/2 instead of 1/3: "Daly's figure: M = 24 h gives 117.523"
//     (118 rounded)
//   the waste losing a whole interval a failure (T, not T/2): "waste 0.277778" (0.1944)
//   resume_point from the checkpoint the failing step would have written ((f+1)/k k):
//     "every 1, failing in step 0: step 1, the run's 0"
//   resume_point not counting the failing step as lost (f − s): "every 0, failing in
//     step 0: lost 0, the run's 1"
//   resume_point dividing by `every` when there are no checkpoints: a crash (SIGFPE)
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "recovery.hpp"

using namespace ch11;

TEST_CASE("Young's and Daly's checkpoint intervals, against their numbers") {
  // Young: √(2 δ M), in minutes: δ 5, M 24 h = 1440 min -> √14400 = 120; M 6 h -> 60.
  const double young = young_interval(5, 1440);
  CHECK_MESSAGE(young == doctest::Approx(120),
                "Young: 5 min checkpoints, failures every 24 h: " << young);
  CHECK(young_interval(5, 360) == doctest::Approx(60));
  CHECK(young_interval(0.5, 185.6) == doctest::Approx(std::sqrt(185.6)));
  // Daly (2006), his figures' captions: with 5-minute dumps, the optimum compute time
  // between them is 117, 57 and 9.1 minutes for M = 24 h, 6 h and 15 min.
  const double at_24h = daly_interval(5, 1440), at_6h = daly_interval(5, 360),
               at_15min = daly_interval(5, 15);
  CHECK_MESSAGE(std::round(at_24h) == 117, "Daly's figure: M = 24 h gives " << at_24h);
  CHECK_MESSAGE(std::round(at_6h) == 57, "Daly's figure: M = 6 h gives " << at_6h);
  CHECK_MESSAGE(std::round(at_15min * 10) == 91, "Daly's figure: M = 15 min gives " << at_15min);
  // Checkpoints as long as two failures apart or more: checkpoint every M.
  CHECK(daly_interval(30, 15) == doctest::Approx(15));
  CHECK(daly_interval(40, 15) == doctest::Approx(15));
}

TEST_CASE("the waste, and its least where Young puts it") {
  // δ/T + (T/2 + R)/M with T 60, δ 5, R 10, M 360: 5/60 + 40/360.
  const double waste = expected_waste(60, 5, 10, 360);
  CHECK_MESSAGE(waste == doctest::Approx(5.0 / 60 + 40.0 / 360), "waste " << waste);
  // Its minimum over T, by a search of a fine grid: at √(2 δ M) = 60, whatever R.
  for (const double restart : {0.0, 10.0, 100.0}) {
    double best = 1, best_t = 0;
    for (double t = 1; t <= 400; t += 0.01) {
      const double w = expected_waste(t, 5, restart, 360);
      if (w < best) best = w, best_t = t;
    }
    CHECK_MESSAGE(best_t == doctest::Approx(60).epsilon(1e-3),
                  "the waste's minimum at " << best_t << " (R " << restart << ")");
  }
}

TEST_CASE("where a restarted run goes on from, for every failing step") {
  // A run simulated step by step: after step t it writes a checkpoint when t + 1 is a
  // multiple of `every`; step `failed` fails before its checkpoint could be written.
  for (int every : {0, 1, 2, 3, 5, 7}) {
    for (int failed = 0; failed < 30; ++failed) {
      int last = 0;
      for (int t = 0; t < failed; ++t)
        if (every > 0 && (t + 1) % every == 0) last = t + 1;
      const ResumePoint p = resume_point(every, failed);
      const std::string at =
          "every " + std::to_string(every) + ", failing in step " + std::to_string(failed);
      CHECK_MESSAGE(p.step == last, at << ": step " << p.step << ", the run's " << last);
      CHECK_MESSAGE(p.lost == failed + 1 - last,
                    at << ": lost " << p.lost << ", the run's " << failed + 1 - last);
    }
  }
}
