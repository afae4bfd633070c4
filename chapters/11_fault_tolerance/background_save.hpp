// Chapter 11: checkpoints written in the background while training goes on.
//
//   BackgroundSaver saver(ctx.comm());             // every rank: a communicator of its own
//   saver.start(dir, snapshot_checkpoint(...));    // the copy blocks training; the files not
//   ...train...                                    // the save of step t is written meanwhile
//   saver.wait();                                  // before the next save, and at the end
//
// A synchronous save stops training for the whole write (δ: chapter 09's three moves, the
// shard files, the stages' files, the rename); this one only for the copy of the rank's
// shard to memory, and the write goes on in a thread of the rank with a communicator split
// for it, so that its barriers never meet the training's collectives (PyTorch's
// torch.distributed.checkpoint.async_save works so; Check-N-Run and CheckFreq, Mohan et
// al. FAST 2021, split the snapshot from the persist the same way). One save is in flight at
// a time: the next one waits for it. A failure while it is in flight leaves the last
// complete checkpoint where it was (the save renames its folder only at the end).
#pragma once

#include <atomic>
#include <exception>
#include <memory>
#include <string>
#include <thread>

#include "checkpoint.hpp"

namespace ch11 {

/// One rank's saves in the background: one in flight at a time, on a communicator of its own.
class BackgroundSaver {
 public:
  /// Splits a communicator for the saves from `world` (every rank calls it, in the same
  /// order as its other splits). Its calls are neither counted nor flight-recorded.
  explicit BackgroundSaver(shardlab::Communicator& world);
  /// Waits for a save in flight; its error, if any, is dropped (the job is ending).
  ~BackgroundSaver();
  BackgroundSaver(const BackgroundSaver&) = delete;
  BackgroundSaver& operator=(const BackgroundSaver&) = delete;

  /// Waits for the save in flight, then writes `snapshot` to `dir` in the background.
  void start(const std::string& dir, ch09::CheckpointSnapshot snapshot);
  /// Waits for the save in flight, if any; rethrows what it threw. Returns the seconds
  /// that save took in the background (0: none was in flight).
  double wait();
  /// The step of the last save that this rank saw complete (-1: none yet).
  int completed() const { return completed_; }

 private:
  std::unique_ptr<shardlab::Communicator> comm_;
  std::thread thread_;
  ch09::CheckpointSnapshot snapshot_;  // the one being written (destroyed by the rank)
  std::exception_ptr error_;
  double seconds_ = 0;
  std::atomic<int> completed_{-1};
};

}  // namespace ch11
