// Chapter 07 solution: top-k routing with capacity, and the dispatch plan's two halves.
#include "routing.hpp"

#include <algorithm>
#include <cmath>

#include "shardlab/check.hpp"

using namespace shardlab;

namespace ch07 {

Routing route(const Tensor& probs, int k, int capacity) {
  const int T = static_cast<int>(probs.rows()), E = static_cast<int>(probs.cols());
  require(k >= 1 && k <= E && capacity >= 1, [&] {
    return "route: k = " + std::to_string(k) + " of " + std::to_string(E) + " experts, capacity " +
           std::to_string(capacity);
  });
  Routing r{T,
            E,
            k,
            capacity,
            std::vector<int>(static_cast<std::size_t>(T * k)),
            std::vector<float>(static_cast<std::size_t>(T * k)),
            std::vector<int>(static_cast<std::size_t>(T * k), -1)};
  // 1. Each token's k best experts, best first; gates renormalised over them for k > 1.
  std::vector<int> order(static_cast<std::size_t>(E));
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) order[static_cast<std::size_t>(e)] = e;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return probs(t, a) > probs(t, b);
    });  // ties: lower index first
    float sum = 0;
    for (int j = 0; j < k; ++j) sum += probs(t, order[static_cast<std::size_t>(j)]);
    for (int j = 0; j < k; ++j) {
      const int e = order[static_cast<std::size_t>(j)];
      r.expert[static_cast<std::size_t>(r.at(t, j))] = e;
      r.gate[static_cast<std::size_t>(r.at(t, j))] = k == 1 ? probs(t, e) : probs(t, e) / sum;
    }
  }
  // 2. Slots: first choices of every token in position order, then second choices, ...
  std::vector<int> filled(static_cast<std::size_t>(E), 0);
  for (int j = 0; j < k; ++j)
    for (int t = 0; t < T; ++t) {
      const auto c = static_cast<std::size_t>(r.at(t, j));
      int& n = filled[static_cast<std::size_t>(r.expert[c])];
      if (n < capacity) r.slot[c] = n++;
    }
  return r;
}

Dispatch plan_dispatch(const Routing& r, int ranks) {
  require(ranks >= 1 && r.experts % ranks == 0, [&] {
    return "plan_dispatch: " + std::to_string(r.experts) + " experts over " +
           std::to_string(ranks) + " ranks";
  });
  const int per = r.experts / ranks;  // experts per rank
  // Every kept choice by expert, each expert's by slot: the order they are sent in (the
  // experts of rank 0 first, so by destination rank too).
  std::vector<std::vector<int>> by_expert(static_cast<std::size_t>(r.experts));
  for (auto& v : by_expert) v.assign(static_cast<std::size_t>(r.capacity), -1);
  for (int c = 0; c < r.tokens * r.k; ++c)
    if (r.slot[static_cast<std::size_t>(c)] >= 0)
      by_expert[static_cast<std::size_t>(r.expert[static_cast<std::size_t>(c)])]
               [static_cast<std::size_t>(r.slot[static_cast<std::size_t>(c)])] = c;
  Dispatch d;
  d.send_counts.assign(static_cast<std::size_t>(ranks), 0);
  for (int e = 0; e < r.experts; ++e) {
    std::size_t n = 0;
    for (int c : by_expert[static_cast<std::size_t>(e)])
      if (c >= 0) d.send_order.push_back(c), ++n;
    d.per_expert.push_back(n);
    d.send_counts[static_cast<std::size_t>(e / per)] += n;
  }
  return d;
}

Arrivals plan_arrivals(const std::vector<std::size_t>& counts, int ranks) {
  require(ranks >= 1 && counts.size() % static_cast<std::size_t>(ranks) == 0, [&] {
    return "plan_arrivals: " + std::to_string(counts.size()) + " counts from " +
           std::to_string(ranks) + " ranks";
  });
  const std::size_t per = counts.size() / static_cast<std::size_t>(ranks);
  Arrivals a;
  a.recv_counts.assign(static_cast<std::size_t>(ranks), 0);
  a.expert_rows.resize(per);
  int row = 0;  // the receive buffer, rank after rank, each rank's expert after expert
  for (std::size_t q = 0; q < static_cast<std::size_t>(ranks); ++q)
    for (std::size_t l = 0; l < per; ++l) {
      const std::size_t n = counts[q * per + l];
      a.recv_counts[q] += n;
      for (std::size_t i = 0; i < n; ++i) a.expert_rows[l].push_back(row++);
    }
  return a;
}

}  // namespace ch07
