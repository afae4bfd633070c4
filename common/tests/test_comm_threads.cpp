// The threads backend: every communicator case for world sizes 1..8, plus the safety
// nets (timeouts, mismatches, a failing rank) that only this backend can show in-process.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>

#include "comm_cases.hpp"
#include "shardlab/check.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using shardlab::testing::for_each_world_size;
using namespace std::chrono_literals;

TEST_SUITE("comm.threads") {
  TEST_CASE("allreduce gives sum, avg, max and min for every count, including 0 and < N") {
    for_each_world_size([](int n) { run_threads(n, cases::allreduce_all_ops); });
  }
  TEST_CASE("reduce reaches only the root; broadcast copies root's buffer everywhere") {
    for_each_world_size([](int n) { run_threads(n, cases::reduce_and_broadcast); });
  }
  TEST_CASE("reduce_scatter, allgather(v), gatherv and alltoall put every block in its place") {
    for_each_world_size([](int n) { run_threads(n, cases::reduce_scatter_allgather_alltoall); });
  }
  TEST_CASE("send/recv, sendrecv and isend/irecv deliver in order around a ring") {
    for_each_world_size([](int n) { run_threads(n, cases::point_to_point_ring); });
  }
  TEST_CASE("split groups ranks by color and orders them by key") {
    for_each_world_size([](int n) { run_threads(n, cases::split_by_parity); });
  }
  TEST_CASE("counters show 2(N-1)/N * S for allreduce and the exact bytes of a message") {
    for_each_world_size([](int n) { run_threads(n, cases::counters_match_formula); });
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
    CHECK(message.find("allreduce(8 x float, sum)") != std::string::npos);
    CHECK(message.find("rank 2 called allreduce(6 x float, sum)") != std::string::npos);

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
    CHECK(message.find("broadcast(4 x float, root 0)") != std::string::npos);
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

  TEST_CASE("a peer outside the communicator is a usage error") {
    CHECK_THROWS_AS(run_threads(2,
                                [](Communicator& comm) {
                                  std::vector<float> buf(1);
                                  comm.send(buf, 2);
                                }),
                    UsageError);
  }
}
