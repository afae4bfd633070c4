// Chapter 08's tensor-parallel layers: Megatron-LM's column- and row-parallel Linear
// (Shoeybi et al. 2019, §3; megatron/core/tensor_parallel/layers.py), as nn layers over
// the tp communicator, and the MLP block they make. Chapter 09 builds its GPT from them.
//
// A Linear y = x W + b with W of I x O, on t tensor-parallel ranks:
//   column-parallel  rank i holds the columns O_i of W and of b (shard_range(O, t, i)):
//                    y_i = f(x) W[:, O_i] + b[O_i], the output's columns O_i
//   row-parallel     rank i holds the rows I_i of W and takes the input's columns I_i:
//                    y = g(x_i W[I_i, :]) + b; the bias is whole on every rank and added
//                    once, after g (Megatron-LM's skip_bias_add / reduce-then-add)
// f and g are the two ends of a tensor-parallel region (Megatron-LM's
// tensor_parallel/mappings.py), declared below and written in the exercise: column ->
// elementwise -> row needs nothing in between, and, done right, costs 2 allreduces of the
// activation's B x h elements per block and step.
//
// The weights are those of the one-device nn::Linear with the same seed, cut: a
// tensor-parallel block on any number of ranks starts from the same model.
//
// Sequence parallelism (Korthikanti et al. 2022, §4.2.2; Megatron-LM's sequence_parallel):
// between the blocks' tensor-parallel regions each tp rank keeps n/t of the n rows (the
// tokens) instead of all n, so the LayerNorms, the residual adds and what they keep for
// the backward are split t ways too. f and g give way to all-gathers and reduce-scatters
// of rows (gather_rows, scatter_rows; chapter 09's README draws where each goes), which
// move what one allreduce moves. The column-parallel layer keeps only its n/t rows of the
// input and gathers them again in the backward (as Megatron-LM does), and a weight every tp rank
// holds whole (a LayerNorm's, the row-parallel bias) gets from each rank the gradient of
// its rows only: the caller sums those over tp.
#pragma once

#include <cstdint>
#include <string>

#include "mesh.hpp"
#include "shardlab/nn.hpp"

