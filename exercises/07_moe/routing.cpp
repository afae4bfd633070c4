// Chapter 07 exercise: top-k routing with capacity, and the dispatch plan.
// Read chapters/07_moe/README.md first (its pictures follow a token through the router
// and the tokens through the all-to-all); check your work with `make check CH=07`, and
// watch your routing run with `build/learner/bin/ch07_moe --ranks 4`.
//
// Names (routing.hpp): T tokens, E experts, k choices per token, C capacity, N ranks;
// choice (t, j) is stored at index t k + j (r.at(t, j)).
//
// Useful:
//   probs(t, e)                          token t's router probability for expert e (f32)
//   probs.rows(), probs.cols()           T and E
//   shard_range(T, N, q)                 the tokens of rank q: .offset, .length
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
// Start from Routing r{T, E, k, capacity, expert(T k), gate(T k), slot(T k, -1)}.
// 1. For every token t: its k best experts, best first (ties: the lower expert index),
//    and their gates (k = 1: the probability; k > 1: probability / the sum of the k).
// 2. Slots: go through j = 0..k-1, and for each j through t = 0..T-1 in order: choice
//    (t, j) takes its expert's next free slot, or is dropped (slot -1) when the expert
//    already has `capacity`.
Routing route(const Tensor& probs, int k, int capacity) {
  (void)probs, (void)k, (void)capacity;
  SHARDLAB_TODO("ch07: route");
}

// TODO(ch07): plan_dispatch
// Experts live E / N per rank: expert e on rank e / (E / N). For every rank q:
//   what this rank sends to q: its own tokens' kept choices (slot >= 0) whose expert is
//   one of q's, ordered by expert, then slot;
//   what it receives from q: q's tokens' kept choices whose expert is one of this rank's,
//   in the same order.
// Append each q's list to send_order / recv_choice in q order, and count them.
Dispatch plan_dispatch(const Routing& routing, int rank, int ranks) {
  (void)routing, (void)rank, (void)ranks;
  SHARDLAB_TODO("ch07: plan_dispatch");
}

}  // namespace ch07
