// Chapter 04: a schedule run on real ranks. Rank s is stage s; it holds its chunks of
// the model, runs its list of ops in order, receives the activations (forward) and their
// gradients (backward) it needs from its neighbours, sends on what it computes, and
// times every op.
#pragma once

#include <cstdint>
#include <vector>

#include "schedule.hpp"
#include "shardlab/comm.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/tensor.hpp"
#include "simulate.hpp"

namespace ch04 {

using shardlab::Communicator;
using shardlab::Memory;
using shardlab::Tensor;
namespace nn = shardlab::nn;

/// The model: `layers` blocks of Linear(width, width) + tanh, and the loss
/// L = sum over the batch of |out - target|^2 / (2 * batch). Block l's weights come from
/// seed + l, so every rank builds any block identically.
struct ModelConfig {
  int layers = 8;
  int width = 64;
  int batch = 32;
  std::uint64_t seed = 0;
};

/// Blocks [first, last) of the model, as a Sequential over `store`.
nn::Sequential make_blocks(nn::ParameterStore& store, const ModelConfig& cfg, int first, int last);

/// The blocks of virtual stage k of n: shard_range(layers, n, k).
struct BlockRange {
  int first = 0, last = 0;
};
BlockRange blocks_of(const ModelConfig& cfg, int virtual_stage, int virtual_stages);

/// The input and target of the whole batch (host, from the seed).
struct Batch {
  Tensor x, y;
};
Batch make_batch(const ModelConfig& cfg);

/// One rank's share of the model: chunk c holds virtual stage c * p + stage.
class StageModel {
 public:
  StageModel(const ModelConfig& cfg, int stage, int stages, int chunks, Memory memory);
  nn::Sequential& chunk(int c) { return chunks_[static_cast<std::size_t>(c)]; }
  int chunks() const { return static_cast<int>(chunks_.size()); }
  nn::ParameterStore& store() { return store_; }

 private:
  nn::ParameterStore store_;
  std::vector<nn::Sequential> chunks_;
};

/// What one rank saw.
struct StageRun {
  std::vector<Event> events;     // its ops, in order; times in seconds from the common start
  double squared_error = 0;      // last stage: the loss's sum of squares over its microbatches
  std::uint64_t bytes_sent = 0;  // activations and their gradients sent to other stages
};

/// Bytes all stages send in one run of a schedule: every microbatch's activations cross
/// each of the p v - 1 boundaries between model pieces forward, and their gradients
/// cross back: 2 (p v - 1) * batch * width * 4 (none with one stage, whose pieces are
/// all on one rank).
std::uint64_t formula_bytes(const ModelConfig& cfg, int stages, int chunks);

/// Runs this rank's list of ops of `s` (stage = comm.rank(); s.stages must equal
/// comm.size()), adding every parameter gradient into model.store().grads() (zero them
/// first). The ranks start together (a barrier). Sends are non-blocking and completed at
/// the end, so only receives wait: a schedule whose stages wait for each other in a
/// circle ends in the communicator's timeout, the error naming the stage and the op.
StageRun run_schedule(Communicator& comm, const Schedule& s, StageModel& model, const Batch& batch);

/// The single-device reference: the whole model on the whole batch, one forward and one
/// backward; its store holds the gradients.
struct Reference {
  nn::ParameterStore store;
  nn::Sequential model;
  double squared_error = 0;
};
void run_reference(const ModelConfig& cfg, const Batch& batch, Reference& out);

/// The largest |g - g_ref| over this rank's parameters (NaN if any is NaN), matching
/// parameters by name.
double max_gradient_diff(StageModel& model, Reference& ref);

/// Every op's time measured on the ranks, as the costs of a simulation: each op takes
/// exactly as long as it took. What the simulation then leaves out is what happened
/// between the ops: messages in flight, and waking up when they arrive.
std::function<double(int, const Op&)> measured_costs(const std::vector<Event>& events);

}  // namespace ch04