namespace ch08 {

namespace nn = shardlab::nn;
using shardlab::ShardRange;

// ---------------------------------------------------------------------------
// The exercise, part 2: f and g

// [exercise]
/// f, where the block's input enters a column-parallel layer. Forward: `x` is the input as
/// this tp rank has it; on return it is what this rank's columns of W multiply.
void f_forward(Communicator& tp, Tensor& x);
/// f's backward: `dx` is the gradient this rank's columns of W give the input; on return it
/// is the block's whole dL/dx, the same on every tp rank.
void f_backward(Communicator& tp, Tensor& dx);
/// g, where a row-parallel layer's output leaves. Forward: `y` is what this rank's rows of
/// W made of its columns of the input; on return it is the block's y (before the bias),
/// the same on every tp rank.
void g_forward(Communicator& tp, Tensor& y);
/// g's backward: `dy` is dL/dy as this tp rank has it; on return it is what this rank's
/// rows of W need for their gradients and for dL/dx of this rank's columns.
void g_backward(Communicator& tp, Tensor& dy);
// [exercise]

// ---------------------------------------------------------------------------
// The layers

/// Sequence parallelism's two moves over the rows of a 2-D tensor, rank i holding rows
/// shard_range(n, t, i) of n (t must divide n): gather_rows all-gathers the ranks' n/t rows
/// into n (chapter 01's gather_rows); scatter_rows sums each rank's n-row partial and returns this
/// rank's n/t rows of the sum (a reduce-scatter). Each is the other's backward.
Tensor gather_rows(Communicator& tp, const Tensor& mine);
/// The reduce-scatter: this rank's n/t rows of the sum over tp of the ranks' n-row
/// `partial`s. Error unless t divides n.
Tensor scatter_rows(Communicator& tp, const Tensor& partial);

/// How a tensor-parallel layer is built besides its shape.
struct TpOptions {
  /// Sequence parallelism: between the regions each tp rank holds n/t of the n rows; the
  /// regions are entered by gather_rows and left by scatter_rows instead of f and g.
  bool sequence_parallel = false;
  /// Mixed precision (nn::Autocast, f16 or bf16): the products in 16 bits on the f32
  /// weights, each result rounded once, after its sum over tp.
  shardlab::DType compute = shardlab::DType::f32;
  /// The collective matmul (Wang et al. 2023; Megatron-LM's tp-comm-overlap, PyTorch's
  /// async TP): the products whose output is summed over tp (the row-parallel output, the
  /// column-parallel input's gradient) made in `chunks` parts of rows, each part's
  /// allreduce (under sequence parallelism: reduce-scatter) started as soon as it is made
  /// (`overlap`: while the next part is computed) or waited for at once (the same parts,
  /// so the same sums); under sequence parallelism the products whose input is gathered
  /// (the column-parallel input, the row-parallel output's gradient) likewise, each part
  /// multiplied once its rows have arrived while the next part's travel. 1: one product,
  /// one collective (the learner's f and g).
  int chunks = 1;
  bool overlap = false;  ///< with chunks > 1: each part's collective runs under another's product
};

/// The two edges of a tensor-parallel region on the tp ranks, chosen once: f and g, or
/// (TpOptions::sequence_parallel, on more than one rank) gather_rows and scatter_rows.
/// enter and leave_backward leave their argument (the caller's activation, or its
/// gradient) as it was; leave and enter_backward take a tensor the layer has just made
/// and may sum into it in place (f and g do; the gather and scatter return new ones).
class TpRegion {
 public:
  /// The region on `tp`: split rows when `sequence_parallel` and tp has more than one rank.
  TpRegion(Communicator& tp, bool sequence_parallel);
  /// The region as `options` build it (sequence parallelism, the collective matmul).
  TpRegion(Communicator& tp, const TpOptions& options);
  /// The row-parallel product left, where the region chunks (chunked()): leave(x W), its
  /// sum over tp made part by part of rows (TpOptions::chunks), so that each part's
  /// allreduce can run while the next part is multiplied. The elements of leave(x W).
  Tensor leave_product(const Tensor& x, const Tensor& w) const;
  /// The column-parallel input's gradient where the region chunks: enter_backward(dy W^T),
  /// part by part alike.
  Tensor enter_backward_product(const Tensor& dy, const Tensor& w) const;
  /// Under sequence parallelism, where the region chunks (gathers_by_parts()): enter(x) W,
  /// the ranks' rows gathered part by part, each part multiplied once it has arrived.
  Tensor enter_product(const Tensor& x, const Tensor& w) const;
  /// leave_backward(dy) W^T alike, part by part; `gathered` gets leave_backward(dy) (every
  /// row's dL/dy, for the weight's gradient).
  Tensor leave_backward_product(const Tensor& dy, const Tensor& w, Tensor& gathered) const;
  /// Into a column-parallel product: f(x), or the whole n rows gathered from n/t.
  Tensor enter(const Tensor& x) const { return enter_.forward(tp_, x); }
  /// enter's backward: f's (dL/dx summed over tp), or this rank's rows of the sum. May
  /// reuse `dx`'s storage.
  Tensor enter_backward(const Tensor& dx) const { return enter_.backward(tp_, dx); }
  /// Out of a row-parallel product: g(y) (the sum over tp), or this rank's rows of it.
  /// May reuse `y`'s storage.
  Tensor leave(const Tensor& y) const { return leave_.forward(tp_, y); }
  /// leave's backward: g's, or dL/dy of every row gathered from the ranks' n/t.
  Tensor leave_backward(const Tensor& dy) const { return leave_.backward(tp_, dy); }
  /// What a column-parallel layer keeps for its backward, of the input it was given (x)
  /// and what its product read (`entered`): that, for f (x whole, as given); under
  /// sequence parallelism x, this rank's n/t rows, as Megatron-LM keeps them.
  Tensor keep(const Tensor& x, const Tensor& entered) const { return split_rows_ ? x : entered; }
  /// What the product read, again, from what keep kept: itself, or gathered again.
  Tensor enter_again(const Tensor& kept) const;
  /// The rows of a microbatch of n that this rank holds outside the regions: all n, or
  /// shard_range(n, t, i).
  ShardRange rows(std::int64_t n) const;
  /// The tp communicator.
  Communicator& comm() const { return tp_; }
  /// Whether the summed products go by parts of rows (TpOptions::chunks > 1, on more than
  /// one tp rank).
  bool chunked() const { return chunks_ > 1; }
  /// Whether the gathered products go by parts too: chunked() under sequence parallelism.
  bool gathers_by_parts() const { return chunked() && split_rows_; }

