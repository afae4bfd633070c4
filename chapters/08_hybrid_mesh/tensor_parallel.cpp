// Chapter 08's tensor-parallel layers (tensor_parallel.hpp).
#include "tensor_parallel.hpp"

#include "matmul_split.hpp"  // ch01::gather_rows
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
  return ch01::gather_rows(tp, mine, mine.rows() * tp.size());  // chapter 01's, on even rows
}

namespace {

/// Error unless `partial` splits into t equal parts of rows (a reduce-scatter's input).
void require_even_rows(const Tensor& partial, int t) {
  require(partial.ndim() == 2 && partial.rows() % t == 0, [&] {
    return "sequence parallelism: " + partial.describe() + " does not split into " +
           std::to_string(t) + " equal parts of rows";
  });
}

/// The parts of `rows` rows the collective matmul makes: `chunks`, or one a row.
int parts_of(std::int64_t rows, int chunks) {
  return static_cast<int>(std::min<std::int64_t>(chunks, std::max<std::int64_t>(rows, 1)));
}

}  // namespace

Tensor scatter_rows(Communicator& tp, const Tensor& partial) {
  const int t = tp.size();
  require_even_rows(partial, t);
  Tensor mine(partial.rows() / t, partial.cols());
  tp.reduce_scatter(partial, mine, shardlab::ReduceOp::sum);
  return mine;
}

namespace {

// f and g as TpRegion's edges (the learner's f and g work in place): on a copy where the
// argument is the caller's, in place where the layer has just made it.
template <void (*op)(Communicator&, Tensor&)>
Tensor on_copy(Communicator& tp, const Tensor& x) {
  Tensor t = x.clone();
  op(tp, t);
  return t;
}
template <void (*op)(Communicator&, Tensor&)>
Tensor in_place(Communicator& tp, const Tensor& x) {
  Tensor t = x;  // the same storage
  op(tp, t);
  return t;
}

}  // namespace

TpRegion::TpRegion(Communicator& tp, bool sequence_parallel)
    : tp_(tp),
      split_rows_(sequence_parallel && tp.size() > 1),
      enter_(split_rows_ ? Edge{gather_rows, scatter_rows}
                         : Edge{on_copy<f_forward>, in_place<f_backward>}),
      leave_(split_rows_ ? Edge{scatter_rows, gather_rows}
                         : Edge{in_place<g_forward>, on_copy<g_backward>}) {}

TpRegion::TpRegion(Communicator& tp, const TpOptions& options)
    : TpRegion(tp, options.sequence_parallel) {
  if (tp.size() == 1) return;  // nothing summed or gathered over tp
  chunks_ = std::max(1, options.chunks);
  overlap_ = options.overlap;
}

Tensor TpRegion::summed_product(const Tensor& a, const Tensor& b, bool transpose_b,
                                void (*sum)(Communicator&, Tensor&)) const {
  Tensor y =
      shardlab::empty(Shape{a.rows(), transpose_b ? b.rows() : b.cols()}, a.dtype(), a.memory());
  const int parts = parts_of(a.rows(), chunks_);
  std::vector<shardlab::Request> pending;
  for (int c = 0; c < parts; ++c) {
    const ShardRange rows = shard_range(a.rows(), parts, c);
    Tensor part = y.slice(rows.offset, rows.length);
    // A row part's product is those rows of the whole one, bit for bit (gemm.hpp).
    shardlab::matmul_into(part, a.slice(rows.offset, rows.length), b, false, transpose_b);
    if (overlap_)
      pending.push_back(tp_.iallreduce(part, shardlab::ReduceOp::sum));
    else
      sum(tp_, part);  // the learner's f or g, on this part
  }
  tp_.wait_all(pending);
  return y;
}

