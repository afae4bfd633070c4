// Chapter 02's training loop (see trainer.hpp).
#include "trainer.hpp"

#include <algorithm>
#include <chrono>
#include <memory>

#include "shardlab/check.hpp"
#include "shardlab/comm_thread.hpp"
#include "shardlab/comm_threads.hpp"
#include "shardlab/cuda.hpp"

namespace ch02 {

using shardlab::shard;
using shardlab::shard_range;
namespace nn = shardlab::nn;
namespace cuda = shardlab::cuda;

Sync parse_sync(std::string_view name) {
  for (Sync s : {Sync::none, Sync::allreduce, Sync::bucketed, Sync::overlap})
    if (sync_name(s) == name) return s;
  throw shardlab::UsageError("unknown --sync '" + std::string(name) +
                             "' (none, allreduce, bucketed, overlap)");
}

std::string_view sync_name(Sync sync) {
  switch (sync) {
    case Sync::none:
      return "none";
    case Sync::allreduce:
      return "allreduce";
    case Sync::bucketed:
      return "bucketed";
    case Sync::overlap:
      return "overlap";
  }
  return "?";
}

// ---------------------------------------------------------------------------
// The model

struct Mlp::Device {
  cuda::DeviceTensor x, w1, w2, h;
};

Mlp::Mlp(const Config& cfg)
    : l1_(cfg.in, cfg.hidden, cfg.seed * 4 + 1),
      l2_(cfg.hidden, 1, cfg.seed * 4 + 2),
      device_(cfg.gpu ? std::make_unique<Device>() : nullptr) {}

Mlp::Mlp(const Mlp& other)
    : l1_(other.l1_),
      l2_(other.l2_),
      h_(other.h_),
      device_(other.device_ ? std::make_unique<Device>() : nullptr) {}

Mlp::~Mlp() = default;

Tensor Mlp::forward(const Tensor& x) {
  if (!device_) {
    h_ = nn::tanh_forward(l1_.forward(x));
    return l2_.forward(h_);
  }
  // On the GPU: the weights changed at the last update, so they go up with the input.
  using cuda::DeviceTensor;
  Device& d = *device_;
  d.x = DeviceTensor::to_device(x);
  d.w1 = DeviceTensor::to_device(l1_.weight.value);
  d.w2 = DeviceTensor::to_device(l2_.weight.value);
  DeviceTensor z1 = cuda::matmul(d.x, d.w1);
  cuda::add_row(z1, DeviceTensor::to_device(l1_.bias.value));
  d.h = cuda::tanh_forward(z1);
  DeviceTensor pred = cuda::matmul(d.h, d.w2);
  cuda::add_row(pred, DeviceTensor::to_device(l2_.bias.value));
  return pred.to_host();
}

namespace {
/// grad += what the GPU computed (gradients accumulate over micro-batches).
void accumulate(nn::Parameter& p, const cuda::DeviceTensor& g) {
  const Tensor host = g.to_host();
  for (std::int64_t i = 0; i < host.size(); ++i) p.grad[i] += host[i];
}
}  // namespace

void Mlp::backward(const Tensor& dpred, const std::function<void(int)>& ready) {
  if (!device_) {
    const Tensor dh = l2_.backward(dpred);  // W2, b2 gradients are final here
    if (ready) ready(2);
    l1_.backward(nn::tanh_backward(h_, dh));
    if (ready) ready(1);
    return;
  }
  // The same steps on the GPU: dW = input^T @ dy, db = column sums of dy, dx = dy @ W^T.
  Device& d = *device_;
  const auto dy = cuda::DeviceTensor::to_device(dpred);
  accumulate(l2_.weight, cuda::matmul(d.h, dy, true, false));
  accumulate(l2_.bias, cuda::column_sums(dy));
  if (ready) ready(2);
  const cuda::DeviceTensor dz = cuda::tanh_backward(d.h, cuda::matmul(dy, d.w2, false, true));
  accumulate(l1_.weight, cuda::matmul(d.x, dz, true, false));
  accumulate(l1_.bias, cuda::column_sums(dz));
  if (ready) ready(1);
}

std::vector<nn::Parameter*> Mlp::parameters() {
  return {&l1_.weight, &l1_.bias, &l2_.weight, &l2_.bias};
}

void Mlp::zero_grad() {
  for (nn::Parameter* p : parameters()) std::fill(p->grad.begin(), p->grad.end(), 0.0f);
}

void make_batch(const Config& cfg, int step, Tensor& x, Tensor& y) {
  // The teacher: fixed weights, a different seed stream from the student's.
  Config teacher_cfg = cfg;
  teacher_cfg.seed = cfg.seed + 0x7eac4e5ull;
  teacher_cfg.gpu = false;
  static thread_local std::unique_ptr<Mlp> teacher;
  static thread_local std::uint64_t teacher_key = ~0ull;
  const std::uint64_t key = teacher_cfg.seed ^ (static_cast<std::uint64_t>(cfg.in) << 32) ^
                            static_cast<std::uint64_t>(cfg.hidden);
  if (!teacher || teacher_key != key) {
    teacher = std::make_unique<Mlp>(teacher_cfg);
    teacher_key = key;
  }
  x = shardlab::randn(cfg.batch, cfg.in,
                      cfg.seed * 1000003ull + static_cast<std::uint64_t>(step) + 17);
  y = teacher->forward(x);
}

// ---------------------------------------------------------------------------
// Training

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}
}  // namespace