 private:
  struct Edge {
    Tensor (*forward)(Communicator&, const Tensor&);
    Tensor (*backward)(Communicator&, const Tensor&);
  };
  /// y = sum over tp of a b (transposed b with `transpose_b`), by TpOptions::chunks parts
  /// of a's rows: f's and g's sum, each part's allreduce overlapping the next product.
  Tensor summed_product(const Tensor& a, const Tensor& b, bool transpose_b,
                        void (*sum)(Communicator&, Tensor&)) const;
  /// Under sequence parallelism: this rank's n/t rows of the sum over tp of a b (a has n
  /// rows), by parts: part c holds rows shard_range(n/t, parts, c) of every rank's n/t,
  /// multiplied into one buffer (rank j's rows j-th) and reduce-scattered while the next
  /// part is multiplied.
  Tensor scattered_product(const Tensor& a, const Tensor& b, bool transpose_b) const;
  /// Under sequence parallelism: gather(mine) b by the same parts, every part's all-gather
  /// started at once and each part multiplied as it arrives; `gathered` (if given) gets
  /// gather(mine).
  Tensor gathered_product(const Tensor& mine, const Tensor& b, bool transpose_b,
                          Tensor* gathered) const;

  Communicator& tp_;
  bool split_rows_;
  Edge enter_, leave_;
  int chunks_ = 1;
  bool overlap_ = false;
};

/// Megatron-LM's column-parallel Linear on the tp ranks: rank i holds the columns O_i of W
/// and b, and its output is the output's columns O_i, nothing summed. It enters its region
/// (TpRegion::enter) and keeps what TpRegion::keep says for the backward.
class ColumnParallelLinear final : public nn::Layer {
 public:
  /// This rank's columns of the `in` x `out` one-device nn::Linear named `name` with
  /// `seed`, its parameters in `store`. Error when the cut leaves this rank no column.
  ColumnParallelLinear(nn::ParameterStore& store, Communicator& tp, const std::string& name,
                       std::int64_t in, std::int64_t out, std::uint64_t seed, bool bias = true,
                       const TpOptions& options = {});
  /// `name`, as given.
  std::string name() const override { return inner_.name(); }
  /// y_i = enter(x) W[:, O_i] + b[O_i]. Saved: what TpRegion::keep keeps, and the inner
  /// Linear's but its input (children[0]).
  nn::Forward forward(const Tensor& x) const override;
  /// dL/dx = enter's backward of dy_i W[:, O_i]^T: summed over the tp ranks.
  Tensor backward_input(const Tensor& dy, nn::Saved& saved) const override;
  void backward_weight(nn::Saved& saved) override;
  /// This rank's W[:, O_i] and, with a bias, b[O_i].
  std::vector<nn::Parameter*> parameters() const override { return inner_.parameters(); }
  /// The columns O_i of the whole layer this rank holds.
  ShardRange columns() const { return columns_; }
  /// This rank's columns of a tensor shaped like the whole layer's weight or bias (its
  /// initial value, a one-device layer's, their gradients): a copy.
  Tensor own(const Tensor& whole) const;
  /// The Linear of this rank's columns (in x O_i) that does the product.
  nn::Linear& local() { return inner_; }

