// Chapter 07 exercise: top-k routing with capacity, and the two halves of the dispatch plan.
// Read chapters/07_moe/README.md first (its pictures follow a token through the router
// and the tokens through the exchange of counts and the all-to-all); check your work with
// `make check CH=07`, and watch your routing run with `build/learner/bin/ch07_moe --ranks 4`.
//
// Names (routing.hpp): T tokens (this rank's), E experts, k choices per token, C capacity,
// N ranks, E/N experts per rank; choice (t, j) is stored at index t k + j (r.at(t, j)).
//
// Useful:
//   probs(t, e)                          token t's router probability for expert e (f32)
//   probs.rows(), probs.cols()           T and E
//   std::stable_sort(b, e, less)         keeps equal elements in their order
//
// Stuck? The chapter README's Exercise section has hints, one at a time.
#include "routing.hpp"

#include <algorithm>
#include <cmath>

#include "shardlab/check.hpp"

using namespace shardlab;

namespace ch07 {

// TODO(ch07): route
// Every token's k choices with their gates, and every choice's slot or -1 (routing.hpp
// says in which order the experts' buffers fill). Start from
// Routing r{T, E, k, capacity, expert(T k), gate(T k), slot(T k, -1)}.
Routing route(const Tensor& probs, int k, int capacity) {
  (void)probs, (void)k, (void)capacity;
  SHARDLAB_TODO("ch07: route");
}

// TODO(ch07): plan_dispatch
// From this rank's routing alone: how many rows it sends to every expert and every rank,
// and which choices, in the order the receiving rank expects them (routing.hpp).
Dispatch plan_dispatch(const Routing& mine, int ranks) {
  (void)mine, (void)ranks;
  SHARDLAB_TODO("ch07: plan_dispatch");
}

// TODO(ch07): plan_arrivals
// From the counts the ranks sent this one: how many rows come from each rank, and where
// each local expert's rows sit in the receive buffer.
Arrivals plan_arrivals(const std::vector<std::size_t>& counts, int ranks) {
  (void)counts, (void)ranks;
  SHARDLAB_TODO("ch07: plan_arrivals");
}

}  // namespace ch07
