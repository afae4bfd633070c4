// Chapter 02's training loop (see trainer.hpp).
#include "trainer.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "shardlab/comm_threads.hpp"
#include "shardlab/format.hpp"
#include "shardlab/timer.hpp"

namespace ch02 {

using shardlab::shard;
using shardlab::shard_range;
using shardlab::Stopwatch;
namespace nn = shardlab::nn;
namespace toy = shardlab::toy;

Model::Model(const Config& cfg) : layers(toy::mlp(store, cfg.model())) {
  store.allocate(cfg.memory);
}

Trace train(Communicator& comm, const Config& cfg, Model& model,
            const std::function<void(int)>& after_step) {
  const int P = comm.size(), r = comm.rank();
  const std::int64_t local_batch = shard_range(cfg.batch, P, r).length;
  // [grad_sync]
  GradSync sync(comm, model.store, {.mode = cfg.sync, .bucket_bytes = cfg.bucket_bytes()});
  sync.set_batch(local_batch, cfg.batch);
  // [grad_sync]
  const toy::Teacher teacher(cfg.model(), cfg.seed);

  Trace trace;
  trace.buckets = sync.buckets().size();
  const shardlab::CommStats start = comm.stats();
  for (int step = 0; step < cfg.steps; ++step) {
    Stopwatch watch;
    const toy::Batch batch = teacher.batch(cfg.batch, step);
    const Tensor x_r = shard(batch.x, P, 0, r), y_r = shard(batch.y, P, 0, r);  // my rows
    trace.batch_s += watch.seconds();
    Stopwatch compute;
    model.store.zero_grad();
    double squared = 0;

    // [accumulate]
    // Forward and backward over k micro-batches; gradients add up to my rows' mean. Only
    // the last one syncs (DDP's no_sync() for the others); in overlap mode its backward
    // starts each bucket's allreduce as soon as the bucket's gradients are final.
    for (int m = 0; m < cfg.accum_steps; ++m) {
      sync.set_enabled(m == cfg.accum_steps - 1);
      const Tensor xm = shard(x_r, cfg.accum_steps, 0, m).to(cfg.memory);
      const Tensor ym = shard(y_r, cfg.accum_steps, 0, m).to(cfg.memory);
      nn::Forward f = model.layers.forward(xm);
      squared += nn::squared_error(f.out, ym);
      const double rows = static_cast<double>(std::max<std::int64_t>(local_batch, 1));
      backward(model.layers, nn::mse_backward(f.out, ym, rows), f.saved, sync,
               /*input_gradient=*/false);
    }
    double compute_s = compute.seconds();

    Stopwatch wait;
    sync.finish();  // the weighted average, on every rank
    // [accumulate]
    trace.comm_wait_s += wait.seconds();

    Stopwatch update;
    nn::sgd_step(model.store.values(), model.store.grads(), cfg.lr);  // one pass, flat buffers
    compute_s += update.seconds();
    trace.compute_s += compute_s;
    trace.step_s += watch.seconds();

    // The global loss, for the record (bookkeeping, not counted). Summed here in rank
    // order, so every backend reports the same bits.
    double total = 0;
    for (double sq : comm.gather_values(squared)) total += sq;
    trace.losses.push_back(total / (2.0 * static_cast<double>(cfg.batch)));
    if (after_step) after_step(step);
  }
  trace.allreduce = comm.stats().since(start)[shardlab::Op::allreduce];
  return trace;
}

Trace train_single_device(const Config& cfg, Model& model) {
  Trace trace;
  Config single = cfg;
  single.sync = Sync::none;
  single.accum_steps = 1;
  shardlab::run_threads(1, [&](Communicator& alone) { trace = train(alone, single, model); });
  return trace;
}

int diverged_at(const std::vector<double>& losses, double factor) {
  for (std::size_t s = 0; s < losses.size(); ++s)
    if (!std::isfinite(losses[s]) || losses[s] > factor * losses.front())
      return static_cast<int>(s) + 1;
  return 0;
}

std::string describe(const Config& cfg) {
  const int k = cfg.accum_steps;
  return "MLP " + std::to_string(cfg.in) + " -> " + std::to_string(cfg.hidden) +
         " -> 1, global batch " + std::to_string(cfg.batch) + " (" + std::to_string(k) +
         (k == 1 ? " micro-batch" : " micro-batches") + " per rank), " + std::to_string(cfg.steps) +
         " steps";
}

std::string divergence(const std::vector<double>& losses, double factor) {
  using shardlab::format_number;
  const int at = diverged_at(losses, factor);
  if (at == 0) return "";
  return "diverged at step " + std::to_string(at) + " (loss " +
         format_number(losses[static_cast<std::size_t>(at - 1)], 4) + ", from " +
         format_number(losses.front(), 4) + " at step 1)";
}

std::string divergence_failure(const Trace& reference, const Trace& trace, float lr) {
  if (const std::string why = divergence(reference.losses); !why.empty())
    return "training " + why + ": lower --lr (" + shardlab::format_number(lr) +
           " is too large for this model)";
  if (const int own = diverged_at(trace.losses); own > 0)
    return "the distributed run diverged at step " + std::to_string(own) + " (loss " +
           shardlab::format_number(trace.losses[static_cast<std::size_t>(own - 1)], 4) +
           ") while the single-device run trained";
  return "";
}

double loss_curve_diff(const Trace& reference, const Trace& trace) {
  if (diverged_at(trace.losses) > 0) return std::numeric_limits<double>::infinity();
  double diff = 0;
  for (std::size_t s = 0; s < trace.losses.size(); ++s)
    diff = std::max(diff, std::fabs(trace.losses[s] - reference.losses[s]) /
                              std::max(1e-30, reference.losses[s]));
  return diff;
}

double bytes_per_rank(const Config& cfg) {
  const auto I = static_cast<double>(cfg.in), H = static_cast<double>(cfg.hidden);
  const double params = I * H + 2.0 * H + 1.0;
  const double batch = static_cast<double>(cfg.batch) * (2.0 * I + 4.0 * H);
  return 4.0 * (18.0 * params + batch);
}

}  // namespace ch02
