// Training chapter 07's router, with and without the load-balancing loss (moe.hpp).
#include <cmath>

#include "moe.hpp"

using namespace shardlab;

namespace ch07 {

namespace {
/// The direction every training token leans along (unit length).
Tensor lean(const MoeConfig& c) {
  return scale(full(Shape{c.hidden}, 1.0f), 1.0f / std::sqrt(static_cast<float>(c.hidden)));
}
}  // namespace

Batch leaning_batch(const MoeConfig& c, std::uint64_t step) {
  const Tensor u = lean(c);
  const float root_d = std::sqrt(static_cast<float>(c.hidden));
  Tensor x = randn(Shape{c.tokens, c.hidden}, c.seed * 7919 + 1000 + step);
  for (std::int64_t t = 0; t < c.tokens; ++t)
    for (std::int64_t i = 0; i < c.hidden; ++i) x(t, i) += 1.5f * u[i] * root_d;
  const Tensor A = scale(randn(Shape{c.hidden, c.hidden}, c.seed * 7919 + 21),
                         1.0f / std::sqrt(static_cast<float>(c.hidden)));
  return {x, add(x, scale(tanh(matmul(x, A)), 0.5f))};
}

TrainRun train(Communicator& comm, const MoeConfig& c, const TrainSettings& s) {
  const int N = comm.size(), per = c.experts / N;
  Weights init = make_weights(c, comm.rank() * per, per);
  const Tensor u = lean(c);
  for (std::int64_t i = 0; i < c.hidden; ++i) init.router(i, 0) += 2.0f * u[i];
  nn::ParameterStore store;
  MoeLayer layer(store, comm, c, init);
  store.allocate(s.memory);
  nn::Adam adam(store.size(), {.lr = s.lr}, s.memory);
  const ShardRange mine = shard_range(c.tokens, N, comm.rank());
  TrainRun run;
  for (int step = 1; step <= s.steps; ++step) {
    // A fresh batch each step; this rank's share of it.
    const Batch batch = leaning_batch(c, static_cast<std::uint64_t>(step));
    const Tensor x = batch.x.slice(mine.offset, mine.length);
    const Tensor target = batch.target.slice(mine.offset, mine.length);
    nn::Forward f = layer.forward(x.to(s.memory));
    const RoutingStats stats = combined(comm, layer.stats(f.saved));
    const Tensor y = f.out.to(Memory::host);
    // L = sum over every rank's tokens of |y - target|^2 / 2T (+ the aux loss).
    run.loss.push_back(comm.agree(nn::squared_error(y, target), ReduceOp::sum) / (2.0 * c.tokens));
    run.kept.push_back(stats.kept);
    run.aux_loss.push_back(stats.aux_loss);
    run.dropped_fraction.push_back(static_cast<double>(stats.dropped) / (c.k * c.tokens));
    store.zero_grad();
    const Tensor dy = scale(sub(y, target), 1.0f / static_cast<float>(c.tokens));
    layer.backward(dy.to(s.memory), f.saved);
    adam.step(store.values(), store.grads());
  }
  run.weights = layer.weights();
  return run;
}

}  // namespace ch07