 private:
  TpRegion region_;
  ShardRange columns_;
  nn::Linear inner_;
  shardlab::DType compute_;
};

/// Megatron-LM's row-parallel Linear on the tp ranks: rank i holds the rows I_i of W and
/// takes the input's columns I_i; leaving the region (TpRegion::leave) adds up the partial
/// sums, then the whole bias is added once.
class RowParallelLinear final : public nn::Layer {
 public:
  /// This rank's rows of the `in` x `out` one-device nn::Linear named `name` with `seed`
  /// (the bias, name.bias, whole), its parameters in `store`. `init_scale` multiplies the
  /// initial weights (GPT-2's 1/sqrt(residual layers) for a block's output projection).
  /// Error when the cut leaves this rank no row.
  RowParallelLinear(nn::ParameterStore& store, Communicator& tp, const std::string& name,
                    std::int64_t in, std::int64_t out, std::uint64_t seed, bool bias = true,
                    float init_scale = 1.0f, const TpOptions& options = {});
  /// `name`, as given.
  std::string name() const override { return inner_.name(); }
  /// y = leave(x_i W[I_i, :]) + b; x_i is the input's columns I_i (a column-parallel
  /// layer's output). Saved: the inner Linear's (children[0]) and dy for the bias.
  nn::Forward forward(const Tensor& x) const override;
  /// dL/dx_i = leave's backward of dy, times W[I_i, :]^T.
  Tensor backward_input(const Tensor& dy, nn::Saved& saved) const override;
  /// dW[I_i, :] += x_i^T dy; db += the column sums of dy: of every row, the same on every
  /// tp rank, or (sequence parallel) of this rank's rows, for the caller to sum over tp.
  void backward_weight(nn::Saved& saved) override;
  /// This rank's W[I_i, :], then the bias (whole on every tp rank), if any.
  std::vector<nn::Parameter*> parameters() const override;
  /// The rows I_i of the whole layer this rank holds.
  ShardRange rows() const { return rows_; }
  /// This rank's rows of a tensor shaped like the whole layer's weight: a view.
  Tensor own(const Tensor& whole) const { return whole.slice(rows_.offset, rows_.length); }
  /// The Linear of this rank's rows (I_i x out, no bias) that does the product.
  nn::Linear& local() { return inner_; }
  /// The bias, whole on every tp rank; nullptr without one.
  nn::Parameter* bias() { return bias_; }

 private:
  TpRegion region_;
  ShardRange rows_;
  nn::Linear inner_;
  nn::Parameter* bias_ = nullptr;
  shardlab::DType compute_;
};

/// An MLP block x + fc2(gelu(fc1(norm(x)))): its widths, its layers' names and seeds.
struct MlpSpec {
  std::int64_t hidden = 0;  ///< the block's width
  std::int64_t ffn = 0;     ///< fc1's output width (4 hidden in GPT)
  std::string norm;         ///< the LayerNorm before fc1 (GPT's ln_2); empty: none
  std::string fc1;          ///< the first Linear's name (column-parallel)
  std::string fc2;          ///< the second Linear's name (row-parallel)
  std::uint64_t seed1 = 0;  ///< fc1's seed
  std::uint64_t seed2 = 0;  ///< fc2's seed
  float out_scale = 1.0f;   ///< times fc2's initial weights (GPT-2's 1/sqrt(residual layers))
};

/// The seeds of block b's two Linears (fc1, fc2) in a model seeded `seed`: the same for
/// the one-device block and its tensor-parallel shards.
std::uint64_t fc_seed(std::uint64_t seed, int block, int which);
/// Chapter 08's block b: no norm, Linears name.fc1 and name.fc2 seeded fc_seed(seed, b, 1)
/// and (.., 2). In a stack of L blocks an out_scale of 1/sqrt(L) keeps the residual
/// stream's size from growing with depth.
MlpSpec mlp_spec(const std::string& name, std::int64_t hidden, std::int64_t ffn, std::uint64_t seed,
                 int block, float out_scale = 1.0f);

/// Megatron-LM's MLP block on the tp ranks: x + leave(row(gelu(column(enter(norm(x)))))),
/// fc1 column-parallel, fc2 row-parallel, the norm whole on every rank.
nn::Residual parallel_mlp(nn::ParameterStore& store, Communicator& tp, const MlpSpec& spec,
                          const TpOptions& options = {});
/// The same block on one device: the same weights uncut.
nn::Residual mlp_block(nn::ParameterStore& store, const MlpSpec& spec);

}  // namespace ch08
