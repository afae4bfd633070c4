// Chapter 11: checkpoints written in the background (background_save.hpp).
#include "background_save.hpp"

#include "shardlab/timer.hpp"

namespace ch11 {

using namespace shardlab;

BackgroundSaver::BackgroundSaver(Communicator& world) : comm_(world.split(0, world.rank())) {
  comm_->record_flights(nullptr);       // the recorder is the training thread's,
  comm_->on_collective_start(nullptr);  // and so is a drill's stall
}

BackgroundSaver::~BackgroundSaver() {
  if (thread_.joinable()) thread_.join();
}

void BackgroundSaver::start(const std::string& dir, ch09::CheckpointSnapshot snapshot) {
  wait();
  snapshot_ = std::move(snapshot);
  thread_ = std::thread([this, dir] {
    try {
      const Stopwatch writing;
      ch09::write_checkpoint(dir, *comm_, snapshot_);
      seconds_ = writing.seconds();
      completed_ = snapshot_.step;
    } catch (...) {
      error_ = std::current_exception();
    }
  });
}

double BackgroundSaver::wait() {
  if (!thread_.joinable()) return 0;
  thread_.join();
  snapshot_ = {};  // its tensors freed by the rank's thread, which made them
  const double seconds = seconds_;
  seconds_ = 0;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  return seconds;
}

}  // namespace ch11
