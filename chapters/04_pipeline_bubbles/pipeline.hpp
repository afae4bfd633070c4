// Chapter 04: the pipeline runtime. A schedule (schedule.hpp) run on real ranks, over any
// model: rank s of a communicator (the world, or the pp group of a mesh) is stage s.
// It holds its chunks of the model, runs its list of ops in order, receives the
// activations (forward) and their gradients (backward) it needs from its neighbours, sends
// on what it computes, and times every op.
//
// The runtime knows nothing of the model (picotron's train_step_pipeline_1f1b, PyTorch's
// _PipelineStageBase): a Stage gives its chunks as nn layers, the shape of what enters
// each, the first virtual stage's input and the last one's loss; Hooks let a trainer act
// at the moments data parallelism needs (chapter 02's no-sync pattern: the gradient sync
// is switched back on before the last backward of the step).
//
//   ch04::Pipeline pipeline(mesh.axis("pp"));          // once: its channels
//   ch04::Stage stage{.chunks = {&my_chunk}, .input = ..., .boundary = ..., .loss = ...};
//   sync.set_enabled(false);
//   const ch04::StageRun run = pipeline.run(schedule, stage,
//                                           {.before_last_backward = [&] {
//                                             sync.set_enabled(true); }});
//   sync.finish();
//
// Names: p = stages (the communicator's ranks), v = chunks per stage, m = microbatches,
// j = a microbatch, c = a chunk of this stage, k = c p + s its virtual stage (0 .. p v - 1).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "schedule.hpp"
#include "shardlab/comm.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/results.hpp"
#include "shardlab/tensor.hpp"
#include "simulate.hpp"

namespace ch04 {

using shardlab::Communicator;
using shardlab::DType;
using shardlab::Memory;
using shardlab::Shape;
using shardlab::Tensor;
namespace nn = shardlab::nn;

/// The shape and element type of the activation that enters a chunk (its gradient, coming
/// back, has the same).
struct Boundary {
  Shape shape;               ///< the activation's shape
  DType dtype = DType::f32;  ///< its element type
};

/// What the loss gives for one microbatch: its share of the step's loss (the runtime adds
/// the shares up, and scales nothing), and dL/dout.
struct MicrobatchLoss {
  double value = 0;  ///< this microbatch's share of the step's loss
  Tensor grad;       ///< dL/dout: the gradient of that share with respect to the output
};

/// One rank's share of a pipelined model, as the runtime sees it. Callbacks are called
/// only where the schedule needs them (input: the rank that holds virtual stage 0; loss:
/// the one that holds the last; boundary: every other chunk).
struct Stage {
  /// Chunk c's layers: virtual stage c p + s of the model (an nn::Sequential, or any Layer).
  std::vector<nn::Layer*> chunks;
  /// The input of microbatch j to virtual stage 0 (in `memory`; any type, e.g. token ids).
  std::function<Tensor(int microbatch)> input;
  /// What enters chunk c for microbatch j from the virtual stage before it: the receive
  /// buffer's shape and type (each microbatch has its own: uneven microbatches differ).
  std::function<Boundary(int microbatch, int chunk)> boundary;
  /// The last virtual stage: the loss of microbatch j's output `out`.
  std::function<MicrobatchLoss(const Tensor& out, int microbatch)> loss;
  /// Where the activations live (the GPU's kernels are waited for before an op's clock
  /// stops).
  Memory memory = Memory::host;
  /// Each op's receive (an activation, or its gradient) posted before the op before it
  /// runs, and waited for only when the op needs it: the message can arrive while the
  /// stage computes. Off: posted when needed (the same messages, in the same order).
  bool early_receives = false;
};

/// Moments of a step a trainer can act at. Both run on the stage's own rank, outside the
/// ops' timing.
struct Hooks {
  /// Once per step on every stage, just before its last op that adds into the weight
  /// gradients (its last W when the schedule splits the backward, else its last B): every
  /// other contribution of the step is in. Where a data-parallel sync is switched back on.
  std::function<void()> before_last_backward;
  /// After each op that adds microbatch j's weight gradients of chunk c (B, or W when
  /// split); `chunk_done`: that was chunk c's last of the step, its gradients are final
  /// (a per-chunk sync can start).
  std::function<void(int microbatch, int chunk, bool chunk_done)> after_backward;
};

/// What one rank saw.
struct StageRun {
  std::vector<Event> events;     ///< its ops, in order; times in seconds from the common start
  double loss = 0;               ///< the loss's shares of the microbatches whose loss it took
  std::uint64_t bytes_sent = 0;  ///< activations and their gradients sent to other stages
};

/// The runtime over one communicator. Construct it on every rank (it makes two channels,
/// one for activations, one for gradients, so that each keeps its own order).
class Pipeline {
 public:
  /// Splits the two channels off `comm` (collective: every rank of it at once), which must
  /// outlive the Pipeline; stage s is rank s of `comm`.
  explicit Pipeline(Communicator& comm);
  /// Frees the two channels.
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  /// Runs this rank's list of ops of `s` (s.stages must be the communicator's size, and
  /// the stage must have s.chunks chunks), adding every parameter gradient into the
  /// chunks' gradients (zero them first). The ranks start together (a barrier). Tags name
  /// the microbatch and chunk of each message, so stages that disagree on the order get
  /// the communicator's mismatch error; sends are non-blocking and completed at the end,
  /// so only receives wait: a schedule whose stages wait for each other in a circle ends
  /// in the communicator's timeout. Errors name the stage, the op and the schedule.
  StageRun run(const Schedule& s, const Stage& stage, const Hooks& hooks = {});

