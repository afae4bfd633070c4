// CommThread: one worker thread, a FIFO of tasks.
#include "shardlab/comm_thread.hpp"

namespace shardlab {

CommThread::CommThread() : thread_([this] { loop(); }) {}

CommThread::~CommThread() {
  {
    std::lock_guard<std::mutex> lock(m_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void CommThread::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(m_);
    tasks_.push_back(std::move(task));
    ++pending_;
  }
  cv_.notify_all();
}

void CommThread::wait_all() {
  std::unique_lock<std::mutex> lock(m_);
  cv_.wait(lock, [&] { return pending_ == 0; });
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void CommThread::loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(m_);
      cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, nothing left
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    std::exception_ptr failed;
    try {
      // After a failure the remaining tasks are skipped: their inputs may be garbage.
      bool skip;
      {
        std::lock_guard<std::mutex> lock(m_);
        skip = error_ != nullptr;
      }
      if (!skip) task();
    } catch (...) {
      failed = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(m_);
      if (failed && !error_) error_ = failed;
      --pending_;
    }
    cv_.notify_all();
  }
}

}  // namespace shardlab
