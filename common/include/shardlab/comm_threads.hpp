// The threads backend: ranks are threads of one process, messages are memcpy.
//
// Point to point: a send and its matching recv meet in the receiver's mailbox; whichever
// arrives second copies the bytes straight from the sender's buffer into the receiver's
// (one copy, no staging).
//
// Collectives: every rank posts its buffers into a shared slot, the ranks meet, check
// that they all called the same collective, and then each does its own share of the work,
// reading the others' buffers directly (an allreduce: rank r reduces chunk r of every
// rank's buffer, then copies the other reduced chunks from their owners). The counters
// count those reads and writes: bytes a rank takes from another rank's memory are its
// received bytes and the other's sent bytes.
//
// Non-blocking collectives (iallreduce, ...) run on a progress thread of the rank's own,
// in the order they were started, while the rank's thread goes on computing; a blocking
// collective first lets the pending ones finish. With SHARDLAB_COLLECTIVE_DELAY_MS=d in
// the environment each one starts d milliseconds late (a slow link, for tests): a buffer
// read before its wait() still holds what it held before, so a missing wait changes the
// results instead of hiding behind a fast memcpy.
//
// Device (CUDA) buffers work too: copies go through cudaMemcpy, reductions are kernels, so
// N ranks can share one GPU or use several.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardlab/comm.hpp"

namespace shardlab {

/// A job whose ranks are threads of this process: the ranks' shared mailboxes and slots,
/// and the job's abort state. run_ranks builds one per run.
class ThreadWorld {
 public:
  /// A world of `ranks` ranks whose blocking calls give up after `timeout`.
  ThreadWorld(int ranks, std::chrono::milliseconds timeout);
  ~ThreadWorld();
  ThreadWorld(const ThreadWorld&) = delete;
  ThreadWorld& operator=(const ThreadWorld&) = delete;

  /// The number of ranks.
  int size() const;
  /// The world communicator of `rank`: call once per rank, use it on that rank's thread.
  std::unique_ptr<Communicator> communicator(int rank);
  /// Ends the job: every blocked or later call on any rank throws CommAborted(reason).
  void abort(const std::string& reason);
  /// Whether the job has been ended (by abort, or by a rank's timeout).
  bool aborted() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
  std::shared_ptr<void> world_group_;  // the ranks' shared mailboxes and slots
};

/// Runs body(comm) on every rank of a fresh threads world, one thread each, and returns
/// each rank's error (null where it finished). A rank that throws ends the job for the
/// others (they get CommAborted). A rank that has not returned `timeout` after the job
/// ended (busy computing, or looping for ever) ends the process with a message naming it,
/// each line starting with `program` (when given) and ": ".
std::vector<std::exception_ptr> run_ranks(int ranks, std::chrono::milliseconds timeout,
                                          const std::function<void(Communicator&)>& body,
                                          const std::string& program = {});

/// run_ranks, then rethrows the first rank's own error (not the CommAborted of the ranks
/// it stopped). What tests use; programs use Program::run (launch.hpp).
void run_threads(int ranks, const std::function<void(Communicator&)>& body,
                 std::chrono::milliseconds timeout = std::chrono::seconds(10));

}  // namespace shardlab
