// Chapter 07's exercise API: top-k routing with expert capacity, and the two halves of
// expert parallelism's dispatch plan.
//
// As Megatron-LM and DeepSpeed do it, each rank routes its own tokens: the router's
// probabilities of the T_r tokens it holds, a capacity C from T_r, and the slots in
// each expert's buffer for those tokens alone. Then the ranks exchange counts (an
// all-to-all of E/N numbers per pair: how many rows each expert will get from each rank),
// and then the rows themselves (an all-to-all(v)).
//
// Names: T_r = this rank's tokens, E = experts, k = experts per token, C = capacity
// (tokens per expert, from this rank), N = ranks; rank q holds experts q E/N .. (q + 1)
// E/N - 1 ("local expert l" of rank q is expert q E/N + l). A "choice" (t, j) is token
// t's j-th best expert, j = 0..k-1, stored at index t k + j (t counted on this rank).
#pragma once

#include <cstddef>
#include <vector>

#include "shardlab/tensor.hpp"

namespace ch07 {

using shardlab::Tensor;

/// Every choice of the tokens routed: their experts, gates and slots. Vectors of T k
/// entries (T: the tokens given to route(), this rank's).
struct Routing {
  int tokens = 0;           ///< T, the tokens routed
  int experts = 0;          ///< E
  int k = 1;                ///< choices per token
  int capacity = 0;         ///< C, the slots of each expert's buffer for these tokens
  std::vector<int> expert;  ///< the expert of choice (t, j)
  /// Its weight in the output: p / (sum of t's k chosen p) for k > 1, p for k = 1.
  std::vector<float> gate;
  /// Its row in the expert's buffer from this rank, 0..C-1, or -1: dropped.
  std::vector<int> slot;
  /// The index of choice (t, j) in expert, gate and slot: t k + j.
  int at(int t, int j) const { return t * k + j; }
};

/// C = ceil(k T / E x capacity_factor) (Switch Transformer eq. 3, rounded up as
/// Megatron-LM and DeepSpeed do), for the T tokens one rank routes; at least 1, at most
/// T (an expert never gets a token twice). DeepSpeed floors it at min_capacity (4 by
/// default) instead of 1.
int expert_capacity(int tokens, int k, int experts, double capacity_factor);

// [exercise]
/// Top-k routing with capacity, for the router probabilities of T tokens (T x E, f32, each
/// row sums to 1):
///   - token t's choices are its k largest probabilities, best first (a tie goes to the
///     lower expert index);
///   - gates: for k > 1 renormalised over the k choices, before any drop (GShard;
///     Megatron-LM's softmax over the k chosen logits is the same); for k = 1 the
///     probability itself (Switch);
///   - slots: each expert's buffer fills in this order — every token's first choice, by
///     token position, then every token's second choice, by position, and so on
///     (DeepSpeed's top2gating); the choices that find their expert's C slots full are
///     dropped (slot -1): they add nothing, and a token none of whose choices got a slot
///     passes through the layer unchanged (the residual).
Routing route(const Tensor& probs, int k, int capacity);

/// What this rank sends, from its own routing:
///   per_expert[e]  its kept choices (slot >= 0) for expert e: entries [q E/N, (q+1) E/N)
///                  are what it tells rank q in the exchange of counts
///   send_counts[q] rows it sends to rank q: the kept choices whose expert lives on q
///   send_order     those choices (indices t k + j), in the order they are sent: by
///                  destination rank, then expert, then slot
/// The combine sends the experts' outputs back the same way: the rows come back in
/// send_order.
struct Dispatch {
  std::vector<std::size_t> per_expert;   ///< per expert: its kept choices (E entries)
  std::vector<std::size_t> send_counts;  ///< per rank: the rows sent to it (N entries)
  std::vector<int> send_order;           ///< the kept choices t k + j, in the order they are sent
};
/// The Dispatch of this rank's routing `mine` over `ranks` ranks. Error unless `ranks`
/// divides E.
Dispatch plan_dispatch(const Routing& mine, int ranks);

/// Where the rows this rank receives go, from the counts the other ranks sent it:
/// counts[q (E/N) + l] = the rows rank q sends for local expert l (the exchange's output,
/// N blocks of E/N). The receive buffer holds rank 0's rows, then rank 1's, ...; each
/// rank's by expert, then slot (send_order on the sending side).
///   recv_counts[q]  rows from rank q
///   expert_rows[l]  local expert l's rows in the receive buffer, in the order it runs
///                   them: by source rank, then slot (the one-device reference's order)
struct Arrivals {
  std::vector<std::size_t> recv_counts;       ///< per rank: the rows from it
  std::vector<std::vector<int>> expert_rows;  ///< per local expert: its rows, in its order
};
/// The Arrivals of the `counts` this rank received from `ranks` ranks (N blocks of E/N).
/// Error unless `ranks` divides their number.
Arrivals plan_arrivals(const std::vector<std::size_t>& counts, int ranks);
// [exercise]

}  // namespace ch07
