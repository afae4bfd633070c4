// Chapter 01 tests: compiled against the solution (must pass) and against the exercise
// stubs (every case must fail). Each strategy runs on every rank of a threads
// communicator for world sizes 1, 2, 3, 4, 8 and shapes that do not divide evenly.
//
// Each rank is handed x and w of full shape, but only its own shard holds numbers: every
// element it does not own is NaN. A strategy that reads what it does not own gets NaN in
// its result. And every rank's matmuls are counted: each must do exactly its share of the
// multiply-adds, no more (a rank computing everything) and no less (a rank idling).
//
// Wrong versions these tests were checked against (each fails with the message quoted):
//   data parallel where every rank computes the whole x @ w and keeps its rows
//     -> "data parallel on rank 1 of 2: 160 multiply-adds, but its share is 80 (it owns 2
//        of 4 rows of x)"
//   column parallel that never splits w (a row gather of the full product)
//     -> "column parallel on rank 1 of 2: the result holds NaN, so the rank used elements
//        it does not own (...; this rank owns 4 of 8 columns of w)"
//   row parallel where rank 0 computes everything and the others add zeros
//     -> "row parallel on rank 0 of 2: the result holds NaN, ... (this rank owns 3 of 5
//        columns of x and rows of w)"
//   row parallel without the allreduce (each rank returns its partial sum)
//     -> "row parallel on rank 0 of 2: 32 of 32 elements differ ...; first: [0 = (0, 0)]
//        got -2.71804..., expected -4.52421... (diff 1.80617...)"
//   gather_rows with counts in rows instead of elements
//     -> "rank 0: allgather: counts say 7 elements for this rank, but its buffer has 21"
//   gather_columns assuming even shards (len = mine.cols(); off = q * len), written with
//     element loops -> under the learner build's AddressSanitizer, "heap-buffer-overflow
//     ... at exercises/01_matmul_split/matmul_split.cpp:<line> (in ch01::gather_columns)";
//     without it, "gather_columns on rank 0: 8 of 21 elements differ"
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "matmul_split.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using shardlab::testing::check_close;
using shardlab::testing::check_equal;
using shardlab::testing::for_each_world_size;
using shardlab::testing::on_ranks;

namespace {

struct Dims {
  std::int64_t M, K, N;
};
// The seed's 4x5 @ 5x8, shapes no world size divides, and shapes smaller than P.
const Dims shapes[] = {{4, 5, 8}, {7, 3, 5}, {1, 1, 1}, {3, 2, 9}, {13, 11, 6}};

constexpr float nan = std::numeric_limits<float>::quiet_NaN();

/// t with every element outside rows [rows.offset, +length) and columns [cols.offset,
/// +length) set to NaN: what a rank that owns only that block is given.
Tensor only(const Tensor& t, ShardRange rows, ShardRange cols) {
  Tensor out = t.clone();
  for (std::int64_t i = 0; i < t.rows(); ++i)
    for (std::int64_t j = 0; j < t.cols(); ++j)
      if (i < rows.offset || i >= rows.offset + rows.length || j < cols.offset ||
          j >= cols.offset + cols.length)
        out(i, j) = nan;
  return out;
}
ShardRange all(std::int64_t n) { return {0, n}; }

enum class Split { rows, columns, inner };

struct Strategy {
  const char* name;
  Tensor (*run)(Communicator&, const Tensor&, const Tensor&);
  Split split;
  bool bitwise;
};
const Strategy strategies[] = {
    {"data parallel", ch01::data_parallel_matmul, Split::rows, true},
    {"column parallel", ch01::column_parallel_matmul, Split::columns, true},
    {"row parallel", ch01::row_parallel_matmul, Split::inner, false},
};

/// Runs `s` on n ranks for every shape. Rank r gets NaN outside its own shard; its result
/// must be x @ w, and its matmuls must do exactly its share of the multiply-adds.
void check_strategy(int n, const Strategy& s) {
  for (const Dims& d : shapes) {
    CAPTURE(d.M);
    CAPTURE(d.K);
    CAPTURE(d.N);
    const Tensor x = randn(d.M, d.K, 10), w = randn(d.K, d.N, 11);
    const Tensor want = matmul(x, w);
    const float bound = matmul_reorder_bound(x, w);
    on_ranks(n, [&](Communicator& comm) {
      const int r = comm.rank();
      Tensor my_x = x, my_w = w;
      std::uint64_t share = 0;
      std::string owns;
      if (s.split == Split::rows) {
        const ShardRange rows = shard_range(d.M, n, r);
        my_x = only(x, rows, all(d.K));
        share = static_cast<std::uint64_t>(rows.length * d.K * d.N);
        owns = std::to_string(rows.length) + " of " + std::to_string(d.M) + " rows of x";
      } else if (s.split == Split::columns) {
        const ShardRange cols = shard_range(d.N, n, r);
        my_w = only(w, all(d.K), cols);
        share = static_cast<std::uint64_t>(d.M * d.K * cols.length);
        owns = std::to_string(cols.length) + " of " + std::to_string(d.N) + " columns of w";
      } else {
        const ShardRange inner = shard_range(d.K, n, r);
        my_x = only(x, all(d.M), inner);
        my_w = only(w, inner, all(d.N));
        share = static_cast<std::uint64_t>(d.M * inner.length * d.N);
        owns = std::to_string(inner.length) + " of " + std::to_string(d.K) +
               " columns of x and rows of w";
      }
      const std::uint64_t before = multiply_adds();
      const Tensor got = s.run(comm, my_x, my_w);
      const std::uint64_t done = multiply_adds() - before;
      const std::string what =
          std::string(s.name) + " on rank " + std::to_string(r) + " of " + std::to_string(n);
      CHECK_MESSAGE(all_finite(got),
                    what << ": the result holds NaN, so the rank used elements it does not own "
                            "(in these tests everything outside a rank's shard is NaN; this "
                            "rank owns "
                         << owns << ")");
      if (s.bitwise)
        check_equal(got, want, what);
      else
        check_close(got, want, bound, 0.0f, what);
      CHECK_MESSAGE(done == share, what << ": " << done << " multiply-adds, but its share is "
                                        << share << " (it owns " << owns << ")");
    });
  }
}

}  // namespace

