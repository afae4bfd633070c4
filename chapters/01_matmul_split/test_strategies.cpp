// Tests of chapter 01's strategy table (strategies.cpp), against the solution: each entry
// runs the function its name says, its traffic formula is what the communicator counts,
// and its words say which piece each rank multiplies. The references are written out here
// by hand, not taken from the table.
//
// Wrong versions this test was checked against (each fails with the message quoted):
//   row parallel's copies 1 instead of 2 (the allreduce counted as one allgather)
//     -> "row_parallel at P = 2, 5x3x7: elements_received says 35, the communicator
//        counted 70, the formula 2*(P-1)*M*N is 70"
//   elements_received with P for P-1 -> "data_parallel at P = 1, 5x3x7: elements_received
//     says 35, the communicator counted 0, the formula (P-1)*M*N is 0"
//   column_parallel's run set to data_parallel_matmul
//     -> "column_parallel: its run is data_parallel_matmul, not column_parallel_matmul"
//   part() with the last index one too far (offset + length) -> "data_parallel, rank 0 of
//     2: "x rows 0-2 @ w -> out rows 0-2", expected "x rows 0-1 @ w -> out rows 0-1""
//   share() reading w's columns from K instead of N -> "column_parallel, rank 2 of 3:
//     "x @ w column 4 -> out columns 6-7", expected "x @ w columns 6-7 -> out columns 6-7""
//   row parallel marked bitwise -> "row_parallel: bitwise is true, expected false"
#include <doctest/doctest.h>

#include "shardlab/testing.hpp"
#include "strategies.hpp"

using namespace shardlab;
using shardlab::testing::check_close;
using shardlab::testing::check_equal;
using shardlab::testing::for_each_world_size;
using shardlab::testing::on_ranks;

namespace {

struct Expected {
  std::string key;
  Tensor (*run)(Communicator&, const Tensor&, const Tensor&);
  std::string run_name;
  bool bitwise;
  std::uint64_t copies;  // elements received in all: copies * (P-1) * M * N
  std::string formula;
};
const Expected expected[] = {
    {"data_parallel", ch01::data_parallel_matmul, "data_parallel_matmul", true, 1, "(P-1)*M*N"},
    {"column_parallel", ch01::column_parallel_matmul, "column_parallel_matmul", true, 1,
     "(P-1)*M*N"},
    {"row_parallel", ch01::row_parallel_matmul, "row_parallel_matmul", false, 2, "2*(P-1)*M*N"},
};

std::string name_of(Tensor (*run)(Communicator&, const Tensor&, const Tensor&)) {
  for (const Expected& e : expected)
    if (e.run == run) return e.run_name;
  return "an unknown function";
}

}  // namespace

TEST_SUITE("ch01") {
  TEST_CASE("the table lists the three strategies in the chapter's order, each its function") {
    const std::vector<ch01::Strategy>& table = ch01::strategies();
    REQUIRE(table.size() == 3);
    for (std::size_t i = 0; i < 3; ++i) {
      const ch01::Strategy& s = table[i];
      const Expected& e = expected[i];
      CHECK_MESSAGE(s.key == e.key, "entry " << i << " is " << s.key << ", expected " << e.key);
      CHECK_MESSAGE((s.run == e.run),
                    s.key << ": its run is " << name_of(s.run) << ", not " << e.run_name);
      const std::string said = s.bitwise ? "true" : "false", want = e.bitwise ? "true" : "false";
      CHECK_MESSAGE(s.bitwise == e.bitwise,
                    s.key << ": bitwise is " << said << ", expected " << want);
      CHECK_MESSAGE(s.formula == e.formula,
                    s.key << ": formula " << s.formula << ", expected " << e.formula);
    }
  }

  TEST_CASE("elements_received is what the communicator counts, and the formula's value") {
    // Shapes no world size divides, and smaller than P (ranks that own nothing).
    const ch01::Dims shapes[] = {{5, 3, 7}, {4, 5, 8}, {1, 2, 3}};
    for_each_world_size([&](int n) {
      for (const ch01::Dims& d : shapes) {
        const Tensor x = randn(d.M, d.K, 7), w = randn(d.K, d.N, 8);
        const Tensor want = matmul(x, w);
        for (std::size_t i = 0; i < 3; ++i) {
          const ch01::Strategy& s = ch01::strategies()[i];
          std::vector<std::uint64_t> received(static_cast<std::size_t>(n));
          on_ranks(n, [&](Communicator& comm) {
            const CommStats before = comm.stats();
            const Tensor got = s.run(comm, x, w);
            received[static_cast<std::size_t>(comm.rank())] =
                comm.stats().since(before).total().bytes_received / sizeof(float);
            const std::string what = s.key + " on rank " + std::to_string(comm.rank());
            if (expected[i].bitwise)
              check_equal(got, want, what);
            else
              check_close(got, want, matmul_reorder_bound(x, w), 0.0f, what);
          });
          std::uint64_t counted = 0;
          for (std::uint64_t v : received) counted += v;
          const std::uint64_t formula = expected[i].copies * static_cast<std::uint64_t>(n - 1) *
                                        static_cast<std::uint64_t>(d.M * d.N);
          const std::uint64_t said = s.elements_received(n, d);
          CHECK_MESSAGE((said == counted && said == formula),
                        s.key << " at P = " << n << ", " << d.M << "x" << d.K << "x" << d.N
                              << ": elements_received says " << said
                              << ", the communicator counted " << counted << ", the formula "
                              << expected[i].formula << " is " << formula);
        }
      }
    });
  }

  TEST_CASE("share names the rows, columns or slice of K that each rank multiplies") {
    const ch01::Dims d{4, 5, 8};
    const std::vector<ch01::Strategy>& t = ch01::strategies();
    struct Case {
      std::size_t strategy;
      int P, r;
      std::string want;
    };
    const Case cases[] = {
        {0, 2, 0, "x rows 0-1 @ w -> out rows 0-1"},
        {0, 3, 2, "x row 3 @ w -> out row 3"},
        {0, 8, 5, "x no rows @ w -> out no rows"},
        {1, 2, 1, "x @ w columns 4-7 -> out columns 4-7"},
        {1, 3, 2, "x @ w columns 6-7 -> out columns 6-7"},
        {2, 2, 0, "x columns 0-2 @ w rows 0-2 -> a partial sum of all of out"},
        {2, 3, 2, "x column 4 @ w row 4 -> a partial sum of all of out"},
        {2, 8, 6, "x no columns @ w no rows -> a partial sum of all of out"},
    };
    for (const Case& c : cases) {
      const std::string got = t[c.strategy].share(d, c.P, c.r);
      CHECK_MESSAGE(got == c.want, t[c.strategy].key << ", rank " << c.r << " of " << c.P << ": \""
                                                     << got << "\", expected \"" << c.want << "\"");
    }
  }
}
