// Chapter 04's own model, one user of the pipeline runtime (pipeline.hpp): `layers` blocks
// of Linear(width, width) + tanh (the common toy::mlp), cut into stages, and the loss
// L = sum over the batch of |out - target|^2 / (2 * batch) on the last one. The input and
// the targets are random: the chapter is about time and memory, not about fitting.
#pragma once

#include <cstdint>
#include <vector>

#include "pipeline.hpp"
#include "shardlab/toy.hpp"

namespace ch04 {

/// The toy model's shape and the batch it runs on.
struct ModelConfig {
  int layers = 8;          ///< blocks of the model (--layers)
  int width = 64;          ///< width of every block (--width)
  int batch = 32;          ///< rows of the batch (--batch)
  std::uint64_t seed = 0;  ///< seeds the weights and the batch
};

/// The model as a toy::mlp: every width `width`, a tanh after every block (the last
/// too), parameters block<l>.weight and block<l>.bias. Block l's weights come from
/// toy::layer_seed(seed, l) alone, so every rank builds any block identically.
shardlab::toy::MlpConfig mlp_config(const ModelConfig& cfg);

/// The input x and target y of the whole batch (host, random from the seed).
using Batch = shardlab::toy::Batch;
/// The run's batch: x and y both cfg.batch x cfg.width, normal random numbers from cfg.seed.
Batch make_batch(const ModelConfig& cfg);

/// One rank's share of the model: chunk c holds virtual stage k = c p + s, which is blocks
/// shard_range(layers, p v, k).
class ToyStage {
 public:
  /// Builds stage `stage` of `stages`, `chunks` chunks of it (the blocks above), with its
  /// parameters and gradients allocated in `memory`.
  ToyStage(const ModelConfig& cfg, int stage, int stages, int chunks, Memory memory);
  /// Chunk c's blocks: virtual stage c p + s.
  nn::Sequential& chunk(int c) { return chunks_[static_cast<std::size_t>(c)]; }
  /// v: the number of chunks this stage holds.
  int chunks() const { return static_cast<int>(chunks_.size()); }
  /// The parameters and gradients of all of this stage's chunks.
  nn::ParameterStore& store() { return store_; }
  /// What the runtime sees, for a step on `batch` (which must outlive it) cut into
  /// `microbatches` pieces of rows (shard_range): microbatch j's rows of x go in, and its
  /// share of the loss, sum |out - y_j|^2 / (2 * batch), comes out.
  Stage stage(const Batch& batch, int microbatches);

 private:
  ModelConfig cfg_;
  Memory memory_;
  nn::ParameterStore store_;
  std::vector<nn::Sequential> chunks_;
};

/// The single-device reference: the whole model on the whole batch, one forward and one
/// backward; its store holds the gradients.
struct Reference {
  nn::ParameterStore store;  ///< the whole model's parameters and gradients
  nn::Sequential model;      ///< every block of the model, pointing into `store`
  double loss = 0;           ///< the loss of the whole batch
};
/// Builds the whole model into `out` (host memory) and runs one forward and one backward of
/// `batch` through it.
void run_reference(const ModelConfig& cfg, const Batch& batch, Reference& out);

/// The largest |g - g_ref| over this rank's parameters (NaN if any is NaN), matching
/// parameters by name.
double max_gradient_diff(ToyStage& model, Reference& ref);

/// Schedule `s` run on the ranks of `pipeline` with this model on `batch` (each rank
/// builds its stage in `memory`), timed (time_schedule: the fastest of three runs), and
/// simulated with the op costs it measured. Every rank calls it.
struct Measured {
  Schedule schedule;   ///< the schedule that ran
  Timeline measured;   ///< the fastest run's timeline; naive: peaks in microbatches of the run's m
  Timeline simulated;  ///< its simulation with the measured op times; naive: peaks as above
  double grad_diff = 0;     ///< this rank's largest |g - g_ref| (max_gradient_diff)
  double loss = 0;          ///< the loss, over all stages
  std::uint64_t bytes = 0;  ///< sent by all stages together
};
/// Runs, times and simulates schedule `s` as Measured says; `batch_microbatches` is the m
/// of the run (naive: what its one op carries).
Measured measure(Pipeline& pipeline, const Schedule& s, const ModelConfig& cfg, const Batch& batch,
                 Reference& ref, Memory memory, int batch_microbatches);

/// Bytes all stages send in one run of a schedule: every microbatch's activations cross
/// each of the p v - 1 boundaries between model pieces forward, and their gradients
/// cross back: 2 (p v - 1) * batch * width * 4 (none with one stage, whose pieces are
/// all on one rank).
std::uint64_t formula_bytes(const ModelConfig& cfg, int stages, int chunks);

/// What a run on ranks holds in memory, per rank: its blocks' weights and gradients, the
/// activations of every microbatch it may hold (at most the whole batch: GPipe), and the
/// single-device reference (the whole model and batch).
double bytes_per_rank(const ModelConfig& cfg, int ranks);

}  // namespace ch04
