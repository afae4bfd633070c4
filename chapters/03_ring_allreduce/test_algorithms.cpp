// Chapter 03 tests of the chapter's own algorithms (not the exercise): naive,
// pipelined ring and recursive doubling equal the native allreduce and send exactly
// their formula's bytes. Compiled against the solution only.
#include <doctest/doctest.h>

#include <functional>

#include "ring_allreduce.hpp"
#include "ring_check.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using shardlab::testing::for_each_world_size;

namespace {
using Algorithm = std::function<void(Communicator&, std::span<float>, ch03::Workspace&)>;

void check_algorithm(const char* name, const Algorithm& run) {
  for_each_world_size([&](int n) {
    for (std::size_t count :
         {std::size_t{0}, std::size_t{1}, static_cast<std::size_t>(n) + 1, std::size_t{4099}}) {
      CAPTURE(count);
      run_threads(n, [&](Communicator& comm) {
        std::vector<float> mine = ch03::check::tagged_input(count, comm.rank(), n), native = mine;
        ch03::Workspace scratch;
        const CommStats before = comm.stats();
        run(comm, mine, scratch);
        const OpStats t = comm.stats().since(before).total();
        comm.allreduce(native);
        CHECK_MESSAGE(mine == native, name << " on rank " << comm.rank() << " differs from native");
        CHECK(t.bytes_sent == ch03::formula_bytes_sent(name, count, comm.rank(), n));
      });
    }
  });
}
}  // namespace

TEST_SUITE("ch03.algorithms") {
  TEST_CASE("naive allreduce: everything through rank 0, bitwise native (same rank order)") {
    check_algorithm("naive", ch03::naive_allreduce);
    // Random floats too: rank 0 adds in rank order, exactly as the threads backend does.
    run_threads(3, [](Communicator& comm) {
      Tensor x = randn(1, 999, 5 + static_cast<std::uint64_t>(comm.rank())), native = x.clone();
      ch03::Workspace scratch;
      ch03::naive_allreduce(comm, x.span(), scratch);
      comm.allreduce(native);
      CHECK(x.bitwise_equal(native));
    });
  }
  TEST_CASE("recursive doubling, powers of two and not") {
    check_algorithm("recursive_doubling", ch03::recursive_doubling_allreduce);
  }
  TEST_CASE("pipelined ring, segments smaller than, equal to and larger than a chunk") {
    for (std::size_t segment : {1u, 7u, 1000u, 100000u}) {
      CAPTURE(segment);
      check_algorithm("pipelined",
                      [segment](Communicator& comm, std::span<float> d, ch03::Workspace& w) {
                        ch03::pipelined_ring_allreduce(comm, d, segment, w);
                      });
    }
  }
  TEST_CASE("the pipelined ring's partners agree on every bit of random data") {
    run_threads(4, [](Communicator& comm) {
      Tensor x = randn(1, 5003, 9 + static_cast<std::uint64_t>(comm.rank())), ring = x.clone();
      ch03::Workspace scratch;
      ch03::pipelined_ring_allreduce(comm, x.span(), 64, scratch);
      ch03::ring_allreduce(comm, ring.span(), scratch);
      CHECK_MESSAGE(x.bitwise_equal(ring),
                    "pipelined and plain ring add in the same order, so must agree");
      Tensor first = x.clone();
      comm.broadcast(first, 0);
      CHECK(x.bitwise_equal(first));
    });
  }
}
