// Flight recorder: every rank keeps its last calls (operation, group, count, sequence
// number, start and end), so that when a job stops the ranks' records can be compared and
// the rank where they part named: the one the others wait for while it waits for nobody.
// PyTorch keeps such a record of NCCL's collectives (its "Flight Recorder", which
// torchtitan's debugging guide reads after a hang); this one is built from scratch over
// every backend's calls, point to point included.
//
//   auto recorder = std::make_shared<FlightRecorder>(comm.rank(), 64);
//   comm.record_flights(recorder);       // and every communicator split from it
//   ...                                  // the job fails: a rank stops, the others time out
//   FlightVerdict v = compare_flights({recorder_0.record(), ..., std::nullopt /* lost */});
//   for (auto& line : v.lines) std::puts(line.c_str());
//
// How they are compared. A call that never returned waits for someone: a collective,
// numbered k on its group, for the members that started fewer than k collectives there; a
// receive, the k-th from a peer, for that peer while it has sent fewer than k; a send for
// its receiver the same way. A rank with no record (its process gone) waits for nobody.
// Following the waits from rank to rank ends at the ranks that wait for nobody: stopped
// outside any call (a hang in computation, a rank killed) — those are named, with the call
// they never entered and the last call they made. Ranks that wait for each other in a
// circle are a deadlock of the program's own calls, and are named as such.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "shardlab/comm.hpp"

namespace shardlab {

/// One call in a flight record.
struct Flight {
  std::string group;  ///< the communicator: its name and world ranks, "tp[4,5]"
  /// Collectives: the call's number on the group (1, 2, ...); a send or a receive: the
  /// message's number from this rank to `peer` (send) or from `peer` to this rank (recv).
  std::uint64_t seq = 0;
  Op op = Op::barrier;     ///< the operation (a sendrecv is a send and a recv)
  int peer = -1;           ///< a send or a receive: the other rank, in the world's numbers
  std::size_t count = 0;   ///< elements (as Communicator::Collective::count); sends: bytes
  DType type = DType::u8;  ///< the elements' type
  double start = 0;        ///< when it was called (steady clock, seconds)
  double end = -1;         ///< when it returned (its wait, if non-blocking); -1: never
  /// True when the call returned.
  bool done() const { return end >= 0; }
  /// "tp[4,5] allreduce #37 (1024 x f32)", "pp[0,4] recv #3 from rank 4 (4096 bytes)".
  std::string describe() const;
};

/// What one rank's recorder holds: its last calls and how many it started on each channel.
struct FlightRecord {
  int rank = 0;                 ///< the rank, in the world's numbers
  std::vector<Flight> flights;  ///< its last calls, oldest first
  /// Calls started per channel, all of them (not only the kept ones): "tp[4,5]" for its
  /// collectives, "tp[4,5] send 5" and "tp[4,5] recv 5" for messages to and from rank 5.
  std::map<std::string, std::uint64_t> started;
  /// The groups it called, each with its members' world ranks in the group's order.
  std::map<std::string, std::vector<int>> groups;
  /// Every world rank's host, as this rank knew them (under mpirun); empty: one machine.
  std::vector<std::string> hosts;
};

/// One rank's recorder, shared by the communicators of that rank (thread-safe).
class FlightRecorder {
 public:
  /// The recorder of world rank `rank`, keeping its last `capacity` calls (at least 1).
  FlightRecorder(int rank, std::size_t capacity);
  /// The rank it records.
  int rank() const { return rank_; }
  /// Notes a call starting now on `group` (whose members are `members`); returns its id
  /// for finished(). Numbers it on its channel (Flight::seq) unless `f.seq` is given.
  std::uint64_t started(Flight f, const std::vector<int>& members);
  /// The call `id` returned now (nothing if it is no longer kept).
  void finished(std::uint64_t id);
  /// A copy of what it holds.
  FlightRecord record() const;
  /// Every world rank's host, for the record (a rank named then says where it ran).
  void set_hosts(std::vector<std::string> hosts);
  /// Adds `seconds` this rank spent blocked in a call (Communicator does, for a blocking
  /// call whole and for a wait on a request).
  void waited(double seconds);
  /// The seconds this rank has spent blocked in calls on any of its communicators: its
  /// exposed communication and its waits for slower ranks (a straggler waits least).
  double waited() const;

 private:
  int rank_;
  std::size_t capacity_;
  mutable std::mutex mutex_;
  std::deque<std::pair<std::uint64_t, Flight>> kept_;
  std::uint64_t next_id_ = 1;
  double waited_ = 0;
  FlightRecord totals_;  // started and groups (flights unused)
};

/// The channel a call counts on: "tp[4,5]" for a collective, "tp[4,5] send 5" for a send.
std::string flight_channel(const Flight& f);

/// Where the ranks part, from every rank's record (std::nullopt for a rank whose record is
/// lost: its process killed).
struct FlightVerdict {
  /// The ranks the others wait for that wait for nobody: stopped outside any call, or
  /// without a record; where there are none, those inside a call every member entered.
  std::vector<int> stopped;
  std::vector<int> deadlocked;     ///< ranks waiting for each other in a circle
  std::vector<std::string> lines;  ///< the verdict in words, one line each
  bool anyone_waited = false;      ///< some rank was inside a call that never returned
};
/// Compares the ranks' records (see the top); `records[r]` is world rank r's.
FlightVerdict compare_flights(const std::vector<std::optional<FlightRecord>>& records);

/// A record as JSON (to write it out), and back; from_json throws Error on a malformed one.
nlohmann::json flight_record_json(const FlightRecord& record);
/// The record `j` holds (flight_record_json's form).
FlightRecord flight_record_from_json(const nlohmann::json& j);

}  // namespace shardlab
