// Chapter 11 reference: when to checkpoint, and where a restarted run goes on from.
#include "recovery.hpp"

#include <cmath>

namespace ch11 {

double young_interval(double checkpoint_s, double mtbf_s) {
  return std::sqrt(2 * checkpoint_s * mtbf_s);
}

double daly_interval(double checkpoint_s, double mtbf_s) {
  if (checkpoint_s >= 2 * mtbf_s) return mtbf_s;
  const double x = checkpoint_s / (2 * mtbf_s);
  return std::sqrt(2 * checkpoint_s * mtbf_s) * (1 + std::sqrt(x) / 3 + x / 9) - checkpoint_s;
}

double expected_waste(double interval_s, double checkpoint_s, double restart_s, double mtbf_s) {
  return checkpoint_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s;
}

ResumePoint resume_point(int every, int failed_at) {
  const int step = every > 0 ? failed_at / every * every : 0;
  return {step, failed_at + 1 - step};
}

}  // namespace ch11
