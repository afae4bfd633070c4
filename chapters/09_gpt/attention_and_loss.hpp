// Chapter 09's exercise API: the two pieces of a GPT that tensor parallelism cuts in a way
// of their own (Shoeybi et al. 2019, "Megatron-LM", §3 and Figure 3):
//
//   attention   the heads are independent, so tp ranks split them: rank i holds heads
//               [i H/t, (i + 1) H/t), the columns of c_attn (q, k and v) that belong to
//               them (column-parallel: f before it), and the rows of c_proj that read
//               their outputs (row-parallel: g after it). One allreduce forward, one
//               backward, and no rank ever holds another's heads.
//   the loss    the vocabulary is split too (the LM head's columns, the embedding's rows),
//               so each tp rank holds V/t of every token's logits. The cross-entropy
//               needs the softmax over all V: the ranks agree on each row's maximum, on
//               the sum of exp(logit - max) and on the target's logit (three allreduces of
//               one number per row), instead of gathering rows x V logits.
//
// Names: C channels, H heads of D = C / H, T tokens per sequence, V the vocabulary, t tp
// ranks, n rows (tokens) of a microbatch.
// The learner writes parallel_attention and the cross-entropy in
// exercises/09_gpt/attention_and_loss.cpp; the reference is
// solutions/09_gpt/attention_and_loss.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "context.hpp"
#include "shardlab/comm.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/tensor.hpp"
#include "tensor_parallel.hpp"

namespace ch09 {

namespace nn = shardlab::nn;
using shardlab::Communicator;
using shardlab::ShardRange;
using shardlab::Tensor;

/// The model's shape: GPT-2's architecture at a size two cores train in minutes.
struct GptShape {
  int layers = 4;               ///< L blocks
  std::int64_t channels = 128;  ///< C, the width of the residual stream
  std::int64_t heads = 4;       ///< H attention heads, of D = C / H channels each
  std::int64_t context = 64;    ///< T: tokens per sequence, and the learned positions
  std::int64_t vocab = 256;     ///< V: bytes
  std::uint64_t seed = 0;       ///< every initial weight derives from it
  /// E: the experts of a Mixture-of-Experts MLP (chapter 07) in every moe_every-th block,
  /// from block 0 (Megatron-LM's --moe-layer-freq); 0: every MLP dense (GPT-2).
  int experts = 0;
  int top_k = 2;                 ///< k: experts a token goes to (1: Switch, 2: GShard)
  int moe_every = 1;             ///< 1: every block's MLP a MoE; 2: every other block's
  double capacity_factor = 1.0;  ///< an expert takes ceil(k T / E x this) of a sequence's tokens
  double aux_alpha = 0.01;       ///< the load-balancing loss's weight (Switch Transformer's alpha)
  /// Whether block b's MLP is a Mixture of Experts.
  bool moe(int block) const { return experts > 0 && block % moe_every == 0; }
};

/// The seed of block b's parameter `which` (0 c_attn, 1 attention's c_proj, 2 c_fc, 3 the
/// MLP's c_proj, 4 a MoE MLP's router; block -1: the embeddings): the same for the
/// one-device model and every
/// shard of it.
std::uint64_t param_seed(const GptShape& shape, int block, int which);
/// GPT-2's scaling of a residual branch's output projection: 1 / sqrt(2 L).
float residual_scale(const GptShape& shape);

/// How a block is built besides its shape.
struct BlockOptions {
  /// Its column- and row-parallel layers': sequence parallelism, mixed precision (chapter
  /// 08's tensor_parallel.hpp).
  ch08::TpOptions tp;
  /// Selective recomputation: the attention's core keeps nothing for the backward but its
  /// input, and runs again there (an nn::Checkpoint).
  bool recompute_core = false;
  /// Context parallelism (context.hpp): each rank holds some of every sequence's tokens,
  /// and the core attends across the ranks of `cp` as `context` makes it (chapter 10's
  /// ring). nullptr: every rank holds whole sequences.
  const ContextParallel* context = nullptr;
  /// The cp communicator the core runs on (with `context`).
  Communicator* cp = nullptr;
};
/// The attention's core over `heads` heads of shape.context tokens: an
/// nn::CausalSelfAttention (options.context: the one it makes over *options.cp), inside
/// an nn::Checkpoint when options.recompute_core.
std::shared_ptr<nn::Layer> attention_core(std::int64_t heads, const GptShape& shape,
                                          const BlockOptions& options = {});

/// Block b's attention on one device, parameters named name.ln_1, name.attn.c_attn,
/// name.attn.c_proj:
///   x + c_proj(attention(c_attn(ln_1(x))))
/// c_attn is C x 3C with each head's q, k, v side by side (nn::CausalSelfAttention's
/// layout), seeded param_seed(b, 0); c_proj is C x C, seeded param_seed(b, 1), its initial
/// weights times residual_scale. Both have biases.
nn::Residual attention_block(nn::ParameterStore& store, const std::string& name,
                             const GptShape& shape, int block);

// ---------------------------------------------------------------------------
// The exercise

// [exercise]
/// The same block on the tp ranks of `tp`, rank i computing heads [i H/t, (i + 1) H/t)
/// and holding only the parameters those heads need (whole, or its part of them). The
/// same names and seeds as attention_block, so that on any t it starts from the same
/// weights and every rank returns the same y and the same gradients of x as the block on
/// one device. Its tensor-parallel layers are built with options.tp, its core with
/// attention_core. UsageError unless t divides H.
nn::Residual parallel_attention(nn::ParameterStore& store, Communicator& tp,
                                const std::string& name, const GptShape& shape, int block,
                                const BlockOptions& options = {});

/// What the vocabulary-parallel cross-entropy keeps for its backward.
struct VocabLoss {
  double value = 0;    ///< sum over the rows of -log softmax(row)[target], / denominator
  Tensor probs;        ///< n x V_i: this rank's columns of each row's softmax over all V
  Tensor targets;      ///< i32 [n]: the target of each row (a token of the whole vocabulary)
  ShardRange vocab;    ///< the columns this rank holds: tokens [offset, offset + length)
  double denominator;  ///< what the sum was divided by
};

/// The cross-entropy of logits split by columns over the tp ranks: `logits` is n x V_i,
/// this rank's columns `vocab` of the n x V logits; `targets` is i32 [n] (ids of the
/// whole vocabulary). Every tp rank returns the same value,
///   sum over rows of (log sum_v exp(logit_v) - logit_target) / denominator,
/// computed stably (no exponential of a number above 0, whatever the logits), and this
/// rank's columns of the softmax for the backward. No rank ever holds a whole row: what
/// the tp ranks exchange is a few numbers per row, never logits.
VocabLoss vocab_parallel_cross_entropy(Communicator& tp, const Tensor& logits,
                                       const Tensor& targets, ShardRange vocab, double denominator);
/// dL/dlogits for this rank's columns: (softmax - one_hot(target)) / denominator, n x V_i.
/// No communication: every rank has what it needs. `saved` is left as it was.
Tensor vocab_parallel_cross_entropy_backward(const VocabLoss& saved);
// [exercise]

}  // namespace ch09
