// CommThread: a rank's communication thread. Tasks (usually collectives) run on it one
// after another, in the order submitted, while the rank's own thread keeps computing:
// the way a training step overlaps gradient allreduces with the rest of backward.
//
// Only one thread may use a communicator at a time: while tasks are pending, the
// rank's thread must leave the communicator to them.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace shardlab {

class CommThread {
 public:
  CommThread();
  ~CommThread();
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  /// Queues `task`; it runs after every task submitted before it.
  void submit(std::function<void()> task);
  /// Blocks until every submitted task has run; rethrows the first task's error.
  void wait_all();

 private:
  void loop();
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  int pending_ = 0;  // submitted and not finished
  bool stopping_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace shardlab
