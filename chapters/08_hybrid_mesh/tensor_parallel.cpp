// Chapter 08's tensor-parallel layers (tensor_parallel.hpp).
#include "tensor_parallel.hpp"

#include "shardlab/check.hpp"

namespace ch08 {

using shardlab::require;
using shardlab::Shape;
using shardlab::shard_range;

namespace {

/// The one-device Linear's initial weight, from a scratch store (so the cut layers start
/// from exactly what nn::Linear would draw).
Tensor whole_weight(const std::string& name, std::int64_t in, std::int64_t out,
                    std::uint64_t seed) {
  nn::ParameterStore scratch;
  nn::Linear whole(scratch, name, in, out, seed, false);
  return whole.weight().value;
}

ShardRange my_part(std::int64_t size, Communicator& tp, const std::string& name, const char* what) {
  const ShardRange part = shard_range(size, tp.size(), tp.rank());
  require(part.length > 0, [&] {
    return name + ": " + std::to_string(size) + " " + what + " cut over " +
           std::to_string(tp.size()) + " tensor-parallel ranks leaves rank " +
           std::to_string(tp.rank()) + " none";
  });
  return part;
}

}  // namespace

Tensor gather_rows(Communicator& tp, const Tensor& mine) {
  Tensor all(mine.rows() * tp.size(), mine.cols());
  tp.allgather(mine, all);
  return all;
}

Tensor scatter_rows(Communicator& tp, const Tensor& partial) {
  const int t = tp.size();
  require(partial.ndim() == 2 && partial.rows() % t == 0, [&] {
    return "sequence parallelism: " + partial.describe() + " does not split into " +
           std::to_string(t) + " equal parts of rows";
  });
  Tensor mine(partial.rows() / t, partial.cols());
  tp.reduce_scatter(partial, mine, shardlab::ReduceOp::sum);
  return mine;
}

ColumnParallelLinear::ColumnParallelLinear(nn::ParameterStore& store, Communicator& tp,
                                           const std::string& name, std::int64_t in,
                                           std::int64_t out, std::uint64_t seed, bool bias)
    : tp_(tp),
      columns_(my_part(out, tp, name, "columns")),
      inner_(store, name, in, columns_.length, seed, bias) {
  inner_.weight().value = own(whole_weight(name, in, out, seed));
}

Tensor ColumnParallelLinear::own(const Tensor& whole) const {
  return shard(whole, tp_.size(), 1, tp_.rank());
}

nn::Forward ColumnParallelLinear::forward(const Tensor& x) const {
  if (sequence_parallel_) {
    // The whole input for the product, but only this rank's rows kept for the backward.
    nn::Forward f = inner_.forward(gather_rows(tp_, x));
    nn::Saved inner = std::move(f.saved);
    inner.tensors.clear();  // the gathered input: gathered again in the backward
    f.saved = nn::Saved{};
    f.saved.tensors = {x};
    f.saved.children.push_back(std::move(inner));
    return f;
  }
  Tensor in = x.clone();  // f may not touch the caller's activation
  f_forward(tp_, in);
  return inner_.forward(in);
}

void ColumnParallelLinear::set_autocast(shardlab::DType type) {
  inner_.set_autocast({.type = type, .round_output = true, .round_input_grad = false});
  autocast_ = type;
}

Tensor ColumnParallelLinear::backward_input(const Tensor& dy, nn::Saved& saved) const {
  if (sequence_parallel_) {
    require(saved.children.size() == 1 && saved.tensors.size() == 1,
            inner_.name() + ": backward without a forward");
    nn::Saved& inner = saved.children[0];
    // The input again, whole (as the forward's product saw it: rounded under autocast).
    inner.tensors = {shardlab::round_to(gather_rows(tp_, saved.tensors[0]), autocast_)};
    saved.tensors.clear();
    return shardlab::round_to(scatter_rows(tp_, inner_.backward_input(dy, inner)), autocast_);
  }
  Tensor dx = inner_.backward_input(dy, saved);
  f_backward(tp_, dx);
  return shardlab::round_to(dx, autocast_);
}

void ColumnParallelLinear::backward_weight(nn::Saved& saved) {
  if (!sequence_parallel_) return inner_.backward_weight(saved);
  require(saved.children.size() == 1, inner_.name() + ": backward_weight before backward_input");
  inner_.backward_weight(saved.children[0]);
  saved = nn::Saved{};
}

RowParallelLinear::RowParallelLinear(nn::ParameterStore& store, Communicator& tp,
                                     const std::string& name, std::int64_t in, std::int64_t out,
                                     std::uint64_t seed, bool bias, float init_scale)
    : tp_(tp),
      rows_(my_part(in, tp, name, "rows")),
      inner_(store, name, rows_.length, out, seed, false) {
  inner_.weight().value = scale(own(whole_weight(name, in, out, seed)), init_scale);
  if (bias) bias_ = &store.add(name + ".bias", shardlab::zeros(Shape{1, out}));
}

void RowParallelLinear::set_autocast(shardlab::DType type) {
  inner_.set_autocast({.type = type, .round_output = false, .round_input_grad = true});
  autocast_ = type;
}

nn::Forward RowParallelLinear::forward(const Tensor& x) const {
  nn::Forward partial = inner_.forward(x);
  Tensor y = partial.out;
  if (sequence_parallel_)
    y = scatter_rows(tp_, y);  // this rank's rows of the sum
  else
    g_forward(tp_, y);
  if (bias_) add_row(y, shardlab::round_to(bias_->value, autocast_));
  nn::Forward f{shardlab::round_to(y, autocast_), {}};
  f.saved.children.push_back(std::move(partial.saved));
  return f;
}

Tensor RowParallelLinear::backward_input(const Tensor& dy, nn::Saved& saved) const {
  require(saved.children.size() == 1, inner_.name() + ": backward without a forward");
  // The bias's gradient: every row's (sequence parallel: this rank's rows).
  saved.dy = shardlab::round_to(dy, autocast_);
  if (sequence_parallel_)
    return inner_.backward_input(gather_rows(tp_, saved.dy), saved.children[0]);
  Tensor d = saved.dy.clone();  // g may not touch the caller's gradient
  g_backward(tp_, d);
  saved.dy = d;
  return inner_.backward_input(d, saved.children[0]);
}

void RowParallelLinear::backward_weight(nn::Saved& saved) {
  require(saved.children.size() == 1 && saved.dy.defined(),
          inner_.name() + ": backward_weight before backward_input");
  inner_.backward_weight(saved.children[0]);
  if (bias_)
    axpy(1.0f, shardlab::round_to(shardlab::column_sums(saved.dy), autocast_), bias_->grad);
  saved = nn::Saved{};
}

std::vector<nn::Parameter*> RowParallelLinear::parameters() const {
  std::vector<nn::Parameter*> out = inner_.parameters();
  if (bias_) out.push_back(bias_);
  return out;
}

std::uint64_t fc_seed(std::uint64_t seed, int block, int which) {
  return seed * 1000003ULL + static_cast<std::uint64_t>(block) * 2 +
         static_cast<std::uint64_t>(which);
}

nn::Residual parallel_mlp(nn::ParameterStore& store, Communicator& tp, const std::string& name,
                          std::int64_t hidden, std::int64_t ffn, std::uint64_t seed, int block,
                          float out_scale) {
  nn::Sequential inner;
  inner.add<ColumnParallelLinear>(store, tp, name + ".fc1", hidden, ffn, fc_seed(seed, block, 1));
  inner.add<nn::Gelu>();
  inner.add<RowParallelLinear>(store, tp, name + ".fc2", ffn, hidden, fc_seed(seed, block, 2), true,
                               out_scale);
  return nn::Residual(std::move(inner));
}

nn::Residual mlp_block(nn::ParameterStore& store, const std::string& name, std::int64_t hidden,
                       std::int64_t ffn, std::uint64_t seed, int block, float out_scale) {
  nn::Sequential inner;
  inner.add<nn::Linear>(store, name + ".fc1", hidden, ffn, fc_seed(seed, block, 1));
  inner.add<nn::Gelu>();
  nn::Linear& fc2 =
      inner.add<nn::Linear>(store, name + ".fc2", ffn, hidden, fc_seed(seed, block, 2));
  fc2.weight().value = scale(fc2.weight().value, out_scale);
  return nn::Residual(std::move(inner));
}

}  // namespace ch08
