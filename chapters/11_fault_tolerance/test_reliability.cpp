// Chapter 11's planner against numbers worked out by hand: Llama 3's snapshot (54 days,
// 16,384 GPUs, 419 unexpected interruptions), its Table 5, and the longest checkpoint and
// restart that keep a goodput.
//
// Wrong versions this test was checked against, and what each gives:
//   one GPU's MTBF taken as the job's (not times the GPUs): gpu_mtbf_hours 3.09
//   the shares against all 466 interruptions, not the 419 unexpected ones: ch11.plan fails
//   (the program's table; this file counts its own shares)
//   longest_checkpoint without the square (M (1 - g - R/M) / 2): 9.28 minutes, not 0.928
//   longest_restart without Young's part (M (1 - g)): 74.2 minutes, not 19.7
#include <doctest/doctest.h>

#include <cmath>

#include "reliability.hpp"

using namespace ch11;

TEST_CASE("Llama 3's snapshot: the job's and one GPU's mean time between failures") {
  const Llama3Snapshot llama;
  CHECK(llama.job_mtbf_hours() == doctest::Approx(1296.0 / 419));  // 3.093 h
  CHECK(llama.gpu_mtbf_hours() == doctest::Approx(50677).epsilon(1e-4));
  CHECK(job_mtbf(50677.0, 16384) == doctest::Approx(3.0931).epsilon(1e-4));
  CHECK(job_mtbf(50677.0, 131072) == doctest::Approx(0.38664).epsilon(1e-4));
}

TEST_CASE("Table 5: the counts add up to 419, and one printed share is not count / 419") {
  int all = 0, gpus = 0, disagree = 0;
  double printed = 0;
  for (const Interruption& row : llama3_interruptions()) {
    all += row.count;
    printed += row.printed;
    if (row.category == "GPU") gpus += row.count;
    const double share = std::round(1000.0 * row.count / 419) / 10;
    if (std::abs(share - row.printed) > 0.05) {
      ++disagree;
      CHECK(row.component == "Faulty GPU");
      CHECK(share == doctest::Approx(35.3));
    }
  }
  CHECK(llama3_interruptions().size() == 18);
  CHECK(all == 419);
  CHECK(gpus == 268);  // 64.0 %, where the text says 58.7 % (the printed rows' sum)
  CHECK(printed == doctest::Approx(94.9));
  CHECK(disagree == 1);
}

TEST_CASE("what keeps the goodput: the longest checkpoint and restart at Young's interval") {
  const double m = 60 * 1296.0 / 419;  // Llama 3's job, minutes: 185.58
  // Without restarts, 90 %: sqrt(2 d / M) = 0.1, d = M / 200 = 0.9279 min.
  CHECK(longest_checkpoint(0.90, 0, m) == doctest::Approx(0.92792).epsilon(1e-4));
  // A 10-minute restart takes R / M = 0.053885; 0.046115^2 M / 2 = 0.19732 min.
  CHECK(longest_checkpoint(0.90, 10, m) == doctest::Approx(0.19732).epsilon(1e-4));
  CHECK(longest_checkpoint(0.95, 10, m) == 0);  // the restart alone wastes 5.4 %
  CHECK(longest_checkpoint(0.95, 0, m) == doctest::Approx(0.23198).epsilon(1e-4));
  // The waste of a 1-minute checkpoint and a 10-minute restart: 0.10381 + 0.053885.
  CHECK(waste_at_young(1, 10, m) == doctest::Approx(0.15770).epsilon(1e-4));
  // 2,048 GPUs: M = 1484.6 min; 95 %: 74.23 - sqrt(2 x 1484.6) = 74.23 - 54.49 = 19.74.
  CHECK(longest_restart(0.95, 1, 8 * m) == doctest::Approx(19.74).epsilon(1e-3));
  CHECK(longest_restart(0.95, 1, m) == 0);
}
