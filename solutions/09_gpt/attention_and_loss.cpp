// Chapter 09 solution: tensor-parallel attention and the vocabulary-parallel cross-entropy
// (attention_and_loss.hpp).
#include "attention_and_loss.hpp"

#include <cmath>
#include <string>

#include "shardlab/check.hpp"
#include "tensor_parallel.hpp"

namespace ch09 {

using shardlab::ReduceOp;
using shardlab::require;
using shardlab::Shape;

nn::Residual parallel_attention(nn::ParameterStore& store, Communicator& tp,
                                const std::string& name, const GptShape& shape, int block,
                                const BlockOptions& options) {
  const int t = tp.size();
  shardlab::require_usage(shape.heads % t == 0, "--tp " + std::to_string(t) + " must divide the " +
                                                    std::to_string(shape.heads) + " heads");
  const std::int64_t C = shape.channels;
  nn::Sequential inner;
  inner.add<nn::LayerNorm>(store, name + ".ln_1", C);
  // 3C columns, each head's q, k, v side by side: rank i's 3C/t contiguous columns are
  // whole heads, and the bias is cut with them.
  inner.add<ch08::ColumnParallelLinear>(store, tp, name + ".attn.c_attn", C, 3 * C,
                                        param_seed(shape, block, 0), true, options.tp);
  inner.add(attention_core(shape.heads / t, shape, options));
  // The rows of c_proj that read this rank's heads; the partial sums added by g, then
  // the bias once.
  inner.add<ch08::RowParallelLinear>(store, tp, name + ".attn.c_proj", C, C,
                                     param_seed(shape, block, 1), true, residual_scale(shape),
                                     options.tp);
  return nn::Residual(std::move(inner));
}

VocabLoss vocab_parallel_cross_entropy(Communicator& tp, const Tensor& logits,
                                       const Tensor& targets, ShardRange vocab,
                                       double denominator) {
  require(logits.ndim() == 2 && logits.cols() == vocab.length && targets.size() == logits.rows() &&
              targets.dtype() == shardlab::DType::i32,
          [&] {
            return "vocab_parallel_cross_entropy: logits " + logits.describe() + ", targets " +
                   targets.describe() + "; expected n x " + std::to_string(vocab.length) +
                   " and i32 [n]";
          });
  const std::int64_t n = logits.rows(), V = logits.cols();
  const float* l = logits.data();
  const std::int32_t* target = targets.data<std::int32_t>();
  // 1. Each row's maximum over the whole vocabulary: the largest of the ranks' maxima.
  Tensor top(Shape{n}, shardlab::DType::f32);
  for (std::int64_t r = 0; r < n; ++r) {
    float m = -INFINITY;
    for (std::int64_t v = 0; v < V; ++v) m = std::max(m, l[r * V + v]);
    top[r] = m;
  }
  tp.allreduce(top, ReduceOp::max);
  // 2. The sum of exp(logit - max) over the whole vocabulary, and the target's logit
  // (minus the max) from the one rank that holds it: sums over the ranks.
  VocabLoss out{
      .probs = Tensor(n, V), .targets = targets, .vocab = vocab, .denominator = denominator};
  Tensor sum = shardlab::zeros(Shape{n}), picked = shardlab::zeros(Shape{n});
  float* p = out.probs.data();
  for (std::int64_t r = 0; r < n; ++r) {
    float s = 0;
    for (std::int64_t v = 0; v < V; ++v) s += p[r * V + v] = std::exp(l[r * V + v] - top[r]);
    sum[r] = s;
    const std::int64_t mine = target[r] - vocab.offset;
    if (mine >= 0 && mine < V) picked[r] = l[r * V + mine] - top[r];
  }
  tp.allreduce(sum, ReduceOp::sum);
  tp.allreduce(picked, ReduceOp::sum);
  // 3. The loss, and this rank's columns of the softmax.
  double total = 0;
  for (std::int64_t r = 0; r < n; ++r) {
    total += std::log(static_cast<double>(sum[r])) - picked[r];
    for (std::int64_t v = 0; v < V; ++v) p[r * V + v] /= sum[r];
  }
  out.value = total / denominator;
  return out;
}

Tensor vocab_parallel_cross_entropy_backward(const VocabLoss& saved) {
  Tensor d = saved.probs.clone();
  const std::int64_t n = d.rows(), V = d.cols();
  const std::int32_t* target = saved.targets.data<std::int32_t>();
  for (std::int64_t r = 0; r < n; ++r) {
    const std::int64_t mine = target[r] - saved.vocab.offset;
    if (mine >= 0 && mine < V) d(r, mine) -= 1.0f;
  }
  scale_in_place(d, static_cast<float>(1.0 / saved.denominator));
  return d;
}

}  // namespace ch09
