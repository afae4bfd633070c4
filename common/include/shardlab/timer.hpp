// timer: wall-clock seconds, for the chapters' step times and op timelines.
//
//   Stopwatch watch;          // starts now
//   ...; double s = watch.seconds();
//   double lap = watch.lap(); // the seconds since the last lap (or the start), and restarts
#pragma once

#include <chrono>

namespace shardlab {

/// Wall-clock seconds since a start, on the steady clock.
class Stopwatch {
 public:
  using Clock = std::chrono::steady_clock;  ///< The clock it reads.
  /// Starts now.
  Stopwatch() : start_(Clock::now()) {}
  /// Seconds since the start (or the last lap / restart).
  double seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  /// Seconds since `t`, on the same clock.
  static double since(Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  }
  /// seconds(), then starts again from now.
  double lap() {
    const Clock::time_point now = Clock::now();
    const double s = std::chrono::duration<double>(now - start_).count();
    start_ = now;
    return s;
  }
  /// Starts again from now.
  void restart() { start_ = Clock::now(); }
  /// When it started (or the last lap / restart).
  Clock::time_point started() const { return start_; }

 private:
  Clock::time_point start_;
};

}  // namespace shardlab
