// Chapter 02's training loop: the toy MLP (shardlab/toy.hpp) trained with SGD on its
// teacher's data, the global batch split across ranks, gradients synced by a GradSync as
// --sync says. The chapter owns it (it is not an exercise); GradSync runs the exercise's
// grad_sync functions.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "grad_sync.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/toy.hpp"

namespace ch02 {

/// One training run: the model's shape, the batch, the steps and how gradients are synced.
struct Config {
  std::int64_t in = 16;         ///< I: input features
  std::int64_t hidden = 64;     ///< H: hidden units
  std::int64_t batch = 64;      ///< B: global batch, split across ranks
  int steps = 20;               ///< training steps (SGD updates)
  int accum_steps = 1;          ///< k: micro-batches per step; one sync per step
  float lr = 0.05f;             ///< SGD learning rate
  Sync sync = Sync::allreduce;  ///< how the gradients are synced (--sync)
  double bucket_kb = 1.0;       ///< bucket capacity in KiB, for bucketed and overlap
  std::uint64_t seed = 0;       ///< seeds the model's initial weights and the teacher's data
  shardlab::Memory memory = shardlab::Memory::host;  ///< where the model and batch live

  /// The toy model's shape: x (I) -> Linear(I, H) -> tanh -> Linear(H, 1).
  shardlab::toy::MlpConfig model() const { return {.widths = {in, hidden, 1}, .seed = seed}; }
  /// bucket_kb in bytes (rounded down), as GradSyncConfig::bucket_bytes takes it.
  std::int64_t bucket_bytes() const { return static_cast<std::int64_t>(bucket_kb * 1024.0); }
};

/// One replica: toy::mlp's layers and the store they point into. Parameters in order W1,
/// b1, W2, b2, all in one flat buffer (and their gradients in another) in cfg.memory: on
/// a GPU, forward, backward, the gradient sync and the update all run there.
struct Model {
  /// Builds cfg.model()'s layers and allocates their store in cfg.memory.
  explicit Model(const Config& cfg);
  Model(const Model&) = delete;  // the layers point into this model's own store
  Model& operator=(const Model&) = delete;
  shardlab::nn::ParameterStore store;  ///< the parameters and gradients, two flat buffers
  shardlab::nn::Sequential layers;     ///< Linear, tanh, Linear, pointing into `store`
};

/// What a training run recorded.
struct Trace {
  std::vector<double> losses;  ///< global mean loss before each step's update
  // This rank's totals: making the batch, computing (forward, backward, update), and
  // waiting on communication; they add up to the step time.
  double batch_s = 0;           ///< this rank's total time making its batches, in seconds
  double compute_s = 0;         ///< total forward, backward and update time, in seconds
  double comm_wait_s = 0;       ///< total time waiting on the gradient sync, in seconds
  double step_s = 0;            ///< total step time, in seconds; the three above add up to it
  shardlab::OpStats allreduce;  ///< this rank's allreduce traffic, all steps
  std::size_t buckets = 0;      ///< buckets in the sync's plan (0 unless bucketed or overlap)
};

/// Trains `model` on this rank's share of every batch. `after_step(step)` runs on every
/// rank after each update (uncounted bookkeeping may use the communicator there).
Trace train(Communicator& comm, const Config& cfg, Model& model,
            const std::function<void(int step)>& after_step = {});

/// The single-device reference: the same training on the full batch, no communication,
/// on the host.
Trace train_single_device(const Config& cfg, Model& model);

/// "MLP 16 -> 64 -> 1, global batch 64 (1 micro-batch per rank), 20 steps".
std::string describe(const Config& cfg);

/// The first step (from 1) whose loss is not finite or has grown past `factor` times the
/// first step's: training blew up. 0 when it did not. Every step counts, not only the last:
/// a run that went up 10^6 times and came back down did not train, it was thrown about.
int diverged_at(const std::vector<double>& losses, double factor = 100);
/// "" when diverged_at(losses, factor) is 0; else "diverged at step N (loss L, from F at
/// step 1)".
std::string divergence(const std::vector<double>& losses, double factor = 100);

/// Why the comparison of `trace` (distributed) with `reference` (single device) means
/// nothing, or "": the reference blew up ("training diverged at step N (loss L, ...):
/// lower --lr"), or only the distributed run did (a fault in the sync).
std::string divergence_failure(const Trace& reference, const Trace& trace, float lr);
/// max over steps of |loss - reference loss| / reference loss; infinite when `trace`
/// diverged.
double loss_curve_diff(const Trace& reference, const Trace& trace);

/// Bytes one rank holds: its model (parameters and gradients), the
/// teacher and the single-device reference (parameters and gradients), the weight
/// gradient's temporary and what each rank thread's allocator keeps after the reference
/// has run: 16 times the parameters measured (in = hidden = 2048), 18 here; plus a batch
/// and its activations.
double bytes_per_rank(const Config& cfg);

}  // namespace ch02
