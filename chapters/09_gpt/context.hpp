// Chapter 09 with context parallelism: what the GPT needs of a sequence cut over the cp
// ranks of the mesh (Liu et al. 2023, "Ring Attention with Blockwise Transformers";
// Megatron-LM's --context-parallel-size).
//
// Every layer of the GPT but one works on each token alone: the embeddings, the
// LayerNorms, the Linears, the MLPs (and their experts), the head and the loss. So a rank
// that holds some of a sequence's tokens runs all of them on those tokens, and only the
// attention's core, where each query meets every earlier key, has to reach the other
// ranks. A ContextParallel says which tokens a rank holds and makes that core. Chapter 10
// provides one, its ring attention with the zigzag split (ch10::ring_context): the
// capstone's program passes it in, so this chapter needs nothing of a later one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/nn.hpp"

namespace ch09 {

/// How a sequence of T tokens is cut over the cp ranks, and the attention that spans the
/// cut.
class ContextParallel {
 public:
  virtual ~ContextParallel() = default;
  /// What it is, for the run's description: "ring attention (chapter 10), zigzag split".
  virtual std::string name() const = 0;
  /// UsageError unless a sequence of T tokens cuts over `cp` ranks.
  virtual void check(std::int64_t T, int cp) const = 0;
  /// The positions (0 .. T-1) of the tokens rank `rank` of `cp` holds of every sequence,
  /// in the order it holds them.
  virtual std::vector<std::int64_t> positions(std::int64_t T, int cp, int rank) const = 0;
  /// The attention's core over `heads` heads, a collective over `cp`: its input is this
  /// rank's rows of whole sequences (each sequence's positions() in turn) with each head's
  /// q, k and v side by side (n x 3 heads D, nn::CausalSelfAttention's layout), its output
  /// those rows' attention over every earlier token of their sequence (n x heads D).
  virtual std::shared_ptr<shardlab::nn::Layer> core(shardlab::Communicator& cp, std::int64_t heads,
                                                    std::int64_t T) const = 0;
  /// Bytes a rank sends over cp in one forward of the core, for `sequences` sequences of T
  /// tokens with `heads` heads of `head_dim` (the rank's).
  virtual std::uint64_t forward_bytes(int cp, std::int64_t T, std::int64_t sequences,
                                      std::int64_t heads, std::int64_t head_dim) const = 0;
  /// The same for one backward.
  virtual std::uint64_t backward_bytes(int cp, std::int64_t T, std::int64_t sequences,
                                       std::int64_t heads, std::int64_t head_dim) const = 0;
  /// Floats the core keeps for its backward per token and head, besides its input and
  /// output (which the Linears around it keep anyway): the softmax's H T weights for one
  /// device's attention, one log-sum-exp for the ring.
  virtual double kept_per_token_and_head(std::int64_t T) const = 0;
};

}  // namespace ch09
