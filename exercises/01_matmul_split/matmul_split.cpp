// Chapter 01 exercise: the three ways to split out = x @ w.
// Dimensions: x is M x K, w is K x N, out is M x N; P = comm.size() ranks, this is
// rank r = comm.rank(). Read chapters/01_matmul_split/README.md first: its pictures show
// which shard lives where for each strategy.
//
// Every function here runs on every rank at once, and every rank must return the same
// whole result. Each rank is handed x and w of full shape but may use only its own shard
// of them: the tests put NaN everywhere else, and count each rank's multiply-adds (it
// must do its share of the work, no more and no less). Shards are uneven when P does not
// divide a dimension, and a rank may own nothing; it still takes part in every
// collective.
//
// Write gather_rows and gather_columns first: the strategies use them.
// Check your work with `make check CH=01`. Useful pieces (common/include/shardlab/):
//   shard(t, P, dim, r)          rank r's piece of t split along dim (uneven sizes too)
//   shard_range(size, P, r)      {offset, length} of rank r's piece of `size`
//   shard_counts(size, P, unit)  every rank's shard length of `size`, times `unit`
//   matmul(a, b)                 a @ b on this rank
//   empty(Shape{M, N}, t.dtype(), t.memory())  a new M x N tensor where t lives (CPU or GPU)
//   t.view(offset, Shape{M, N})  elements offset.. of t as M x N (shares t's memory)
//   concat(pieces, dim)          pieces side by side along dim
//   comm.allgatherv(in, out, counts)   everyone's `in`, concatenated in rank order
//   comm.allreduce(buf, shardlab::ReduceOp::sum)  in place: the sum over ranks, on every rank
// Write them with these operations (no element loops), and the chapter program runs your
// code on GPUs too (--device cuda).
#include "matmul_split.hpp"

#include <vector>

#include "shardlab/check.hpp"

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

// TODO(ch01): gather_rows
// Goal: join the ranks' row shards into one tensor, on every rank.
// Receives: `mine`, this rank's rows of a total_rows x N tensor (its shard along dim 0,
//   possibly with no rows; N = mine.cols()).
// Returns: the total_rows x N tensor, rank 0's rows first, then rank 1's, and so on.
// Invariant: every rank returns the same tensor, having received each row it does not
//   own once and nothing more (the tests count the elements received).
// Think: where do one rank's rows sit in a row-major matrix, and does a gather in rank
//   order already put them there? In what unit does the gather count?
// Stuck? The chapter README's Exercise section has hints, one at a time.
Tensor gather_rows(Communicator& comm, const Tensor& mine, std::int64_t total_rows) {
  (void)comm, (void)mine, (void)total_rows;
  SHARDLAB_TODO("ch01: gather_rows");
}

// TODO(ch01): gather_columns
// Goal: join the ranks' column shards into one tensor, on every rank.
// Receives: `mine`, this rank's columns of an M x total_cols tensor (its shard along
//   dim 1: M rows, possibly no columns; M = mine.rows()).
// Returns: the M x total_cols tensor with each rank's columns in their place, rank 0's
//   leftmost.
// Invariants: after the gather, every rank holds all the ranks' blocks, one after
//   another in rank order, each still a row-major M x (its width) block; after laying
//   them out, every element is in the row and column it had on its own rank, shifted
//   right by the columns of the ranks before it.
// Think: one rank's columns are contiguous in `mine` but not in the result. Blocks may
//   differ in width: do not assume they are all as wide as yours.
// Stuck? The chapter README's Exercise section has hints, one at a time.
Tensor gather_columns(Communicator& comm, const Tensor& mine, std::int64_t total_cols) {
  (void)comm, (void)mine, (void)total_cols;
  SHARDLAB_TODO("ch01: gather_columns");
}

// ---------------------------------------------------------------------------
// The three strategies

// TODO(ch01): data_parallel_matmul
// Goal: out = x @ w, with x cut by rows (dim 0); every rank owns all of w.
// Receives: x (M x K) and w (K x N), of full shape; this rank may use only its rows of x.
// Returns: out, M x N, on every rank, bitwise equal to x @ w.
// Invariant: before the collective, this rank holds exactly its own rows of out, having
//   multiplied only its own rows of x (its share of the multiply-adds).
// Stuck? The chapter README's Exercise section has hints, one at a time.
Tensor data_parallel_matmul(Communicator& comm, const Tensor& x, const Tensor& w) {
  (void)comm, (void)x, (void)w;
  SHARDLAB_TODO("ch01: data_parallel_matmul");
}

// TODO(ch01): column_parallel_matmul
// Goal: out = x @ w, with w cut by columns (dim 1); every rank owns all of x.
// Receives: x (M x K) and w (K x N), of full shape; this rank may use only its columns
//   of w.
// Returns: out, M x N, on every rank, bitwise equal to x @ w.
// Invariant: before the collective, this rank holds exactly its own columns of out,
//   having multiplied only by its own columns of w.
// Stuck? The chapter README's Exercise section has hints, one at a time.
Tensor column_parallel_matmul(Communicator& comm, const Tensor& x, const Tensor& w) {
  (void)comm, (void)x, (void)w;
  SHARDLAB_TODO("ch01: column_parallel_matmul");
}

// TODO(ch01): row_parallel_matmul
// Goal: out = x @ w, with the inner dimension K cut: this rank owns one slice of K, the
//   same slice of x's columns and of w's rows.
// Receives: x (M x K) and w (K x N), of full shape; this rank may use only its slice.
// Returns: out, M x N, on every rank, equal to x @ w within rounding (the sum over k is
//   done in another order, so not bitwise).
// Invariant: before the collective, this rank holds an M x N partial sum: every element
//   of out, summed over its slice of k only. The partials of all ranks add up to out.
// Think: a rank whose slice is empty (P > K) still has a partial to contribute.
// Stuck? The chapter README's Exercise section has hints, one at a time.
Tensor row_parallel_matmul(Communicator& comm, const Tensor& x, const Tensor& w) {
  (void)comm, (void)x, (void)w;
  SHARDLAB_TODO("ch01: row_parallel_matmul");
}

}  // namespace ch01
