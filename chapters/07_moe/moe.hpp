// Chapter 07's Mixture-of-Experts layer, on one device and expert-parallel on ranks.
//
//   y = x + sum over t's kept choices j of gate_j * expert_{e_j}(x)
//   expert_e(x) = tanh(x W1_e) W2_e           (d -> h -> d, no biases)
//   router: p = softmax(x Wr) over E experts  (d x E), then route() (routing.hpp)
//   aux loss = alpha E sum_i f_i P_i          (Switch Transformer eqs. 4-6): f_i the
//     fraction of tokens whose first choice is expert i, P_i the mean of p_i over tokens
//
// Backward: given dL/dy (any cotangent), dL/dx, dL/dWr (through the gates, their
// renormalisation, the softmax, and the aux loss with f held constant, as in Switch) and
// every expert's dL/dW1, dL/dW2.
//
// On ranks (moe_parallel): rank q holds the router (replicated), experts q E/N ..
// (q + 1) E/N - 1 and tokens shard_range(T, N, q). The router's probabilities are
// all-gathered (T x E floats) so that every rank routes every token alike; then the
// tokens go to their experts' ranks in one all-to-all(v), come back in another, and the
// backward does the same with the gradients.
#pragma once

#include <cstdint>
#include <vector>

#include "routing.hpp"
#include "shardlab/comm.hpp"
#include "shardlab/tensor.hpp"

namespace ch07 {

using shardlab::Communicator;

struct MoeConfig {
  int tokens = 64;  // T, all ranks together
  int hidden = 16;  // d
  int ffn = 32;     // h
  int experts = 8;  // E
  int k = 2;
  double capacity_factor = 1.0;
  double aux_alpha = 0.01;
  std::uint64_t seed = 0;
  int capacity() const { return expert_capacity(tokens, k, experts, capacity_factor); }
};

/// The router and the experts `first` .. `first + count - 1` (f32, on the host).
struct Weights {
  Tensor router;               // d x E
  int first = 0;               // the first expert held
  std::vector<Tensor> w1, w2;  // per expert held: d x h, h x d
};
/// The same weights on every rank and in the reference: expert e's from its own seed.
Weights make_weights(const MoeConfig& config, int first, int count);

struct Result {
  Tensor y;        // the outputs of the tokens given (host, f32)
  Routing routing; // of every token
  double aux_loss = 0;
  std::vector<int> wanted, kept;  // choices per expert, before and after capacity
  int dropped = 0;                // choices dropped, in all
  int passed_through = 0;         // tokens none of whose choices was kept
  // Gradients (when a dL/dy was given): of the tokens given, the router (summed over all
  // tokens), the experts held.
  Tensor dx, drouter;
  std::vector<Tensor> dw1, dw2;
  // Communication of this rank (moe_parallel): all-to-all bytes received, forward and
  // backward together.
  std::uint64_t alltoall_received = 0;
  bool traffic_modeled = false;
};

/// The whole layer on one device, every token.
Result moe_reference(const MoeConfig& config, const Weights& all, const Tensor& x, const Tensor& dy);

/// The layer expert-parallel: this rank's tokens `x` (and `dy`, or an empty tensor for
/// forward only), its experts in `mine`.
Result moe_parallel(Communicator& comm, const MoeConfig& config, const Weights& mine, const Tensor& x,
                    const Tensor& dy, shardlab::Memory memory);

}  // namespace ch07
