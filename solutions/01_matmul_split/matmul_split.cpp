// Chapter 01, reference solution: the three ways to split out = x @ w.
// Dimensions: x is M x K, w is K x N, out is M x N; P ranks, this is rank r.
#include "matmul_split.hpp"

#include <vector>

namespace ch01 {

using shardlab::concat;
using shardlab::empty;
using shardlab::ReduceOp;
using shardlab::Shape;
using shardlab::shard;
using shardlab::shard_counts;
using shardlab::shard_range;

// ---------------------------------------------------------------------------
// Gathering shards

Tensor gather_rows(Communicator& comm, const Tensor& mine, std::int64_t total_rows) {
  const int P = comm.size();
  const std::int64_t N = mine.cols();
  // Rank q contributes rows_q * N elements; rows are contiguous in row-major order, so
  // the gathered buffer is already the M x N result.
  Tensor out = empty(Shape{total_rows, N}, mine.dtype(), mine.memory());
  comm.allgatherv(mine, out, shard_counts(total_rows, P, N));
  return out;
}

Tensor gather_columns(Communicator& comm, const Tensor& mine, std::int64_t total_cols) {
  const int P = comm.size();
  const std::int64_t M = mine.rows();
  // Each rank's block is M x cols_q, contiguous; gather the blocks one after another,
  // then lay them side by side: block q is a view of the gathered buffer.
  const std::vector<std::size_t> counts = shard_counts(total_cols, P, M);
  Tensor blocks = empty(Shape{M * total_cols}, mine.dtype(), mine.memory());
  comm.allgatherv(mine, blocks, counts);
  std::vector<Tensor> pieces;
  std::int64_t offset = 0;
  for (int q = 0; q < P; ++q) {
    const std::int64_t cols = shard_range(total_cols, P, q).length;
    pieces.push_back(blocks.view(offset, Shape{M, cols}));
    offset += M * cols;
  }
  return concat(pieces, 1);
}

// ---------------------------------------------------------------------------
// The three strategies

Tensor data_parallel_matmul(Communicator& comm, const Tensor& x, const Tensor& w) {
  // x_r is (M/P) x K; every rank has all of w (K x N).
  const Tensor x_r = shard(x, comm.size(), 0, comm.rank());
  const Tensor out_r = shardlab::matmul(x_r, w);  // (M/P) x N: my rows of out
  return gather_rows(comm, out_r, x.rows());
}

Tensor column_parallel_matmul(Communicator& comm, const Tensor& x, const Tensor& w) {
  // w_r is K x (N/P); every rank has all of x (M x K).
  const Tensor w_r = shard(w, comm.size(), 1, comm.rank());
  const Tensor out_r = shardlab::matmul(x, w_r);  // M x (N/P): my columns of out
  return gather_columns(comm, out_r, w.cols());
}

Tensor row_parallel_matmul(Communicator& comm, const Tensor& x, const Tensor& w) {
  // x_r is M x (K/P), w_r is (K/P) x N: the same slice of the inner dimension.
  const Tensor x_r = shard(x, comm.size(), 1, comm.rank());
  const Tensor w_r = shard(w, comm.size(), 0, comm.rank());
  Tensor partial = shardlab::matmul(x_r, w_r);  // M x N, this slice's share of every element
  comm.allreduce(partial, ReduceOp::sum);
  return partial;
}

}  // namespace ch01
