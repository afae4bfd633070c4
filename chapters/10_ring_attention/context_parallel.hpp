// Chapter 10's ring attention as the attention of chapter 09's GPT: the capstone's cp axis.
//
// Chapter 09's GPT runs every layer on the tokens a rank holds, and asks a
// ch09::ContextParallel for the one layer that needs the others' tokens: the attention's
// core, between c_attn (each head's q, k and v side by side) and c_proj. Here that core is
// the ring of ring_attention.hpp, over the mesh's cp ranks, every sequence of a microbatch
// passed in one block a step, cut by the zigzag split so that every rank does the same
// causal work. `ch09_gpt --cp N` runs on it.
#pragma once

#include <memory>

#include "context.hpp"
#include "ring_attention.hpp"

namespace ch10 {

/// The GPT's attention core on the ring `cp`: its input is this rank's rows of whole
/// sequences (T/cp of each, at rank_positions, one sequence after another), 3 heads D
/// columns with each head's q, k and v side by side; its output, those rows' causal
/// attention over every earlier token of their sequence, heads D columns. Forward and
/// backward are collectives over `cp` (ring_attention and ring_attention_backward). It
/// keeps its input and output (which c_attn and c_proj keep anyway: the same tensors) and
/// a log-sum-exp per row and head.
class RingAttentionCore final : public shardlab::nn::Layer {
 public:
  /// Over `heads` heads of sequences of T tokens, cut as `split` says.
  RingAttentionCore(Communicator& cp, std::int64_t heads, std::int64_t T,
                    Split split = Split::zigzag, bool overlap = true);
  /// "ring attention".
  std::string name() const override { return "ring attention"; }
  shardlab::nn::Forward forward(const shardlab::Tensor& x) const override;
  shardlab::Tensor backward_input(const shardlab::Tensor& dy,
                                  shardlab::nn::Saved& saved) const override;

 private:
  /// The RingShape of an input of `rows` rows and `columns` columns (3 heads D).
  RingShape shape_of(std::int64_t rows, std::int64_t columns) const;

  Communicator& cp_;
  std::int64_t heads_, T_;
  Split split_;
  bool overlap_;
};

/// Chapter 09's ContextParallel made of the ring: the zigzag split's positions, the
/// RingAttentionCore, and ring_forward_bytes / ring_backward_bytes for its bytes. `overlap`:
/// each block passed on while the rank computes (RingShape::overlap; --overlap cp).
std::shared_ptr<const ch09::ContextParallel> ring_context(Split split = Split::zigzag,
                                                          bool overlap = true);

}  // namespace ch10
