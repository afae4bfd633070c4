// Chapter 01 tests: compiled against the solution (must pass) and against the exercise
// stubs (every case must fail). Each strategy runs on every rank of a threads
// communicator for world sizes 1, 2, 3, 4, 8 and shapes that do not divide evenly.
#include <doctest/doctest.h>

#include "matmul_split.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using shardlab::testing::check_close;
using shardlab::testing::check_equal;
using shardlab::testing::for_each_world_size;

namespace {

struct Dims {
  std::int64_t M, K, N;
};
// The seed's 4x5 @ 5x8, shapes no world size divides, and shapes smaller than P.
const Dims shapes[] = {{4, 5, 8}, {7, 3, 5}, {1, 1, 1}, {3, 2, 9}, {13, 11, 6}};

/// Runs `strategy` on n ranks for every shape and checks each rank's result against x @ w.
template <class Strategy>
void check_strategy(int n, Strategy strategy, bool bitwise, const char* name) {
  for (const Dims& s : shapes) {
    CAPTURE(s.M);
    CAPTURE(s.K);
    CAPTURE(s.N);
    const Tensor x = randn(s.M, s.K, 10), w = randn(s.K, s.N, 11);
    const Tensor want = matmul(x, w);
    const float bound = matmul_reorder_bound(x, w);
    run_threads(n, [&](Communicator& comm) {
      const Tensor got = strategy(comm, x, w);
      const std::string what = std::string(name) + " on rank " + std::to_string(comm.rank()) +
                               " of " + std::to_string(n);
      if (bitwise)
        check_equal(got, want, what);
      else
        check_close(got, want, bound, 0.0f, what);
    });
  }
}

}  // namespace

TEST_SUITE("ch01") {
  TEST_CASE("gather_rows puts every rank's rows in rank order, uneven shards included") {
    for_each_world_size([](int n) {
      const Tensor full_t = randn(7, 3, 5);
      run_threads(n, [&](Communicator& comm) {
        const Tensor mine = shard(full_t, comm.size(), 0, comm.rank());
        check_equal(ch01::gather_rows(comm, mine, full_t.rows()), full_t,
                    "gather_rows on rank " + std::to_string(comm.rank()));
      });
    });
  }

  TEST_CASE("gather_columns puts every rank's columns in place, uneven shards included") {
    for_each_world_size([](int n) {
      const Tensor full_t = randn(3, 7, 6);
      run_threads(n, [&](Communicator& comm) {
        const Tensor mine = shard(full_t, comm.size(), 1, comm.rank());
        check_equal(ch01::gather_columns(comm, mine, full_t.cols()), full_t,
                    "gather_columns on rank " + std::to_string(comm.rank()));
      });
    });
  }

  TEST_CASE("data parallel (x split by rows) is bitwise x @ w on every rank") {
    for_each_world_size(
        [](int n) { check_strategy(n, ch01::data_parallel_matmul, true, "data parallel"); });
  }

  TEST_CASE("column parallel (w split by columns) is bitwise x @ w on every rank") {
    for_each_world_size(
        [](int n) { check_strategy(n, ch01::column_parallel_matmul, true, "column parallel"); });
  }

  TEST_CASE("row parallel (K split, partials allreduced) is x @ w within the rounding bound") {
    for_each_world_size(
        [](int n) { check_strategy(n, ch01::row_parallel_matmul, false, "row parallel"); });
  }

  TEST_CASE("each strategy communicates what its formula says, and nothing more") {
    // Elements received, summed over ranks: gathers (P-1)*M*N, the allreduce 2(P-1)*M*N.
    for_each_world_size([](int n) {
      const std::int64_t M = 5, K = 3, N = 7;
      const Tensor x = randn(M, K, 1), w = randn(K, N, 2);
      const std::uint64_t P = static_cast<std::uint64_t>(n), MN = M * N;
      struct Case {
        const char* name;
        Tensor (*run)(Communicator&, const Tensor&, const Tensor&);
        std::uint64_t formula;
      };
      const Case cases[] = {{"data parallel", ch01::data_parallel_matmul, (P - 1) * MN},
                            {"column parallel", ch01::column_parallel_matmul, (P - 1) * MN},
                            {"row parallel", ch01::row_parallel_matmul, 2 * (P - 1) * MN}};
      for (const Case& c : cases) {
        CAPTURE(c.name);
        std::vector<std::uint64_t> received(P);
        run_threads(n, [&](Communicator& comm) {
          const CommStats before = comm.stats();
          (void)c.run(comm, x, w);
          received[static_cast<std::size_t>(comm.rank())] =
              comm.stats().since(before).total().bytes_received / sizeof(float);
        });
        std::uint64_t total = 0;
        for (std::uint64_t r : received) total += r;
        CHECK_MESSAGE(total == c.formula,
                      c.name << ": measured " << total << " elements, formula says " << c.formula);
      }
    });
  }
}
