// Chapter 02's training loop (see trainer.hpp).
#include "trainer.hpp"

#include <algorithm>
#include <chrono>

#include "shardlab/check.hpp"
#include "shardlab/comm_threads.hpp"

namespace ch02 {

using shardlab::Memory;
using shardlab::shard;
using shardlab::shard_range;
namespace nn = shardlab::nn;

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

Mlp::Mlp(const Config& cfg) {
  layers_.add<nn::Linear>(store_, "l1", cfg.in, cfg.hidden, cfg.seed * 4 + 1);
  layers_.add<nn::Tanh>();
  layers_.add<nn::Linear>(store_, "l2", cfg.hidden, 1, cfg.seed * 4 + 2);
  store_.allocate(cfg.memory);
}

nn::Forward Mlp::forward(const Tensor& x) const { return layers_.forward(x); }

void Mlp::backward(const Tensor& dpred, nn::Saved& saved, const std::function<void(int)>& ready) {
  // Layer by layer, so that layer 2's gradients can be announced before layer 1's exist.
  const Tensor dh = layers_[2].backward(dpred, saved.children[2]);  // W2, b2 final here
  if (ready) ready(2);
  const Tensor dz = layers_[1].backward(dh, saved.children[1]);
  // The first layer's input is the data: only its weight gradient is needed. (Its
  // backward_input would compute dL/dx for nothing.)
  nn::Saved& first = saved.children[0];
  first.dy = dz;
  layers_[0].backward_weight(first);  // W1, b1
  if (ready) ready(1);
}

Mlp make_teacher(const Config& cfg) {
  // Fixed weights, a different seed stream from the student's, on the host.
  Config teacher = cfg;
  teacher.seed = cfg.seed + 0x7eac4e5ull;
  teacher.memory = Memory::host;
  return Mlp(teacher);
}

void make_batch(const Config& cfg, const Mlp& teacher, int step, Tensor& x, Tensor& y) {
  x = shardlab::randn(cfg.batch, cfg.in,
                      cfg.seed * 1000003ull + static_cast<std::uint64_t>(step) + 17);
  y = teacher.forward(x).out;
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
  const std::vector<Parameter*> params = model.parameters();
  Tensor& grads = model.store().grads();
  const std::vector<Bucket> buckets =
      plan_buckets(params, static_cast<std::int64_t>(cfg.bucket_kb * 1024.0));
  const Mlp teacher = make_teacher(cfg);

  Trace trace;
  trace.buckets = cfg.sync == Sync::bucketed || cfg.sync == Sync::overlap ? buckets.size() : 0;
  const shardlab::CommStats start = comm.stats();
  Tensor x, y;
  for (int step = 0; step < cfg.steps; ++step) {
    const Clock::time_point step_start = Clock::now();
    make_batch(cfg, teacher, step, x, y);
    const Tensor x_r = shard(x, P, 0, r), y_r = shard(y, P, 0, r);  // my rows of the batch
    trace.batch_s += seconds_since(step_start);
    const Clock::time_point t_zero = Clock::now();
    model.store().zero_grad();
    double squared = 0, compute = seconds_since(t_zero), wait = 0;
    std::size_t launched = 0;
    std::vector<Request> pending;
    std::vector<bool> ready(params.size(), false);

    // Forward and backward over k micro-batches; gradients add up to my rows' mean.
    for (int m = 0; m < cfg.accum_steps; ++m) {
      const bool last = m == cfg.accum_steps - 1;
      const Clock::time_point t0 = Clock::now();
      const Tensor xm = shard(x_r, cfg.accum_steps, 0, m).to(cfg.memory);
      const Tensor ym = shard(y_r, cfg.accum_steps, 0, m).to(cfg.memory);
      nn::Forward f = model.forward(xm);
      squared += nn::squared_error(f.out, ym);
      // Overlap: on the last micro-batch, start each bucket's allreduce as soon as all of
      // its gradients are final; it runs while backward goes on.
      auto on_ready = [&](int layer) {
        if (!last || cfg.sync != Sync::overlap) return;
        for (std::size_t i = 0; i < params.size(); ++i)
          if (layer_of[i] == layer) ready[i] = true;
        while (launched < buckets.size() &&
               std::all_of(buckets[launched].params.begin(), buckets[launched].params.end(),
                           [&](std::size_t i) { return ready[i]; }))
          pending.push_back(
              start_bucket_allreduce(comm, grads, buckets[launched++], local_batch, cfg.batch));
      };
      model.backward(
          nn::mse_backward(f.out, ym, static_cast<double>(std::max<std::int64_t>(local_batch, 1))),
          f.saved, on_ready);
      compute += seconds_since(t0);
    }

    // Sync the gradients.
    const Clock::time_point t1 = Clock::now();
    switch (cfg.sync) {
      case Sync::none:
        break;
      case Sync::allreduce:
        allreduce_gradients(comm, params, local_batch, cfg.batch);
        break;
      case Sync::bucketed:
        for (const Bucket& b : buckets) {
          Request request = start_bucket_allreduce(comm, grads, b, local_batch, cfg.batch);
          comm.wait(request);
        }
        break;
      case Sync::overlap:
        comm.wait_all(pending);
        break;
    }
    wait += seconds_since(t1);

    const Clock::time_point t2 = Clock::now();
    nn::sgd_step(model.store().values(), grads, cfg.lr);  // one pass over the flat buffers
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
  Trace trace;
  Config single = cfg;
  single.sync = Sync::none;
  single.accum_steps = 1;
  shardlab::run_threads(1, [&](Communicator& alone) { trace = train(alone, single, model); });
  return trace;
}

}  // namespace ch02
