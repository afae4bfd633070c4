// Chapter 09 exercise: tensor-parallel attention, and the cross-entropy over a vocabulary
// split across the tp ranks.
// Read chapters/09_gpt/README.md first (its picture shows where each tensor lives); check
// your work with `make check CH=09`, then train the GPT on your own code with
// `build/learner/bin/ch09_gpt`.
//
// Part 1, parallel_attention. Chapter 08 gave you ColumnParallelLinear and
// RowParallelLinear, with f and g inside them. The attention block is
//   x + c_proj(attention(c_attn(ln_1(x))))
// Which of its pieces does every tp rank hold whole, which are cut, and along what? How
// many heads does each rank's attention core see? Use the names and seeds that
// attention_block (attention_and_loss.hpp; gpt.cpp) uses, so that every mesh starts from
// the same weights.
//
// Part 2, vocab_parallel_cross_entropy. Each rank holds the columns `vocab` of every
// row's logits. For each row you need log(sum over ALL V of exp(logit)) and the target's
// logit, computed stably (subtract the row's maximum first: which maximum?). Useful:
// `tp.allreduce(t, shardlab::ReduceOp::max)` and `tp.allreduce(t)` (a sum), in place on
// an f32 tensor of n numbers.
//
// Part 3, vocab_parallel_cross_entropy_backward: the gradient from what part 2 saved.
//
// Stuck? The chapter README's Exercise section has hints, one at a time.
#include "attention_and_loss.hpp"

#include "shardlab/check.hpp"

namespace ch09 {

// TODO(ch09): parallel_attention
// Returns this tp rank's share of block `block`: only the parameters its heads need, and
// the same y and dL/dx as attention_block on one device. Its Linears take options.tp (so
// that sequence parallelism and 16-bit products reach them), its core comes from
// attention_core (so that selective recomputation and context parallelism reach it: a
// core built by hand ignores both). A tp that does not divide the heads is refused with
// a shardlab::UsageError (shardlab::require_usage), before anything is built.
nn::Residual parallel_attention(nn::ParameterStore& store, Communicator& tp,
                                const std::string& name, const GptShape& shape, int block,
                                const BlockOptions& options) {
  (void)store, (void)tp, (void)name, (void)shape, (void)block, (void)options;
  SHARDLAB_TODO("ch09: parallel_attention");
}

// TODO(ch09): vocab_parallel_cross_entropy
// Fill in value (the same on every tp rank), probs (n x V_i, this rank's columns of each
// row's softmax over all V), targets, vocab and denominator. A target lies in one rank's
// columns only: `vocab` says which tokens are this rank's.
VocabLoss vocab_parallel_cross_entropy(Communicator& tp, const Tensor& logits,
                                       const Tensor& targets, ShardRange vocab,
                                       double denominator) {
  (void)tp, (void)logits, (void)targets, (void)vocab, (void)denominator;
  SHARDLAB_TODO("ch09: vocab_parallel_cross_entropy");
}

// TODO(ch09): vocab_parallel_cross_entropy_backward
// Returns dL/dlogits of this rank's columns, n x V_i, from `saved` alone (no
// communication). It reads `saved` and leaves it as it was: the caller may read it again
// (and a Tensor copied by assignment shares its storage with the original).
Tensor vocab_parallel_cross_entropy_backward(const VocabLoss& saved) {
  (void)saved;
  SHARDLAB_TODO("ch09: vocab_parallel_cross_entropy_backward");
}

}  // namespace ch09
