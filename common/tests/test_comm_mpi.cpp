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
  TEST_CASE("allreduce: every op and type") { cases::allreduce_every_op_and_type(*world); }
  TEST_CASE("max and min propagate NaN") { cases::max_and_min_propagate_nan(*world); }
  TEST_CASE("reduce and broadcast, every root") { cases::reduce_and_broadcast_every_root(*world); }
  TEST_CASE("reduce_scatter with uneven shards") { cases::reduce_scatter_uneven_shards(*world); }
  TEST_CASE("reduce_scatter and iallreduce add in rank order, as the threads backend does") {
    cases::reductions_add_in_rank_order(*world, false);  // allreduce: Open MPI's own
  }
  TEST_CASE("allgather, allgatherv and gatherv") { cases::allgather_and_gather(*world); }
  TEST_CASE("alltoall and alltoallv") { cases::alltoall_every_type(*world); }
  TEST_CASE("non-blocking collectives") { cases::non_blocking_collectives(*world); }
  TEST_CASE("point to point around a ring") { cases::point_to_point_ring(*world); }
  TEST_CASE("a recv whose tag differs from the matched send is an error") {
    auto own = world->split(0, world->rank());  // its own messages, not the world's
    cases::tag_mismatch_is_an_error(*own);
  }
  TEST_CASE("split orders by key and nests") { cases::split_orders_by_key_and_nests(*world); }
  TEST_CASE("counters: collectives are modeled, messages are exact") {
    cases::counters_measure_what_moved(*world);
    CHECK(world->stats().is_modeled(Op::allreduce));
    CHECK_FALSE(world->stats().is_modeled(Op::sendrecv));
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
