// Chapter 10 solution: the online softmax's merge and the zigzag assignment
// (ring_attention.hpp).
#include <cmath>

#include "ring_attention.hpp"
#include "shardlab/check.hpp"

namespace ch10 {

void merge(Partial& into, const Partial& other) {
  shardlab::require(
      into.rows == other.rows && into.heads == other.heads && into.head_dim == other.head_dim,
      "merge: two partials of different shapes");
  const std::int64_t D = into.head_dim;
  for (std::int64_t i = 0; i < into.rows * into.heads; ++i) {
    const auto r = static_cast<std::size_t>(i);
    const float m = std::max(into.max[r], other.max[r]);
    if (m == -INFINITY) continue;  // neither has seen a key
    // Each side's terms were taken relative to its own max: bring both to the new one.
    const float a = std::exp(into.max[r] - m), b = std::exp(other.max[r] - m);
    into.sum[r] = a * into.sum[r] + b * other.sum[r];
    for (std::int64_t d = 0; d < D; ++d) {
      const auto e = static_cast<std::size_t>(i * D + d);
      into.out[e] = a * into.out[e] + b * other.out[e];
    }
    into.max[r] = m;
  }
}

std::vector<int> zigzag_chunks(int cp, int rank) {
  shardlab::require(cp >= 1 && rank >= 0 && rank < cp, "zigzag_chunks: rank out of range");
  return {rank, 2 * cp - 1 - rank};
}

}  // namespace ch10