  /// The communicator the stages are the ranks of (not one of the two channels).
  Communicator& comm() { return comm_; }
  /// The two channels the stages' messages travel on, forward's and backward's: what a
  /// meter of the pipeline's bytes reads (ch08::AxisMeter).
  std::vector<Communicator*> channels() { return {forward_.get(), backward_.get()}; }

 private:
  Communicator& comm_;
  std::unique_ptr<Communicator> forward_, backward_;
  bool one_clock_ = false;  // the ranks' steady clocks compare (shardlab::one_machine)
};

/// A schedule timed: run once untimed (the first touches of fresh memory would count as
/// compute), then `rounds` times, the fastest (by the makespan over all stages) kept: on a
/// shared machine one run can lose a core for a while. `reset` runs before each run (zero
/// the gradients). Every stage's events come back on every rank.
struct Timed {
  StageRun run;               ///< this rank's, of the fastest run
  std::vector<Event> events;  ///< every stage's, of the fastest run
  Timeline timeline;          ///< of those events
};
/// Times schedule `s` on this rank's `stage` as Timed says; every rank calls it.
Timed time_schedule(Pipeline& pipeline, const Schedule& s, const Stage& stage,
                    const std::function<void()>& reset, int rounds = 3);

/// A run's bubble (idle over busy time, from every stage's `events` of schedule `s`) next
/// to this chapter's simulation of `s` fed the measured op times, and the schedule's
/// formula (formula_for with the textbook costs): one row, columns schedule,
/// measured_bubble_over_ideal, simulated, formula, formula_text. For trainers that run the
/// pipeline (chapters 08 and 09), which print it under bubble_caption().
shardlab::Table bubble_table(const Schedule& s, const std::vector<Event>& events);

/// What bubble_table's columns are, in one line. Idle over busy time does not depend on
/// the backward's cost against the forward for GPipe, 1F1B and the interleaved schedule
/// (each stage idles p - 1 forward-and-backward slots, or (p - 1)/v of them); ZB-H1's
/// (p - 1)/(3m) needs t_f = t_b = t_w.
std::string bubble_caption();

/// Every op's time measured on the ranks, as the costs of a simulation: each op takes
/// exactly as long as it took. What the simulation then leaves out is what happened
/// between the ops: messages in flight, and waking up when they arrive.
std::function<double(int, const Op&)> measured_costs(const std::vector<Event>& events);

}  // namespace ch04