Tensor TpRegion::scattered_product(const Tensor& a, const Tensor& b, bool transpose_b) const {
  const int t = tp_.size();
  require_even_rows(a, t);
  const std::int64_t share = a.rows() / t, cols = transpose_b ? b.rows() : b.cols();
  Tensor mine = shardlab::empty(Shape{share, cols}, a.dtype(), a.memory());
  const int parts = parts_of(share, chunks_);
  std::vector<Tensor> staged;  // each part's buffer belongs to its collective until the wait
  staged.reserve(static_cast<std::size_t>(parts));
  std::vector<shardlab::Request> pending;
  for (int c = 0; c < parts; ++c) {
    const ShardRange rows = shard_range(share, parts, c);
    Tensor& part =
        staged.emplace_back(shardlab::empty(Shape{t * rows.length, cols}, a.dtype(), a.memory()));
    for (int j = 0; j < t; ++j) {  // rank j's rows of this part, j-th (reduce_scatter's order)
      Tensor to = part.slice(j * rows.length, rows.length);
      shardlab::matmul_into(to, a.slice(j * share + rows.offset, rows.length), b, false,
                            transpose_b);
    }
    // Waited for at once or not, the same collective: MPI's blocking reduce-scatter may
    // add the ranks' rows in another order than its non-blocking one.
    Tensor out = mine.slice(rows.offset, rows.length);
    pending.push_back(tp_.ireduce_scatter(part, out, shardlab::ReduceOp::sum));
    if (!overlap_) tp_.wait(pending.back());
  }
  tp_.wait_all(pending);
  return mine;
}

Tensor TpRegion::gathered_product(const Tensor& mine, const Tensor& b, bool transpose_b,
                                  Tensor* gathered) const {
  const int t = tp_.size();
  const std::int64_t share = mine.rows(), n = share * t;
  const Shape out_shape{n, transpose_b ? b.rows() : b.cols()};
  Tensor y = shardlab::empty(out_shape, mine.dtype(), mine.memory());
  if (gathered) *gathered = shardlab::empty(Shape{n, mine.cols()}, mine.dtype(), mine.memory());
  const int parts = parts_of(share, chunks_);
  std::vector<Tensor> staged(static_cast<std::size_t>(parts));
  std::vector<shardlab::Request> pending(static_cast<std::size_t>(parts));
  auto rows_of = [&](int c) { return shard_range(share, parts, c); };
  for (int c = 0; overlap_ && c < parts; ++c) {  // every part on its way, in order
    const ShardRange rows = rows_of(c);
    const auto i = static_cast<std::size_t>(c);
    staged[i] = shardlab::empty(Shape{t * rows.length, mine.cols()}, mine.dtype(), mine.memory());
    pending[i] = tp_.iallgather(mine.slice(rows.offset, rows.length), staged[i]);
  }
  for (int c = 0; c < parts; ++c) {
    const ShardRange rows = rows_of(c);
    const auto i = static_cast<std::size_t>(c);
    if (overlap_)
      tp_.wait(pending[i]);
    else  // the learner's gather_rows, on this part
      staged[i] = gather_rows(tp_, mine.slice(rows.offset, rows.length));
    for (int j = 0; j < t; ++j) {  // rank j's rows of the part go back to rank j's place
      const Tensor from = staged[i].slice(j * rows.length, rows.length);
      const std::int64_t at = j * share + rows.offset;
      Tensor to = y.slice(at, rows.length);
      shardlab::matmul_into(to, from, b, false, transpose_b);
      if (gathered) gathered->slice(at, rows.length).copy_from(from);
    }
    staged[i] = Tensor();
  }
  return y;
}

Tensor TpRegion::leave_product(const Tensor& x, const Tensor& w) const {
  return split_rows_ ? scattered_product(x, w, false) : summed_product(x, w, false, g_forward);
}

Tensor TpRegion::enter_backward_product(const Tensor& dy, const Tensor& w) const {
  return split_rows_ ? scattered_product(dy, w, true) : summed_product(dy, w, true, f_backward);
}

Tensor TpRegion::enter_product(const Tensor& x, const Tensor& w) const {
  return gathered_product(x, w, false, nullptr);
}

Tensor TpRegion::leave_backward_product(const Tensor& dy, const Tensor& w, Tensor& gathered) const {
  return gathered_product(dy, w, true, &gathered);
}

