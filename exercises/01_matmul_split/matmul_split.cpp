// Chapter 01 exercise: the three ways to split out = x @ w.
// Dimensions: x is M x K, w is K x N, out is M x N; P = comm.size() ranks, this is
// rank r = comm.rank(). Read chapters/01_matmul_split/README.md first.
//
// Check your work with `make check CH=01`. Useful pieces (common/include/shardlab/):
//   shard(t, P, dim, r)          rank r's piece of t split along dim (uneven sizes too)
//   shard_range(size, P, r)      {offset, length} of rank r's piece of `size`
//   shard_counts(size, P, unit)  every rank's shard length of `size`, times `unit`
//   matmul(a, b)                 a @ b on this rank
//   empty(Shape{M, N}, t.dtype(), t.memory())  a new M x N tensor where t lives (CPU or GPU)
//   t.view(offset, Shape{M, N})  elements offset.. of t as M x N (shares t's memory)
//   concat(pieces, dim)          pieces side by side along dim
//   comm.allgatherv(in, out, counts)   everyone's `in`, concatenated in rank order
//   comm.allreduce(buf, ReduceOp::sum) in place: the sum over ranks, on every rank
// Write them with these operations (no element loops), and the chapter program runs your
// code on GPUs too (--device cuda).
#include "matmul_split.hpp"

#include <vector>

#include "shardlab/check.hpp"

namespace ch01 {

using shardlab::concat;
using shardlab::empty;
using shardlab::Shape;
using shardlab::shard;
using shardlab::shard_counts;
using shardlab::shard_range;

// ---------------------------------------------------------------------------
// Gathering shards

// TODO(ch01): gather_rows
// `mine` is rank r's rows: shard_range(total_rows, P, r).length rows of N = mine.cols().
// Return the total_rows x N tensor with every rank's rows in rank order, on every rank.
// Steps:
//   1. counts[q] = rows of rank q * N (elements, not rows): shard_counts does it.
//   2. out = an empty total_rows x N tensor like mine; comm.allgatherv(mine, out, counts).
// Hint: row-major rows are contiguous, so the gathered buffer needs no rearranging.
Tensor gather_rows(Communicator& comm, const Tensor& mine, std::int64_t total_rows) {
  (void)comm, (void)mine, (void)total_rows;
  SHARDLAB_TODO("ch01: gather_rows");
}

// TODO(ch01): gather_columns
// `mine` is M x cols_r, rank r's columns (shard_range(total_cols, P, r)). Return the
// M x total_cols tensor with rank q's columns at shard_range(total_cols, P, q).offset.
// Steps:
//   1. counts[q] = M * cols_q; gather all blocks into one buffer of M * total_cols.
//   2. Block q is M x cols_q, row-major, starting after the blocks of ranks 0..q-1: take
//      it as a view, then concat the blocks along dim 1.
// Hint: unlike rows, columns are not contiguous: the gathered blocks need laying out.
Tensor gather_columns(Communicator& comm, const Tensor& mine, std::int64_t total_cols) {
  (void)comm, (void)mine, (void)total_cols;
  SHARDLAB_TODO("ch01: gather_columns");
}

// ---------------------------------------------------------------------------
// The three strategies

// TODO(ch01): data_parallel_matmul
// Split x along dim 0; w stays whole. Steps: x_r = my rows of x; out_r = x_r @ w
// ((M/P) x N); return gather_rows(out_r).
Tensor data_parallel_matmul(Communicator& comm, const Tensor& x, const Tensor& w) {
  (void)comm, (void)x, (void)w;
  SHARDLAB_TODO("ch01: data_parallel_matmul");
}

// TODO(ch01): column_parallel_matmul
// Split w along dim 1; x stays whole. Steps: w_r = my columns of w; out_r = x @ w_r
// (M x (N/P)); return gather_columns(out_r).
Tensor column_parallel_matmul(Communicator& comm, const Tensor& x, const Tensor& w) {
  (void)comm, (void)x, (void)w;
  SHARDLAB_TODO("ch01: column_parallel_matmul");
}

// TODO(ch01): row_parallel_matmul
// Split the inner dimension K: x along dim 1 and w along dim 0, the same slice on both.
// Steps: x_r = my columns of x (M x K/P); w_r = my rows of w (K/P x N);
// partial = x_r @ w_r (M x N); allreduce the partials with a sum; return the result.
// Hint: a rank with no slice of K (P > K) still takes part with a zero partial.
Tensor row_parallel_matmul(Communicator& comm, const Tensor& x, const Tensor& w) {
  (void)comm, (void)x, (void)w;
  SHARDLAB_TODO("ch01: row_parallel_matmul");
}

}  // namespace ch01
