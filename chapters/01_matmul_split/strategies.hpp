// Chapter 01's three strategies as data: what each cuts, the function that computes it,
// what assembles out and how many elements that receives. The chapter program runs off
// this table, with no case written per strategy; a later chapter can take its splits and
// their traffic from it (a tensor-parallel plan's "column" and "row" layers).
//
// Dimensions: x is M x K, w is K x N, out is M x N; P ranks, rank r.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "matmul_split.hpp"

namespace ch01 {

/// The matmul's dimensions.
struct Dims {
  std::int64_t M;  ///< Rows of x and of out.
  std::int64_t K;  ///< Columns of x, rows of w: the inner dimension summed over.
  std::int64_t N;  ///< Columns of w and of out.
};

/// One way to split the matmul across P ranks: what it cuts, the function that computes it
/// and what assembling out costs.
struct Strategy {
  std::string key;         ///< data_parallel, column_parallel, row_parallel
  std::string title;       ///< "Data parallel", ...
  std::string splits;      ///< what is cut, in words
  std::string collective;  ///< what assembles out, in words
  /// The strategy's matmul: every rank calls it with the whole x and w and gets the whole out.
  Tensor (*run)(Communicator&, const Tensor&, const Tensor&);
  int x_split;    ///< the dim x is cut along; -1: whole on every rank
  int w_split;    ///< the dim w is cut along; -1: whole on every rank
  int out_split;  ///< the dim out is cut along before assembly; -1: a partial sum of all of out
  bool bitwise;   ///< each element summed over k in the reference's order, so exact
  std::uint64_t copies;  ///< elements received, summed over ranks: copies * (P-1) * M * N
  std::string formula;   ///< the same, as the reader writes it: "(P-1)*M*N"

  /// Elements all P ranks receive together to assemble out: copies * (P-1) * M * N (an
  /// allgather delivers every element to the P-1 ranks that lack it; the bandwidth-
  /// optimal allreduce does that twice, reduce-scatter then allgather).
  std::uint64_t elements_received(int P, const Dims& d) const;
  /// What rank r of P multiplies, in words: "x rows 0-1 @ w -> out rows 0-1".
  std::string share(const Dims& d, int P, int r) const;
};

/// The three, in the chapter's order: data parallel, column parallel, row parallel.
const std::vector<Strategy>& strategies();

/// "rows 0-1", "row 2", or "no rows": rank r's part of a dimension of `size` cut P ways.
std::string part(const std::string& noun, std::int64_t size, int P, int r);

}  // namespace ch01