Tensor TpRegion::enter_again(const Tensor& kept) const {
  return split_rows_ ? gather_rows(tp_, kept) : kept;
}

ShardRange TpRegion::rows(std::int64_t n) const {
  return split_rows_ ? shard_range(n, tp_.size(), tp_.rank()) : ShardRange{0, n};
}

ColumnParallelLinear::ColumnParallelLinear(nn::ParameterStore& store, Communicator& tp,
                                           const std::string& name, std::int64_t in,
                                           std::int64_t out, std::uint64_t seed, bool bias,
                                           const TpOptions& options)
    : region_(tp, options),
      columns_(my_part(out, tp, name, "columns")),
      inner_(store, name, in, columns_.length, seed, bias),
      compute_(options.compute) {
  inner_.weight().value = own(whole_weight(name, in, out, seed));
  inner_.set_autocast({.type = compute_, .round_output = true, .round_input_grad = false});
}

Tensor ColumnParallelLinear::own(const Tensor& whole) const {
  Communicator& tp = region_.comm();
  return shard(whole, tp.size(), 1, tp.rank());
}

nn::Forward ColumnParallelLinear::forward(const Tensor& x) const {
  if (region_.gathers_by_parts()) {  // Linear's forward, its product by parts as they arrive
    const std::vector<nn::Parameter*> wb = inner_.parameters();  // W, and b if any
    Tensor y = region_.enter_product(shardlab::round_to(x, compute_),
                                     shardlab::round_to(wb[0]->value, compute_));
    if (wb.size() > 1) add_row(y, shardlab::round_to(wb[1]->value, compute_));
    nn::Forward f{shardlab::round_to(y, compute_), {}};
    f.saved.tensors = {x};  // this rank's rows, gathered again in the backward
    f.saved.children.emplace_back();
    return f;
  }
  nn::Forward f = inner_.forward(region_.enter(x));
  nn::Saved inner = std::move(f.saved);
  f.saved = nn::Saved{};
  f.saved.tensors = {region_.keep(x, inner.tensors.at(0))};
  inner.tensors.clear();
  f.saved.children.push_back(std::move(inner));
  return f;
}

Tensor ColumnParallelLinear::backward_input(const Tensor& dy, nn::Saved& saved) const {
  require(saved.children.size() == 1 && saved.tensors.size() == 1,
          inner_.name() + ": backward without a forward");
  nn::Saved& inner = saved.children[0];
  // The input again, as the forward's product saw it (rounded under autocast).
  inner.tensors = {shardlab::round_to(region_.enter_again(saved.tensors[0]), compute_)};
  saved.tensors.clear();
  if (region_.chunked()) {  // the product and its sum by parts of rows (Linear's, as they go)
    inner.dy = shardlab::round_to(dy, compute_);
    const Tensor& w = inner_.parameters()[0]->value;
    return shardlab::round_to(
        region_.enter_backward_product(inner.dy, shardlab::round_to(w, compute_)), compute_);
  }
  return shardlab::round_to(region_.enter_backward(inner_.backward_input(dy, inner)), compute_);
}

void ColumnParallelLinear::backward_weight(nn::Saved& saved) {
  require(saved.children.size() == 1, inner_.name() + ": backward_weight before backward_input");
  inner_.backward_weight(saved.children[0]);
  saved = nn::Saved{};
}

RowParallelLinear::RowParallelLinear(nn::ParameterStore& store, Communicator& tp,
                                     const std::string& name, std::int64_t in, std::int64_t out,
                                     std::uint64_t seed, bool bias, float init_scale,
                                     const TpOptions& options)
    : region_(tp, options),
      rows_(my_part(in, tp, name, "rows")),
      inner_(store, name, rows_.length, out, seed, false),
      compute_(options.compute) {
  inner_.weight().value = scale(own(whole_weight(name, in, out, seed)), init_scale);
  inner_.set_autocast({.type = compute_, .round_output = false, .round_input_grad = true});
  if (bias) bias_ = &store.add(name + ".bias", shardlab::zeros(Shape{1, out}));
}

