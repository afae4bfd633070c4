// Chapter 07's exercise API: top-k routing with expert capacity, and the dispatch plan of
// expert parallelism.
//
// Names: T = tokens (of the whole batch, every rank's), E = experts, k = experts per
// token, C = capacity (tokens per expert), N = ranks; rank q holds tokens
// shard_range(T, N, q) and experts q E/N .. (q + 1) E/N - 1. A "choice" (t, j) is token
// t's j-th best expert, j = 0..k-1, stored at index t k + j.
#pragma once

#include <cstddef>
#include <vector>

#include "shardlab/tensor.hpp"

namespace ch07 {

using shardlab::Tensor;

/// Every token's choices: their experts, gates and slots. Vectors of T k entries.
struct Routing {
  int tokens = 0, experts = 0, k = 1, capacity = 0;
  std::vector<int> expert;  // the expert of choice (t, j)
  std::vector<float>
      gate;  // its weight in the output: p / (sum of t's k chosen p) for k > 1, p for k = 1
  std::vector<int> slot;  // its row in the expert's buffer, 0..C-1, or -1: dropped
  int at(int t, int j) const { return t * k + j; }
};

/// C = ceil(k T / E x capacity_factor) (Switch Transformer eq. 3, rounded up as Megatron-LM
/// and DeepSpeed do), at least 1.
int expert_capacity(int tokens, int k, int experts, double capacity_factor);

/// Top-k routing with capacity, for the router probabilities of all T tokens (T x E,
/// f32, each row sums to 1):
///   - token t's choices are its k largest probabilities, best first (a tie goes to the
///     lower expert index);
///   - gates: for k > 1 renormalised over the k choices (GShard); for k = 1 the
///     probability itself (Switch);
///   - slots: each expert's buffer fills in this order — every token's first choice, by
///     token position, then every token's second choice, by position, and so on; the
///     choices that find their expert's C slots full are dropped (slot -1): they add
///     nothing, and a token none of whose choices got a slot passes through the layer
///     unchanged (the residual).
Routing route(const Tensor& probs, int k, int capacity);

/// What rank `rank` sends and receives in the dispatch all-to-all, from the routing of
/// every token (every rank computes the same routing, so both sides agree on the order
/// without exchanging it):
///   send_counts[q]   rows this rank sends to rank q: its tokens' kept choices whose
///                    expert lives on q
///   send_order       those choices (indices t k + j), in the order they are sent: by
///                    destination rank, then expert, then slot
///   recv_counts[q]   rows this rank receives from rank q: rank q's tokens' kept choices
///                    whose expert lives here
///   recv_choice      the choices received (indices t k + j), in the order they arrive:
///                    by source rank, then expert, then slot
/// The combine all-to-all is the same exchange backwards: counts swapped, orders kept.
struct Dispatch {
  std::vector<std::size_t> send_counts, recv_counts;
  std::vector<int> send_order, recv_choice;
};
Dispatch plan_dispatch(const Routing& routing, int rank, int ranks);

}  // namespace ch07