TEST_SUITE("ch01") {
  TEST_CASE("gather_rows puts every rank's rows in rank order, uneven shards included") {
    for_each_world_size([](int n) {
      const Tensor full_t = randn(7, 3, 5);
      on_ranks(n, [&](Communicator& comm) {
        const Tensor mine = shard(full_t, comm.size(), 0, comm.rank());
        check_equal(ch01::gather_rows(comm, mine, full_t.rows()), full_t,
                    "gather_rows on rank " + std::to_string(comm.rank()));
      });
    });
  }

  TEST_CASE("gather_columns puts every rank's columns in place, uneven shards included") {
    for_each_world_size([](int n) {
      const Tensor full_t = randn(3, 7, 6);
      on_ranks(n, [&](Communicator& comm) {
        const Tensor mine = shard(full_t, comm.size(), 1, comm.rank());
        check_equal(ch01::gather_columns(comm, mine, full_t.cols()), full_t,
                    "gather_columns on rank " + std::to_string(comm.rank()));
      });
    });
  }

  TEST_CASE("data parallel (x split by rows) is bitwise x @ w, each rank doing its rows only") {
    for_each_world_size([](int n) { check_strategy(n, strategies[0]); });
  }

  TEST_CASE("column parallel (w split by columns) is bitwise x @ w, each rank its columns") {
    for_each_world_size([](int n) { check_strategy(n, strategies[1]); });
  }

  TEST_CASE("row parallel (K split, partials allreduced) is x @ w within the rounding bound") {
    for_each_world_size([](int n) { check_strategy(n, strategies[2]); });
  }

  TEST_CASE("each strategy communicates what its formula says, and nothing more") {
    // Elements received, summed over ranks: gathers (P-1)*M*N, the allreduce 2(P-1)*M*N.
    for_each_world_size([](int n) {
      const std::int64_t M = 5, K = 3, N = 7;
      const Tensor x = randn(M, K, 1), w = randn(K, N, 2);
      const std::uint64_t P = static_cast<std::uint64_t>(n), MN = M * N;
      const std::uint64_t formulas[] = {(P - 1) * MN, (P - 1) * MN, 2 * (P - 1) * MN};
      for (std::size_t k = 0; k < 3; ++k) {
        const Strategy& s = strategies[k];
        CAPTURE(s.name);
        std::vector<std::uint64_t> received(P);
        on_ranks(n, [&](Communicator& comm) {
          const CommStats before = comm.stats();
          (void)s.run(comm, x, w);
          received[static_cast<std::size_t>(comm.rank())] =
              comm.stats().since(before).total().bytes_received / sizeof(float);
        });
        std::uint64_t total = 0;
        for (std::uint64_t r : received) total += r;
        CHECK_MESSAGE(total == formulas[k], std::string(s.name)
                                                << ": measured " << total
                                                << " elements, formula says " << formulas[k]);
      }
    });
  }
}
