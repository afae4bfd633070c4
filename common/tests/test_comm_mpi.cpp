// The MPI backend: the same communicator cases as the threads backend, run on the world
// communicator under `mpirun -np N` (CTest registers N = 2 and 3).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "comm_cases.hpp"
#include "shardlab/comm_mpi.hpp"

using namespace shardlab;
using namespace std::chrono_literals;

namespace {
Communicator* world = nullptr;
}

TEST_SUITE("comm.mpi") {
  TEST_CASE("allreduce gives sum, avg, max and min for every count") {
    cases::allreduce_all_ops(*world);
  }
  TEST_CASE("reduce and broadcast") { cases::reduce_and_broadcast(*world); }
  TEST_CASE("reduce_scatter, allgather(v), gatherv and alltoall") {
    cases::reduce_scatter_allgather_alltoall(*world);
  }
  TEST_CASE("point to point around a ring") { cases::point_to_point_ring(*world); }
  TEST_CASE("split by parity") { cases::split_by_parity(*world); }
  TEST_CASE("counters: allreduce is modeled as 2(N-1)/N * S, messages are exact") {
    cases::counters_match_formula(*world);
    CHECK(world->stats().modeled[static_cast<std::size_t>(Op::allreduce)]);
    CHECK_FALSE(world->stats().modeled[static_cast<std::size_t>(Op::sendrecv)]);
  }
}

int main(int argc, char** argv) {
  mpi::init(&argc, &argv, 20s);
  int code = 0;
  {
    auto comm = mpi::world(20s);
    world = comm.get();
    doctest::Context context(argc, argv);
    code = context.run();
    // Every rank must agree, or a failure on one rank would pass on the others.
    code = comm->all_true(code == 0) ? 0 : 1;
  }
  mpi::finalize();
  return code;
}
