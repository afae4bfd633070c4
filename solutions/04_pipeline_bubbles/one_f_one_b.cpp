// Chapter 04, reference solution: the 1F1B schedule.
#include <algorithm>

#include "schedule.hpp"

namespace ch04 {

Schedule one_f_one_b(int stages, int microbatches) {
  const int p = stages, m = microbatches;
  Schedule s{"1f1b", p, m, 1, {}};
  s.ops.resize(static_cast<std::size_t>(p));
  for (int st = 0; st < p; ++st) {
    auto& ops = s.ops[static_cast<std::size_t>(st)];
    // Warm-up: enough forwards to fill the stages after this one.
    const int warmup = std::min(p - st - 1, m);
    for (int j = 0; j < warmup; ++j) ops.push_back({OpKind::forward, j});
    // Steady state: one in, one out.
    for (int i = 0; i < m - warmup; ++i) {
      ops.push_back({OpKind::forward, warmup + i});
      ops.push_back({OpKind::backward, i});
    }
    // Cool-down: the backwards still owed.
    for (int j = m - warmup; j < m; ++j) ops.push_back({OpKind::backward, j});
  }
  return s;
}

}  // namespace ch04
