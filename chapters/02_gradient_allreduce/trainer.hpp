// Chapter 02's training loop: a 2-layer MLP trained with SGD on a seeded regression
// task, the global batch split across ranks, gradients synced as --sync says. The
// chapter owns it (it is not an exercise); it calls the exercise's grad_sync functions.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "grad_sync.hpp"
#include "shardlab/nn.hpp"

namespace ch02 {

/// none: every replica steps on its own gradient (they drift apart);
/// allreduce: one allreduce per gradient tensor; bucketed: one per bucket;
/// overlap: bucket allreduces run on a communication thread while backward goes on.
enum class Sync { none, allreduce, bucketed, overlap };
Sync parse_sync(std::string_view name);
std::string_view sync_name(Sync sync);

struct Config {
  std::int64_t in = 16;      // I: input features
  std::int64_t hidden = 64;  // H: hidden units
  std::int64_t batch = 64;   // B: global batch, split across ranks
  int steps = 20;
  int accum_steps = 1;  // k: micro-batches per step; one sync per step
  float lr = 0.05f;
  Sync sync = Sync::allreduce;
  double bucket_kb = 1.0;  // bucket capacity for bucketed and overlap
  std::uint64_t seed = 0;
  bool gpu = false;  // forward and backward on this rank's GPU (cuBLAS)
};

/// x -> Linear(I, H) -> tanh -> Linear(H, 1). Parameters in order W1, b1, W2, b2.
/// The parameters and their gradients always live on the host, where they are synced and
/// updated; with cfg.gpu the matmuls of forward and backward run on the GPU, and the
/// gradients come back to the host (as through a non-CUDA-aware MPI).
class Mlp {
 public:
  Mlp(const Config& cfg);
  Mlp(const Mlp& other);
  Mlp& operator=(const Mlp&) = delete;
  ~Mlp();
  Tensor forward(const Tensor& x);
  /// Backward from dL/dpred; calls ready(layer) once layer 2's, then layer 1's gradients
  /// are final (what overlap hooks into).
  void backward(const Tensor& dpred, const std::function<void(int layer)>& ready = {});
  std::vector<shardlab::nn::Parameter*> parameters();
  void zero_grad();

 private:
  shardlab::nn::Linear l1_, l2_;
  Tensor h_;      // tanh output, kept for backward
  struct Device;  // the GPU's copies of the input, the weights and h (with cfg.gpu)
  std::unique_ptr<Device> device_;
};

/// Step t's global batch: x is B x I standard normal, y = teacher(x) (a fixed random
/// 2-layer network of the same shape), both from the seed.
void make_batch(const Config& cfg, int step, Tensor& x, Tensor& y);

struct Trace {
  std::vector<double> losses;             // global mean loss before each step's update
  double compute_s = 0, comm_wait_s = 0;  // this rank's totals
  double step_s = 0;
  shardlab::OpStats allreduce;  // this rank's allreduce traffic, all steps
  std::size_t buckets = 0;
};

/// Trains `model` on this rank's share of every batch. `after_step(step)` runs on every
/// rank after each update (uncounted bookkeeping may use the communicator there).
Trace train(Communicator& comm, const Config& cfg, Mlp& model,
            const std::function<void(int step)>& after_step = {});

/// The single-device reference: the same training on the full batch, no communication.
Trace train_single_device(const Config& cfg, Mlp& model);

}  // namespace ch02