nn::Forward RowParallelLinear::forward(const Tensor& x) const {
  nn::Forward partial;
  Tensor y;
  if (region_.chunked()) {  // Linear's product (no bias, no rounding of y) and its sum, by parts
    const Tensor xin = shardlab::round_to(x, compute_);
    y = region_.leave_product(xin, shardlab::round_to(inner_.parameters()[0]->value, compute_));
    partial.saved.tensors = {xin};
  } else {
    partial = inner_.forward(x);
    y = region_.leave(partial.out);
  }
  if (bias_) add_row(y, shardlab::round_to(bias_->value, compute_));
  nn::Forward f{shardlab::round_to(y, compute_), {}};
  f.saved.children.push_back(std::move(partial.saved));
  return f;
}

Tensor RowParallelLinear::backward_input(const Tensor& dy, nn::Saved& saved) const {
  require(saved.children.size() == 1, inner_.name() + ": backward without a forward");
  if (region_.gathers_by_parts()) {  // Linear's backward_input, its product by parts
    Tensor d;
    const Tensor dx = region_.leave_backward_product(
        shardlab::round_to(dy, compute_),
        shardlab::round_to(inner_.parameters()[0]->value, compute_), d);
    const ShardRange mine = region_.rows(d.rows());
    saved.dy = d.slice(mine.offset, mine.length);
    saved.children[0].dy = d;  // what Linear's backward_weight reads
    return shardlab::round_to(dx, compute_);
  }
  const Tensor d = region_.leave_backward(shardlab::round_to(dy, compute_));
  const ShardRange mine = region_.rows(d.rows());
  saved.dy = d.slice(mine.offset, mine.length);  // the bias's gradient: this rank's rows'
  return inner_.backward_input(d, saved.children[0]);
}

void RowParallelLinear::backward_weight(nn::Saved& saved) {
  require(saved.children.size() == 1 && saved.dy.defined(),
          inner_.name() + ": backward_weight before backward_input");
  inner_.backward_weight(saved.children[0]);
  if (bias_) axpy(1.0f, shardlab::round_to(shardlab::column_sums(saved.dy), compute_), bias_->grad);
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

MlpSpec mlp_spec(const std::string& name, std::int64_t hidden, std::int64_t ffn, std::uint64_t seed,
                 int block, float out_scale) {
  return {.hidden = hidden,
          .ffn = ffn,
          .norm = {},
          .fc1 = name + ".fc1",
          .fc2 = name + ".fc2",
          .seed1 = fc_seed(seed, block, 1),
          .seed2 = fc_seed(seed, block, 2),
          .out_scale = out_scale};
}

nn::Residual parallel_mlp(nn::ParameterStore& store, Communicator& tp, const MlpSpec& spec,
                          const TpOptions& options) {
  nn::Sequential inner;
  if (!spec.norm.empty()) inner.add<nn::LayerNorm>(store, spec.norm, spec.hidden);
  inner.add<ColumnParallelLinear>(store, tp, spec.fc1, spec.hidden, spec.ffn, spec.seed1, true,
                                  options);
  inner.add<nn::Gelu>();
  inner.add<RowParallelLinear>(store, tp, spec.fc2, spec.ffn, spec.hidden, spec.seed2, true,
                               spec.out_scale, options);
  return nn::Residual(std::move(inner));
}

nn::Residual mlp_block(nn::ParameterStore& store, const MlpSpec& spec) {
  nn::Sequential inner;
  if (!spec.norm.empty()) inner.add<nn::LayerNorm>(store, spec.norm, spec.hidden);
  inner.add<nn::Linear>(store, spec.fc1, spec.hidden, spec.ffn, spec.seed1);
  inner.add<nn::Gelu>();
  nn::Linear& fc2 = inner.add<nn::Linear>(store, spec.fc2, spec.ffn, spec.hidden, spec.seed2);
  fc2.weight().value = scale(fc2.weight().value, spec.out_scale);
  return nn::Residual(std::move(inner));
}

}  // namespace ch08
