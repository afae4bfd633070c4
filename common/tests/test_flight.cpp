// The flight recorder (flight.hpp): what every rank's record holds, and whom the comparison
// of the records names when a job stops — on real jobs of the threads backend, each
// stopped by one rank that hangs (it loops until the job is ended around it) or dies.
//
// Wrong versions each case was seen failing against (written, run, then removed):
//   - naming the first rank whose --timeout ran out (a neighbour of the hung rank, not it):
//     "a chain through a pipeline" and "sub-groups" name rank 3, not rank 1 or 2;
//   - not following the waits (naming every rank someone waits for): "a chain" gets 1, 2, 3;
//   - counting the calls still kept (the ring's entries) instead of all calls started:
//     "every rank entered" finds a deadlock between ranks whose early calls left the ring;
//   - a collective's waiters taken as the ranks with more calls, not fewer: "sub-groups";
//   - a rank without a record ignored: "a killed rank leaves no record" names nobody;
//   - a circle taken for a stop: "a deadlock" would name 0 or 1 as stopped;
//   - the start hook not inherited by a split: "a rank stopped inside a collective" hooks
//     nothing (hooked 0) and rank 1 waits outside;
//   - the host said whatever the hosts (one machine too): "a rank named says its host"
//     gets "rank 3 (on vm)"; the hosts left out of the JSON: the last check there.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "shardlab/comm_threads.hpp"
#include "shardlab/flight.hpp"

using namespace shardlab;
using namespace std::chrono_literals;

namespace {

/// Stops this rank (outside any call) until the job is ended around it.
void hang(Communicator& comm) {
  for (;;) {
    comm.check_not_aborted();
    std::this_thread::sleep_for(5ms);
  }
}

/// Runs `body` on `n` threads ranks, each with a recorder of `capacity` calls, under a
/// short timeout; returns the records, and checks that the job failed.
std::vector<std::optional<FlightRecord>> recorded(int n,
                                                  const std::function<void(Communicator&)>& body,
                                                  std::size_t capacity = 64) {
  std::vector<std::shared_ptr<FlightRecorder>> recorders;
  for (int r = 0; r < n; ++r) recorders.push_back(std::make_shared<FlightRecorder>(r, capacity));
  const auto errors = run_ranks(n, 300ms, [&](Communicator& comm) {
    comm.record_flights(recorders[static_cast<std::size_t>(comm.rank())]);
    body(comm);
  });
  CHECK(std::any_of(errors.begin(), errors.end(), [](const auto& e) { return bool(e); }));
  std::vector<std::optional<FlightRecord>> out;
  for (const auto& rec : recorders) out.push_back(rec->record());
  return out;
}

std::string joined(const FlightVerdict& v) {
  std::string out;
  for (const std::string& line : v.lines) out += line + "\n";
  return out;
}

}  // namespace

