// Data parallelism for the pipelined trainers (replica_optimizer.hpp).
#include "replica_optimizer.hpp"

#include <algorithm>

#include "grad_sync.hpp"
#include "zero.hpp"

namespace ch08 {

namespace nn = shardlab::nn;

ReplicaOptimizer::ReplicaOptimizer(shardlab::Communicator& dp, nn::ParameterStore& store, int zero,
                                   const nn::AdamConfig& adam, bool sgd, shardlab::Memory memory)
    : store_(store), dp_(dp), lr_(adam.lr) {
  if (zero == 1) {
    zero_ = std::make_unique<ch05::ZeroOptimizer>(dp, store,
                                                  ch05::ZeroConfig{.stage = 1, .adam = adam});
    return;
  }
  set_buckets(0, false);
  if (!sgd) adam_ = std::make_unique<nn::Adam>(store.size(), adam, memory);
}

void ReplicaOptimizer::set_buckets(std::int64_t bucket_bytes, bool overlap) {
  if (zero_) return;
  const std::int64_t whole = std::max<std::int64_t>(4 * store_.size(), 1);
  sync_ = std::make_unique<ch02::GradSync>(
      dp_, store_,
      ch02::GradSyncConfig{.mode = overlap ? ch02::Sync::overlap : ch02::Sync::bucketed,
                           .bucket_bytes = bucket_bytes > 0 ? bucket_bytes : whole});
  sync_->set_batch(1, 1);  // each loss is already its share of the global mean: weight 1
}

void ReplicaOptimizer::ready(const nn::Parameter& param) {
  if (sync_ && sync_->holds(param)) sync_->ready(param);
}

void ReplicaOptimizer::ready(const nn::Layer& layer) {
  for (const nn::Parameter* p : layer.parameters()) ready(*p);
}

ReplicaOptimizer::~ReplicaOptimizer() = default;

// [no_sync_hook]
void ReplicaOptimizer::accumulate(ch04::Hooks& hooks) {
  if (!sync_) return;
  sync_->set_enabled(false);  // the microbatches accumulate; the last backward syncs
  // After whatever the hook did already (another optimizer's sync, of other weights).
  hooks.before_last_backward = [this, before = hooks.before_last_backward] {
    if (before) before();
    sync_->set_enabled(true);
  };
}
// [no_sync_hook]

void ReplicaOptimizer::reduce() {
  if (sync_) sync_->finish();
}

ReplicaOptimizer::Reduced ReplicaOptimizer::reduced() {
  if (zero_) return {zero_->reduce_now(), zero_->shard_offset(), false};
  return {store_.grads(), 0, true};
}

ReplicaOptimizer::State ReplicaOptimizer::state() const {
  if (zero_) {
    const ch05::Shard& shard = zero_->shard();
    return {shard.m, shard.v, shard.range.offset, shard.step, false};
  }
  if (adam_) return {adam_->m(), adam_->v(), 0, adam_->steps(), true};
  return {};
}

void ReplicaOptimizer::restore(const shardlab::Tensor& m, const shardlab::Tensor& v, int steps) {
  if (zero_) return zero_->restore(m, v, steps);
  if (adam_) adam_->restore(m, v, steps);
}

void ReplicaOptimizer::skip() {
  if (zero_) zero_->skip_step();
}

void ReplicaOptimizer::update() {
  if (zero_) return zero_->step();
  if (adam_)
    adam_->step(store_.values(), store_.grads());
  else
    nn::sgd_step(store_.values(), store_.grads(), lr_);
}

}  // namespace ch08
