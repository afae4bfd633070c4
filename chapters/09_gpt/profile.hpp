// Chapter 09's profile of one training step, rank by rank (the CS336 notes' §6.1, "性能瓶颈
// 诊断", with PyTorch's profiler; here the program measures itself):
//   compute  each forward (F), input-gradient (B) and weight-gradient (W) pass of the
//            stage's chunks, and the loss (the head and the cross-entropy), as the
//            pipeline runs them; the tp allreduces, the cp ring's waits and the ep
//            all-to-alls inside them are their own spans
//   an axis  every blocking call on its communicators, and every wait for a non-blocking
//            one (dp's: the replicas' and the expert replicas'; pp's: the embedding
//            group's allreduce of wte's gradient): the exposed communication; the part of
//            a non-blocking operation that ran before its wait is hidden (--overlap)
//   wait     the rest of the step: waiting for a neighbour's activations or gradients
//            (the pipeline's bubble and its messages), or for the others to arrive
// The diagnosis applies the notes' two rules of thumb: communication above 30 % of the
// step ("检查AllReduce效率": look at that axis's allreduces), a device busy under 70 %
// ("增大batch size或优化流水线": more microbatches, or another schedule).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardlab/launch.hpp"
#include "train.hpp"

namespace ch09 {

/// One interval of a rank's step, in seconds from the step's start (the earliest rank's).
struct Span {
  std::string name;  ///< "F", "B", "W", "loss", "tp allreduce", "dp wait", ...
  std::string axis;  ///< "compute", or the axis whose communicator the call was on ("tp", ...)
  double start = 0;  ///< seconds from the step's start
  double end = 0;    ///< seconds from the step's start
  /// Communication: when the operation's work began (a non-blocking one's can begin long
  /// before the rank waits for it, at start). A blocking call's work is the span itself.
  double work_start = 0;
  double work_end = 0;  ///< when the operation's work was done
};

/// What a rank's step was made of.
struct Profile {
  std::vector<Span> spans;  ///< in the order they ended
  double step = 0;          ///< seconds, from the common start to this rank's end
  /// Seconds of compute, less every wait inside it: the axes whose calls happen inside a
  /// layer's pass (AxisInfo::inside_layer), and dp's where a layer or Adam waits for a
  /// bucket (ZeRO-1's all-gathers).
  double compute() const;
  /// Seconds the rank waited for `axis`'s communicators, in blocking calls and in waits
  /// for non-blocking ones: the exposed communication (pp: the embedding group's
  /// allreduce; the pipeline's own messages are waits).
  double seconds(ch08::Axis axis) const;
  /// Seconds in which `axis`'s operations were at work while the rank computed (in a
  /// compute span, waiting on no axis): the hidden communication. Operations in flight
  /// together count once.
  double hidden(ch08::Axis axis) const;
  /// Seconds of the rest of the step (waiting), never below 0.
  double wait() const;
};

/// Records one step into a Profile, or nothing when given none. From construction (a start
/// every rank of `world` agrees on) to finish(): every blocking call of the given
/// communicators, named by their axis; each pass of the chunks wrap() returns; and each
/// span note() is given. Every rank of `world` constructs it, with or without a profile.
class StepRecorder {
 public:
  /// The clock of the spans.
  using Clock = std::chrono::steady_clock;
  /// Starts the step into `profile` (nullptr: records nothing), at the earliest rank's
  /// start on `world`, timing every blocking call of each communicator of `axes`, named by
  /// its axis.
  StepRecorder(Profile* profile, Communicator& world,
               std::vector<std::pair<ch08::Axis, Communicator*>> axes);
  ~StepRecorder();
  StepRecorder(const StepRecorder&) = delete;
  StepRecorder& operator=(const StepRecorder&) = delete;
  /// Whether it is recording: given a profile, and not yet finished.
  bool on() const { return profile_ != nullptr; }
  /// `chunk`, or (recording) a layer that runs it and records its F, B and W passes.
  nn::Layer* wrap(nn::Layer& chunk);
  /// A span from `start` to now (recording; nothing otherwise).
  void note(std::string name, const char* axis, Clock::time_point start);
  /// The step's end: its length, and the communicators' timers off.
  void finish();

 private:
  Profile* profile_;
  std::vector<std::pair<ch08::Axis, Communicator*>> axes_;
  std::int64_t origin_ = 0;  // ns, the earliest rank's start
  std::vector<std::unique_ptr<nn::Layer>> timed_;
  double seconds(Clock::time_point t) const;  // from the origin
};

/// Chrome trace events (chrome://tracing, ui.perfetto.dev) of every rank's profile, one
/// thread per rank, its waits drawn as spans of their own, and under it a track of the
/// rank's communication as it ran (a non-blocking operation under the computation it hid
/// behind); written to `path` atomically
/// by rank 0. Every rank calls it.
void write_profile_trace(shardlab::Context& ctx, const MeshShape& mesh, const Profile& mine,
                         const std::string& path);

/// The table of every rank's shares of the step, and the diagnosis under it. Every rank
/// calls it.
void report_profile(shardlab::Context& ctx, const MeshShape& mesh, const Profile& mine);

}  // namespace ch09