TEST_SUITE("flight recorder") {
  TEST_CASE("a rank that never enters an allreduce is named, with the call") {
    auto records = recorded(4, [](Communicator& comm) {
      std::vector<float> x(8, 1.0f);
      comm.allreduce(x);
      if (comm.rank() == 2) hang(comm);
      comm.allreduce(x);
    });
    const FlightVerdict v = compare_flights(records);
    INFO(joined(v));
    CHECK(v.stopped == std::vector<int>{2});
    CHECK(v.deadlocked.empty());
    REQUIRE(v.lines.size() == 1);
    CHECK(v.lines[0] ==
          "rank 2 stopped outside any call after world[0,1,2,3] allreduce #1 (8 x f32): ranks "
          "0, 1 and 3 wait for it in world[0,1,2,3] allreduce #2 (8 x f32)");
    // What rank 0 holds: the first call returned, the second not; two started.
    const FlightRecord& r0 = *records[0];
    REQUIRE(r0.flights.size() == 2);
    CHECK(r0.flights[0].done());
    CHECK(!r0.flights[1].done());
    CHECK(r0.flights[1].seq == 2);
    CHECK(r0.started.at("world[0,1,2,3]") == 2);
    CHECK(r0.groups.at("world[0,1,2,3]") == std::vector<int>{0, 1, 2, 3});
  }

  TEST_CASE("a chain through a pipeline: the rank at its end, not the ones waiting on it") {
    // Rank r receives from r + 1: rank 0 waits for 1, 1 for 2, 2 for 3, and 3 hangs.
    auto records = recorded(4, [](Communicator& comm) {
      std::vector<float> x(4);
      const int r = comm.rank();
      if (r == 3) hang(comm);
      comm.recv(x, r + 1, 0);
    });
    const FlightVerdict v = compare_flights(records);
    INFO(joined(v));
    CHECK(v.stopped == std::vector<int>{3});
    CHECK(joined(v).find("rank 2 waits for it in world[0,1,2,3] recv #1 from rank 3 (16 bytes)") !=
          std::string::npos);
  }

  TEST_CASE("sub-groups: ranks waiting in the world for a group still waiting on its member") {
    // Pairs {0,1} and {2,3}; rank 3 hangs: rank 2 waits in its pair's allreduce, ranks 0
    // and 1 in the world's barrier for 2 and 3 (their pair's call done).
    auto records = recorded(4, [](Communicator& comm) {
      auto pair = comm.split(comm.rank() / 2, comm.rank());
      std::vector<float> x(3, 1.0f);
      if (comm.rank() == 3) hang(comm);
      pair->allreduce(x);
      comm.barrier();
    });
    const FlightVerdict v = compare_flights(records);
    INFO(joined(v));
    CHECK(v.stopped == std::vector<int>{3});
    CHECK(v.lines.at(0).find("rank 2 waits for it in world/1[2,3] allreduce #1 (3 x f32)") !=
          std::string::npos);
    CHECK(records[0]->groups.at("world/0[0,1]") == std::vector<int>{0, 1});
  }

  TEST_CASE("a named group, and a split in another order: world ranks in the group's order") {
    auto records = recorded(4, [](Communicator& comm) {
      auto reversed = comm.split(0, -comm.rank());
      reversed->name_flights("tp");
      std::vector<float> x(2);
      if (comm.rank() == 0) hang(comm);
      reversed->allreduce(x);
    });
    const FlightVerdict v = compare_flights(records);
    INFO(joined(v));
    CHECK(v.stopped == std::vector<int>{0});
    CHECK(records[1]->groups.at("tp[3,2,1,0]") == std::vector<int>{3, 2, 1, 0});
  }

  TEST_CASE("a killed rank leaves no record, and is named by the others' waits") {
    auto records = recorded(3, [](Communicator& comm) {
      std::vector<float> x(2);
      if (comm.rank() == 1) hang(comm);
      comm.allreduce(x);
    });
    records[1].reset();  // as if its process were gone
    const FlightVerdict v = compare_flights(records);
    INFO(joined(v));
    CHECK(v.stopped == std::vector<int>{1});
    CHECK(v.lines.at(0).rfind("rank 1 left no record (its process is gone, or never stopped to "
                              "write it): ranks 0 and 2",
                              0) == 0);
  }

  TEST_CASE("a rank stopped inside a collective (a start hook): its group all inside it") {
    std::atomic<int> hooked{0};
    auto records = recorded(3, [&](Communicator& comm) {
      auto hook = std::make_shared<Communicator::StartHook>();
      comm.on_collective_start(hook);
      const auto pair = comm.split(comm.rank() < 2 ? 0 : 1, comm.rank());  // inherits it
      std::vector<float> x(2);
      comm.allreduce(x);  // every rank once, then rank 1 stops inside its group's next
      if (comm.rank() == 1)
        *hook = [&](const Communicator& c, Op op) {
          hooked += op == Op::allreduce;
          for (;;) {
            c.check_not_aborted();
            std::this_thread::sleep_for(5ms);
          }
        };
      if (comm.rank() < 2) pair->allreduce(x);
      comm.barrier();
    });
    const FlightVerdict v = compare_flights(records);
    INFO(joined(v));
    CHECK(hooked == 1);
    // Ranks 0 and 1 are both inside world/0[0,1]'s allreduce #1, which both entered: the
    // records cannot tell which of the two stopped (the timeout's heartbeat can); rank 2
    // waits for them in the world's barrier.
    REQUIRE(v.lines.size() >= 2);
    CHECK(v.lines[0].rfind("rank 0 is inside world/0[0,1] allreduce #1", 0) == 0);
    CHECK(v.lines[1].rfind("rank 1 is inside world/0[0,1] allreduce #1", 0) == 0);
    CHECK(v.lines[0].find("rank 2 waits for it in world[0,1,2] barrier") != std::string::npos);
  }

  TEST_CASE("a rank named says its host, where the ranks ran on several") {
    auto records = recorded(4, [](Communicator& comm) {
      std::vector<float> x(2);
      if (comm.rank() == 3) hang(comm);
      comm.allreduce(x);
    });
    records[3].reset();  // its host gone
    for (auto& r : records)
      if (r) r->hosts = {"node0", "node0", "node1", "node1"};
    FlightVerdict v = compare_flights(records);
    INFO(joined(v));
    CHECK(v.lines.at(0).rfind("rank 3 (on node1) left no record", 0) == 0);
    // One host for all (threads; a machine of its own): no host said.
    for (auto& r : records)
      if (r) r->hosts = {"vm", "vm", "vm", "vm"};
    v = compare_flights(records);
    CHECK(v.lines.at(0).rfind("rank 3 left no record", 0) == 0);
    // And it survives the JSON a process writes.
    records[0]->hosts = {"node0", "node0", "node1", "node1"};
    CHECK(flight_record_from_json(flight_record_json(*records[0])).hosts == records[0]->hosts);
  }

  TEST_CASE("the record keeps the last N calls, and counts them all") {
    // Rank 1 makes 5 allreduces and stops; rank 0 waits in the 6th. With a ring of 2, rank
    // 1's record holds only its calls 4 and 5, yet it started 5: rank 0 still names it.
    auto records = recorded(
        2,
        [](Communicator& comm) {
          std::vector<float> x(1);
          for (int i = 0; i < 5; ++i) comm.allreduce(x);
          if (comm.rank() == 1) hang(comm);
          comm.allreduce(x);
        },
        2);
    REQUIRE(records[1]->flights.size() == 2);
    CHECK(records[1]->flights[0].seq == 4);
    CHECK(records[1]->started.at("world[0,1]") == 5);
    const FlightVerdict v = compare_flights(records);
    INFO(joined(v));
    CHECK(v.stopped == std::vector<int>{1});
    CHECK(v.lines.at(0).find("allreduce #6") != std::string::npos);
  }

  TEST_CASE("every rank entered the call: a rank stopped inside it, nobody outside") {
    // Records written by hand: both ranks of g[0,1] inside their 6th allreduce, each
    // keeping only its last 2 calls.
    std::vector<std::optional<FlightRecord>> records(2);
    for (int r = 0; r < 2; ++r) {
      FlightRecord rec;
      rec.rank = r;
      rec.groups["g[0,1]"] = {0, 1};
      rec.started["g[0,1]"] = 6;
      rec.flights.push_back({"g[0,1]", 5, Op::allreduce, -1, 4, DType::f32, 1.0, 1.5});
      rec.flights.push_back({"g[0,1]", 6, Op::allreduce, -1, 4, DType::f32, 2.0, -1});
      records[static_cast<std::size_t>(r)] = rec;
    }
    const FlightVerdict v = compare_flights(records);
    INFO(joined(v));
    CHECK(v.stopped.empty());
    CHECK(v.deadlocked.empty());
    CHECK(joined(v) ==
          "every rank of g[0,1] entered g[0,1] allreduce #6 (4 x f32); none is missing, so a "
          "rank stopped inside it\n");
  }

  TEST_CASE("a deadlock of the program's own calls: ranks waiting for each other") {
    auto records = recorded(3, [](Communicator& comm) {
      std::vector<float> x(1);
      if (comm.rank() < 2) comm.recv(x, 1 - comm.rank(), 0);  // both receive first
      comm.barrier();
    });
    const FlightVerdict v = compare_flights(records);
    INFO(joined(v));
    CHECK(v.stopped.empty());
    CHECK(v.deadlocked == std::vector<int>{0, 1});  // rank 2 waits behind them, not in it
    CHECK(joined(v).find("ranks 0 and 1 wait for each other") != std::string::npos);
  }

  TEST_CASE("non-blocking calls: returned at their wait; a pending one still waits") {
    auto records = recorded(2, [](Communicator& comm) {
      std::vector<float> x(16, 1.0f), y(16);
      Request r = comm.iallreduce(x);
      comm.wait(r);
      comm.sendrecv(x, 1 - comm.rank(), y, 1 - comm.rank());
      if (comm.rank() == 0) hang(comm);
      Request s = comm.irecv(y, 0);
      comm.wait(s);
    });
    const FlightVerdict v = compare_flights(records);
    INFO(joined(v));
    const FlightRecord& r1 = *records[1];
    REQUIRE(r1.flights.size() == 4);  // the allreduce, sendrecv's two halves, the irecv
    CHECK(r1.flights[0].op == Op::allreduce);
    CHECK(r1.flights[0].done());
    CHECK(r1.flights[1].done());
    CHECK(r1.flights[2].done());
    CHECK(!r1.flights[3].done());
    CHECK(r1.flights[3].seq == 2);  // the second message from rank 0
    CHECK(v.stopped == std::vector<int>{0});
  }

  TEST_CASE("a record survives JSON, and a malformed one is an error") {
    auto records = recorded(2, [](Communicator& comm) {
      std::vector<float> x(1);
      if (comm.rank() == 1) hang(comm);
      comm.allreduce(x);
    });
    const nlohmann::json j = flight_record_json(*records[0]);
    const FlightRecord back = flight_record_from_json(j);
    CHECK(back.rank == 0);
    CHECK(back.started == records[0]->started);
    CHECK(back.groups == records[0]->groups);
    REQUIRE(back.flights.size() == 1);
    CHECK(back.flights[0].describe() == records[0]->flights[0].describe());
    CHECK(back.flights[0].end == records[0]->flights[0].end);
    nlohmann::json bad = j;
    bad["flights"][0]["op"] = "allreduse";
    CHECK_THROWS_WITH_AS(flight_record_from_json(bad), "unknown operation 'allreduse'", Error);
    bad.erase("started");
    CHECK_THROWS_AS(flight_record_from_json(bad), Error);
  }
}
