// The threads backend: every communicator case for world sizes 1..8, plus the safety
// nets (timeouts, mismatches, a failing rank) that only this backend can show in-process.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "comm_cases.hpp"
#include "shardlab/check.hpp"
#include "shardlab/cuda.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using shardlab::testing::for_each_world_size;
using namespace std::chrono_literals;

TEST_SUITE("comm.threads") {
  TEST_CASE("allreduce: sum, avg, max and min of every type, every count, every element") {
    for_each_world_size([](int n) { run_threads(n, cases::allreduce_every_op_and_type); });
  }
  TEST_CASE("max and min propagate NaN, and so does agree()") {
    for_each_world_size([](int n) { run_threads(n, cases::max_and_min_propagate_nan); });
  }
  TEST_CASE("reduce reaches only the root; broadcast copies root's buffer everywhere") {
    for_each_world_size([](int n) { run_threads(n, cases::reduce_and_broadcast_every_root); });
  }
  TEST_CASE("reduce_scatter gives rank r shard r of the sum, uneven shards included") {
    for_each_world_size([](int n) { run_threads(n, cases::reduce_scatter_uneven_shards); });
  }
  TEST_CASE("allreduce and reduce_scatter add in rank order") {
    for_each_world_size([](int n) {
      run_threads(n, [](Communicator& comm) { cases::reductions_add_in_rank_order(comm); });
    });
  }
  TEST_CASE("allgather, allgatherv and gatherv put every rank's block in its place") {
    for_each_world_size([](int n) { run_threads(n, cases::allgather_and_gather); });
  }
  TEST_CASE("alltoall and alltoallv deliver block j of rank q to rank j, in place q") {
    for_each_world_size([](int n) { run_threads(n, cases::alltoall_every_type); });
  }
  TEST_CASE("non-blocking collectives, several in flight, complete at wait in any order") {
    for_each_world_size([](int n) { run_threads(n, cases::non_blocking_collectives); });
  }
  TEST_CASE("send/recv, sendrecv and isend/irecv deliver in order around a ring") {
    for_each_world_size([](int n) { run_threads(n, cases::point_to_point_ring); });
  }
  TEST_CASE("a recv whose tag differs from the matched send is an error naming both tags") {
    for_each_world_size([](int n) { run_threads(n, cases::tag_mismatch_is_an_error); });
  }
  TEST_CASE("split orders ranks by key, nests, and runs every call on the sub-communicator") {
    for_each_world_size([](int n) { run_threads(n, cases::split_orders_by_key_and_nests); });
  }
  TEST_CASE("counters measure the bytes each collective moved, per rank and per operation") {
    for_each_world_size([](int n) { run_threads(n, cases::counters_measure_what_moved); });
  }
  TEST_CASE("time_calls: a blocking call is exposed whole; work before a wait is hidden") {
    // Each rank starts an allreduce, computes (sleeps) 50 ms and waits: the progress
    // threads have done the work by then, so it ran before the wait (hidden) and the wait
    // is short. A blocking allreduce after it: nothing hidden, its work its call.
    // Wrong versions this fails: hidden() as the wait's length, the work stamped at the
    // wait (the threads backend's times dropped), a wait named "count_" not its operation.
    run_threads(2, [](Communicator& comm) {
      std::vector<Communicator::CallTimes> seen;
      comm.time_calls([&](const Communicator::CallTimes& t) { seen.push_back(t); });
      std::vector<float> buf(1 << 16, 1.0f);
      Request r = comm.iallreduce(buf);
      std::this_thread::sleep_for(50ms);
      comm.wait(r);
      comm.allreduce(buf);
      comm.time_calls({});
      REQUIRE(seen.size() == 2);
      const Communicator::CallTimes& nb = seen[0];
      CHECK(!nb.blocking);
      CHECK(nb.op == Op::allreduce);
      CHECK(nb.posted <= nb.began);
      CHECK(nb.done <= nb.waited);  // finished during the 50 ms
      CHECK(nb.hidden() == doctest::Approx(nb.seconds()));
      CHECK(nb.hidden() > 0);
      CHECK(nb.exposed() < 0.045);
      CHECK(nb.exposed() >= 0);
      const Communicator::CallTimes& b = seen[1];
      CHECK(b.blocking);
      CHECK(b.op == Op::allreduce);
      CHECK(b.hidden() == 0);
      CHECK(b.exposed() == doctest::Approx(b.seconds()));
      CHECK(buf[0] == 4.0f);
    });
  }
  TEST_CASE("a non-blocking collective progresses while its rank is busy elsewhere") {
    // Rank 0 starts an allreduce and then blocks in a receive that rank 1 answers only
    // after its own wait for the allreduce returned: rank 0's share of the work must be
    // done without rank 0 calling wait.
    run_threads(2, [](Communicator& comm) {
      std::vector<float> buf(100000, 1.0f), token(1);
      Request r = comm.iallreduce(buf);
      if (comm.rank() == 0) {
        comm.recv(token, 1);
      } else {
        comm.wait(r);
        comm.send(token, 0);
      }
      comm.wait(r);
      CHECK(buf[99999] == 2.0f);
    });
  }
  TEST_CASE("device buffers are refused cleanly where there is no CUDA") {
    if (cuda::built()) return;
    CHECK_THROWS_AS(Tensor(Shape{4}, DType::f32, Memory::device), UsageError);
  }

  TEST_CASE("a recv with no sender fails after the timeout, naming rank, peer, tag and op") {
    const auto start = std::chrono::steady_clock::now();
    std::string message;
    try {
      run_threads(
          2,
          [](Communicator& comm) {
            std::vector<float> buf(4);
            if (comm.rank() == 1) comm.recv(buf, 0, 7);
          },
          300ms);
    } catch (const CommError& e) {
      message = e.what();
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    CHECK(message.find("rank 1: recv from rank 0 (tag 7, 16 bytes)") != std::string::npos);
    CHECK(message.find("--timeout") != std::string::npos);
    CHECK(waited < 5s);
  }

  TEST_CASE("a receive whose send was dropped unwaited says so") {
    CHECK_THROWS_WITH_AS(run_threads(
                             2,
                             [](Communicator& comm) {
                               std::vector<float> buf(4);
                               if (comm.rank() == 0) {
                                 Request dropped = comm.isend(buf, 1, 3);
                                 dropped.reset();  // destroyed without wait(): withdrawn
                               }
                               comm.barrier();  // the receive is posted after the drop
                               if (comm.rank() == 1) comm.recv(buf, 0, 3);
                             },
                             300ms),
                         doctest::Contains("rank 0 posted an isend to it (tag 3) but dropped its "
                                           "Request without waiting for it"),
                         CommError);
  }

  TEST_CASE("two ranks that both send first are told how to fix it") {
    std::string message;
    try {
      run_threads(
          2,
          [](Communicator& comm) {
            std::vector<float> out(4), in(4);
            comm.send(out, 1 - comm.rank());
            comm.recv(in, 1 - comm.rank());
          },
          300ms);
    } catch (const CommError& e) {
      message = e.what();
    }
    CHECK(message.find("send to rank") != std::string::npos);
    CHECK(message.find("sendrecv") != std::string::npos);
  }

  TEST_CASE("ranks that call different collectives get a mismatch error, not a hang") {
    std::string message;
    try {
      run_threads(
          3,
          [](Communicator& comm) {
            std::vector<float> buf(comm.rank() == 2 ? 6 : 8);
            comm.allreduce(buf);
          },
          5s);
    } catch (const CommError& e) {
      message = e.what();
    }
    CHECK(message.find("collective mismatch") != std::string::npos);
    CHECK(message.find("allreduce(8 x f32, sum)") != std::string::npos);
    CHECK(message.find("rank 2 called allreduce(6 x f32, sum)") != std::string::npos);

    message.clear();
    try {
      run_threads(
          2,
          [](Communicator& comm) {
            std::vector<float> buf(4);
            if (comm.rank() == 0)
              comm.allreduce(buf);
            else
              comm.broadcast(buf, 0);
          },
          5s);
    } catch (const CommError& e) {
      message = e.what();
    }
    CHECK(message.find("broadcast(4 x f32, root 0)") != std::string::npos);
  }

  TEST_CASE("uneven counts pass where the collective allows them; inconsistent ones do not") {
    // reduce_scatter of 7 over 3 ranks gives shards of 3, 2, 2: allowed. Different input
    // lengths are a mismatch.
    CHECK_THROWS_WITH_AS(
        run_threads(3,
                    [](Communicator& comm) {
                      const std::vector<float> in(comm.rank() == 1 ? 8 : 7, 1.0f);
                      std::vector<float> out(
                          shard_range(static_cast<std::int64_t>(in.size()), 3, comm.rank()).length);
                      comm.reduce_scatter(in, out);
                    }),
        doctest::Contains("rank 1 called reduce_scatter(8 x f32, sum)"), CommError);
    // alltoallv: what rank 0 sends to rank 1 must be what rank 1 expects from rank 0.
    CHECK_THROWS_WITH_AS(
        run_threads(2,
                    [](Communicator& comm) {
                      std::vector<std::size_t> send = {1, 2}, recv = {1, 2};
                      if (comm.rank() == 1) recv = {3, 2};  // expects 3 from rank 0, gets 2
                      if (comm.rank() == 1) send = {2, 2};
                      std::vector<float> in(send[0] + send[1]), out(recv[0] + recv[1]);
                      comm.alltoallv(in, send, out, recv);
                    }),
        doctest::Contains("alltoallv mismatch: rank 0 sends 2 elements to rank 1, but rank 1 "
                          "expects 3 from it"),
        CommError);
  }

  TEST_CASE("a collective that one rank never joins times out naming the missing rank") {
    std::string message;
    try {
      run_threads(
          3,
          [](Communicator& comm) {
            if (comm.rank() != 1) comm.barrier();
          },
          300ms);
    } catch (const CommError& e) {
      message = e.what();
    }
    CHECK(message.find("for rank(s) 1 to join") != std::string::npos);
  }

  TEST_CASE("a rank that throws stops the others; its own error is the one reported") {
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH_AS(run_threads(
                             4,
                             [](Communicator& comm) {
                               if (comm.rank() == 2) throw std::runtime_error("rank 2 broke");
                               std::vector<float> buf(4);
                               comm.recv(buf,
                                         (comm.rank() + 1) % 4);  // would wait for the full timeout
                             },
                             30s),
                         "rank 2 broke", std::runtime_error);
    CHECK(std::chrono::steady_clock::now() - start < 5s);
  }

  TEST_CASE("a recv whose size differs from the send is an error naming both sizes") {
    CHECK_THROWS_WITH_AS(
        run_threads(2,
                    [](Communicator& comm) {
                      std::vector<float> buf(comm.rank() == 0 ? 3 : 4);
                      if (comm.rank() == 0)
                        comm.send(buf, 1);
                      else
                        comm.recv(buf, 0);
                    }),
        doctest::Contains("posted a recv of 16 bytes from rank 0 (tag 0), but rank 0 sent 12"),
        CommError);
  }

  TEST_CASE("a peer outside the communicator is an Error (exit 1), naming the call") {
    CHECK_THROWS_WITH_AS(run_threads(2,
                                     [](Communicator& comm) {
                                       std::vector<float> buf(1);
                                       comm.send(buf, 2);
                                     }),
                         doctest::Contains("send with rank 2, but ranks are 0..1"), Error);
  }
}