Trace train(Communicator& comm, const Config& cfg, Mlp& model,
            const std::function<void(int)>& after_step) {
  const int P = comm.size(), r = comm.rank();
  const std::int64_t local_batch = shard_range(cfg.batch, P, r).length;
  std::vector<nn::Parameter*> params = model.parameters();
  // Gradients in the order backward produces them (b2, W2, b1, W1), as DDP buckets them.
  std::vector<Tensor*> grads;
  for (auto it = params.rbegin(); it != params.rend(); ++it) grads.push_back(&(*it)->grad);
  const std::vector<Bucket> buckets =
      plan_buckets(grads, static_cast<std::int64_t>(cfg.bucket_kb * 1024.0));
  // Which layer each gradient (in `grads` order) belongs to.
  const int layer_of[] = {2, 2, 1, 1};
  std::unique_ptr<shardlab::CommThread> comm_thread;
  if (cfg.sync == Sync::overlap) comm_thread = std::make_unique<shardlab::CommThread>();

  Trace trace;
  trace.buckets = cfg.sync == Sync::bucketed || cfg.sync == Sync::overlap ? buckets.size() : 0;
  const shardlab::CommStats start = comm.stats();
  Tensor x, y;
  for (int step = 0; step < cfg.steps; ++step) {
    const Clock::time_point step_start = Clock::now();
    make_batch(cfg, step, x, y);
    const Tensor x_r = shard(x, P, 0, r), y_r = shard(y, P, 0, r);  // my rows of the batch
    model.zero_grad();
    double squared = 0, compute = 0, wait = 0;
    std::size_t launched = 0;
    std::vector<bool> ready(grads.size(), false);

    // Forward and backward over k micro-batches; gradients add up to my rows' mean.
    for (int m = 0; m < cfg.accum_steps; ++m) {
      const bool last = m == cfg.accum_steps - 1;
      const Clock::time_point t0 = Clock::now();
      const Tensor xm = shard(x_r, cfg.accum_steps, 0, m), ym = shard(y_r, cfg.accum_steps, 0, m);
      const Tensor pred = model.forward(xm);
      squared += nn::squared_error(pred, ym);
      // Overlap: on the last micro-batch, hand each bucket to the communication thread
      // as soon as all of its gradients are final.
      auto on_ready = [&](int layer) {
        if (!last || cfg.sync != Sync::overlap) return;
        for (std::size_t i = 0; i < grads.size(); ++i)
          if (layer_of[i] == layer) ready[i] = true;
        while (launched < buckets.size() &&
               std::all_of(buckets[launched].tensors.begin(), buckets[launched].tensors.end(),
                           [&](std::size_t i) { return ready[i]; })) {
          const Bucket* b = &buckets[launched++];
          comm_thread->submit([&comm, b, &grads, local_batch, &cfg] {
            allreduce_bucket(comm, *b, grads, local_batch, cfg.batch);
          });
        }
      };
      model.backward(
          nn::mse_backward(pred, ym, static_cast<double>(std::max<std::int64_t>(local_batch, 1))),
          on_ready);
      compute += seconds_since(t0);
    }

    // Sync the gradients.
    const Clock::time_point t1 = Clock::now();
    switch (cfg.sync) {
      case Sync::none:
        break;
      case Sync::allreduce:
        allreduce_gradients(comm, grads, local_batch, cfg.batch);
        break;
      case Sync::bucketed:
        for (const Bucket& b : buckets) allreduce_bucket(comm, b, grads, local_batch, cfg.batch);
        break;
      case Sync::overlap:
        comm_thread->wait_all();
        break;
    }
    wait += seconds_since(t1);

    const Clock::time_point t2 = Clock::now();
    for (nn::Parameter* p : params) nn::sgd_step(*p, cfg.lr);
    compute += seconds_since(t2);
    trace.compute_s += compute;
    trace.comm_wait_s += wait;
    trace.step_s += seconds_since(step_start);

    // The global loss, for the record (bookkeeping, not counted). Summed here in rank
    // order, so every backend reports the same bits.
    const std::vector<double> squares = comm.gather_values(squared);
    double total = 0;
    for (double sq : squares) total += sq;
    trace.losses.push_back(total / (2.0 * static_cast<double>(cfg.batch)));
    if (after_step) after_step(step);
  }
  trace.allreduce = comm.stats().since(start)[shardlab::Op::allreduce];
  return trace;
}

Trace train_single_device(const Config& cfg, Mlp& model) {
  shardlab::ThreadWorld world(1, std::chrono::seconds(60));
  auto alone = world.communicator(0);
  Config single = cfg;
  single.sync = Sync::none;
  single.accum_steps = 1;
  single.gpu = false;  // the reference is always the CPU
  return train(*alone, single, model);
}

}  // namespace ch02
