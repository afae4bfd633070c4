// Chapter 01 API: one matmul, out = x @ w, computed by P ranks three ways.
//
// Dimensions: x is M x K, w is K x N, out is M x N; P = comm.size(), r = comm.rank().
// Shards follow shard_range: the first (size % P) ranks get one row/column more, and a
// rank may own none.
// Every rank is handed x and w of full shape but may use only its own shard of them (the
// part its strategy says it owns): the tests put NaN everywhere else, and check that
// each rank does exactly its share of the multiply-adds. What crosses between ranks is
// only what the strategy must communicate to assemble out, which every rank returns
// whole. (The chapter program hands every rank the real x and w, as if each had loaded
// them; a real job would load only its shard.)
//
// The learner writes these in exercises/01_matmul_split/matmul_split.cpp; the
// reference is solutions/01_matmul_split/matmul_split.cpp.
#pragma once

#include "shardlab/comm.hpp"
#include "shardlab/tensor.hpp"

namespace ch01 {

using shardlab::Communicator;
using shardlab::Tensor;

// [exercise]
/// Joins row shards: `mine` is rank r's rows (shard r of `total_rows` rows, all with the
/// same number of columns); every rank returns all total_rows rows, in rank order.
Tensor gather_rows(Communicator& comm, const Tensor& mine, std::int64_t total_rows);

/// Joins column shards: `mine` is rank r's columns (M x shard r of `total_cols`);
/// every rank returns the M x total_cols tensor, rank r's columns in place r.
Tensor gather_columns(Communicator& comm, const Tensor& mine, std::int64_t total_cols);

/// Data parallel: x split along dim 0, every rank holds all of w. Rank r computes its
/// rows of out, (M/P) x N; gathering the rows gives out. Bitwise equal to x @ w.
Tensor data_parallel_matmul(Communicator& comm, const Tensor& x, const Tensor& w);

/// Model (column) parallel, Megatron's ColumnParallelLinear: w split along dim 1, every
/// rank holds all of x. Rank r computes its columns, M x (N/P); gathering the columns
/// gives out. Bitwise equal to x @ w.
Tensor column_parallel_matmul(Communicator& comm, const Tensor& x, const Tensor& w);

/// Row parallel, Megatron's RowParallelLinear: w split along dim 0 and x along dim 1.
/// Rank r computes the partial product x[:, K_r] @ w[K_r, :], M x N; the sum of the
/// partials over ranks (allreduce) is out. Equal to x @ w up to the order of the sum
/// over k, so within rounding, not bitwise.
Tensor row_parallel_matmul(Communicator& comm, const Tensor& x, const Tensor& w);
// [exercise]

}  // namespace ch01
