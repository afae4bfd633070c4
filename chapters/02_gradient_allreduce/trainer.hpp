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
/// allreduce: one allreduce per gradient tensor; bucketed: one per bucket, each waited
/// for at once; overlap: each bucket's allreduce starts as soon as backward has finished
/// its gradients, and runs while backward goes on.
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
  shardlab::Memory memory = shardlab::Memory::host;  // where the model and batch live
};

/// x -> Linear(I, H) -> tanh -> Linear(H, 1). Parameters in order W1, b1, W2, b2, all in
/// one flat buffer (and their gradients in another) in cfg.memory: on a GPU, forward,
/// backward, the gradient sync and the update all run there.
class Mlp {
 public:
  explicit Mlp(const Config& cfg);
  Mlp(const Mlp&) = delete;  // the layers point into this model's own store
  Mlp& operator=(const Mlp&) = delete;

  shardlab::nn::Forward forward(const Tensor& x) const;
  /// Backward from dL/dpred through what forward saved; calls ready(layer) once layer 2's,
  /// then layer 1's gradients are final (what overlap hooks into).
  void backward(const Tensor& dpred, shardlab::nn::Saved& saved,
                const std::function<void(int layer)>& ready = {});
  std::vector<Parameter*> parameters() { return store_.parameters(); }
  shardlab::nn::ParameterStore& store() { return store_; }

 private:
  shardlab::nn::ParameterStore store_;
  shardlab::nn::Sequential layers_;  // Linear, Tanh, Linear
};

/// The layer (1 or 2) each parameter of an Mlp belongs to, in parameters() order.
inline constexpr int layer_of[] = {1, 1, 2, 2};

/// Step t's global batch: x is B x I standard normal, y = teacher(x) (a fixed random
/// 2-layer network of the same shape, made from the seed by make_teacher), on the host.
Mlp make_teacher(const Config& cfg);
void make_batch(const Config& cfg, const Mlp& teacher, int step, Tensor& x, Tensor& y);

struct Trace {
  std::vector<double> losses;  // global mean loss before each step's update
  // This rank's totals: making the batch, computing (forward, backward, update), and
  // waiting on communication; they add up to the step time.
  double batch_s = 0, compute_s = 0, comm_wait_s = 0;
  double step_s = 0;
  shardlab::OpStats allreduce;  // this rank's allreduce traffic, all steps
  std::size_t buckets = 0;
};

/// Trains `model` on this rank's share of every batch. `after_step(step)` runs on every
/// rank after each update (uncounted bookkeeping may use the communicator there).
Trace train(Communicator& comm, const Config& cfg, Mlp& model,
            const std::function<void(int step)>& after_step = {});

/// The single-device reference: the same training on the full batch, no communication,
/// on the host.
Trace train_single_device(const Config& cfg, Mlp& model);

}  // namespace ch02
