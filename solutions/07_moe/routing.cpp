// Chapter 07 solution: top-k routing with capacity, and the dispatch plan.
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

Dispatch plan_dispatch(const Routing& r, int rank, int ranks) {
  require(r.experts % ranks == 0, [&] {
    return "plan_dispatch: " + std::to_string(r.experts) + " experts over " +
           std::to_string(ranks) + " ranks";
  });
  const int per = r.experts / ranks;  // experts per rank
  Dispatch d;
  d.send_counts.assign(static_cast<std::size_t>(ranks), 0);
  d.recv_counts.assign(static_cast<std::size_t>(ranks), 0);
  // Every kept choice of the tokens of rank `from`, for the experts of rank `to`, in
  // (expert, slot) order: the order both sides use.
  auto choices = [&](int from, int to) {
    const ShardRange mine = shard_range(r.tokens, ranks, from);
    std::vector<int> out;
    for (int e = to * per; e < (to + 1) * per; ++e) {
      std::vector<std::pair<int, int>> by_slot;  // (slot, choice)
      for (auto t = mine.offset; t < mine.offset + mine.length; ++t)
        for (int j = 0; j < r.k; ++j) {
          const int c = r.at(static_cast<int>(t), j);
          if (r.expert[static_cast<std::size_t>(c)] == e &&
              r.slot[static_cast<std::size_t>(c)] >= 0)
            by_slot.push_back({r.slot[static_cast<std::size_t>(c)], c});
        }
      std::sort(by_slot.begin(), by_slot.end());
      for (const auto& [slot, c] : by_slot) out.push_back(c);
    }
    return out;
  };
  for (int q = 0; q < ranks; ++q) {
    const std::vector<int> send = choices(rank, q), recv = choices(q, rank);
    d.send_counts[static_cast<std::size_t>(q)] = send.size();
    d.recv_counts[static_cast<std::size_t>(q)] = recv.size();
    d.send_order.insert(d.send_order.end(), send.begin(), send.end());
    d.recv_choice.insert(d.recv_choice.end(), recv.begin(), recv.end());
  }
  return d;
}

}  // namespace ch07
