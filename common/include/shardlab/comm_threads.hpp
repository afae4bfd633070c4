// The threads backend: ranks are threads of one process, messages are memcpy.
//
// A send and its matching recv meet in the receiver's mailbox; whichever arrives second
// copies the bytes straight from the sender's buffer into the receiver's (one copy, no
// staging). Collectives post their buffers into shared slots, meet at a barrier, and
// then every rank does its share of the work reading the others' buffers directly.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "shardlab/comm.hpp"

namespace shardlab {

class ThreadWorld {
 public:
  /// A world of `ranks` ranks whose blocking calls give up after `timeout`.
  ThreadWorld(int ranks, std::chrono::milliseconds timeout);
  ~ThreadWorld();
  ThreadWorld(const ThreadWorld&) = delete;
  ThreadWorld& operator=(const ThreadWorld&) = delete;

  int size() const;
  /// The world communicator of `rank`: call once per rank, use it on that rank's thread.
  std::unique_ptr<Communicator> communicator(int rank);
  /// Ends the job: every blocked or later call on any rank throws CommAborted(reason).
  void abort(const std::string& reason);

  struct State;

 private:
  std::shared_ptr<State> state_;
  std::shared_ptr<void> world_group_;  // the ranks' shared mailboxes and slots
};

}  // namespace shardlab
