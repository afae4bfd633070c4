// Data parallelism for the pipelined trainers (replica_optimizer.hpp).
#include "replica_optimizer.hpp"

#include <algorithm>

#include "grad_sync.hpp"
#include "zero.hpp"

namespace ch08 {

namespace nn = shardlab::nn;

ReplicaOptimizer::ReplicaOptimizer(shardlab::Communicator& dp, nn::ParameterStore& store, int zero,
                                   const nn::AdamConfig& adam, bool sgd, shardlab::Memory memory)
    : store_(store), dp_(dp), lr_(adam.lr), adam_config_(adam) {
  if (zero == 1) {
    zero_ = std::make_unique<ch05::ZeroOptimizer>(dp, store,
                                                  ch05::ZeroConfig{.stage = 1, .adam = adam});
    return;
  }
  set_buckets(0, false);
  if (!sgd) adam_ = std::make_unique<nn::Adam>(store.size(), adam, memory);
}

void ReplicaOptimizer::set_buckets(std::int64_t bucket_bytes, bool overlap) {
  if (zero_) {  // runs of parameters of about bucket_bytes, in the store's order
    std::vector<std::vector<nn::Parameter*>> buckets(1);
    std::int64_t bytes = 0;
    for (nn::Parameter* p : store_.parameters()) {
      if (bucket_bytes > 0 && bytes >= bucket_bytes) buckets.emplace_back(), bytes = 0;
      buckets.back().push_back(p);
      bytes += 4 * p->value.size();
    }
    if (buckets.size() == 1) return;  // the whole store: chapter 05's stage 1 as it is
    bucket_of_.clear();
    size_in_params_.clear();
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      for (const nn::Parameter* p : buckets[b]) bucket_of_[p] = static_cast<int>(b);
      size_in_params_.push_back(static_cast<int>(buckets[b].size()));
    }
    left_ = size_in_params_;
    late_.assign(buckets.size(), false);
    bucket_sizes_ = ch05::group_sizes(buckets, store_);
    overlap_ = overlap;
    zero_.reset();  // the one-bucket optimizer's state goes before the new one's comes
    zero_ = std::make_unique<ch05::ZeroOptimizer>(
        dp_, store_,
        ch05::ZeroConfig{.stage = 1, .adam = adam_config_, .by_group = true, .overlap = overlap},
        std::move(buckets));
    return;
  }
  const std::int64_t whole = std::max<std::int64_t>(4 * store_.size(), 1);
  sync_ = std::make_unique<ch02::GradSync>(
      dp_, store_,
      ch02::GradSyncConfig{.mode = overlap ? ch02::Sync::overlap : ch02::Sync::bucketed,
                           .bucket_bytes = bucket_bytes > 0 ? bucket_bytes : whole});
  sync_->set_batch(1, 1);  // each loss is already its share of the global mean: weight 1
}

void ReplicaOptimizer::ready(const nn::Parameter& param) {
  if (sync_ && sync_->holds(param)) sync_->ready(param);
  const auto it = bucket_of_.find(&param);
  if (!zero_ || !overlap_ || !enabled_ || it == bucket_of_.end()) return;
  const auto b = static_cast<std::size_t>(it->second);
  if (--left_[b] == 0 && !late_[b]) zero_->reduce_group(it->second);
}

void ReplicaOptimizer::set_late(const std::vector<nn::Parameter*>& params) {
  for (const nn::Parameter* p : params)
    if (const auto it = bucket_of_.find(p); it != bucket_of_.end())
      late_[static_cast<std::size_t>(it->second)] = true;
}

void ReplicaOptimizer::wait_values(const std::vector<nn::Parameter*>& params) {
  if (!zero_ || !overlap_) return;
  for (const nn::Parameter* p : params)
    if (const auto it = bucket_of_.find(p); it != bucket_of_.end()) zero_->wait_values(it->second);
}

void ReplicaOptimizer::wait_values() {
  if (zero_) zero_->wait_values();
}

void ReplicaOptimizer::start_values() {
  if (zero_) zero_->start_gathers();
}

std::uint64_t ReplicaOptimizer::values_in_flight_sent() const {
  return zero_ ? zero_->values_in_flight_sent() : 0;
}

std::vector<std::int64_t> ReplicaOptimizer::bucket_elements() const {
  if (!bucket_sizes_.empty()) return bucket_sizes_;  // ZeRO-1's
  std::vector<std::int64_t> out;
  if (sync_) {
    std::vector<ch02::Bucket> plan = sync_->buckets();
    std::sort(plan.begin(), plan.end(), [](auto& a, auto& b) { return a.offset < b.offset; });
    for (const ch02::Bucket& b : plan) out.push_back(b.elements);
  }
  if (out.empty()) out.push_back(store_.size());
  return out;
}

void ReplicaOptimizer::ready(const nn::Layer& layer) {
  for (const nn::Parameter* p : layer.parameters()) ready(*p);
}

ReplicaOptimizer::~ReplicaOptimizer() = default;

// [no_sync_hook]
void ReplicaOptimizer::accumulate(ch04::Hooks& hooks) {
  // The microbatches accumulate; the last backward syncs.
  if (sync_) sync_->set_enabled(false);
  enabled_ = false;
  left_ = size_in_params_;
  // After whatever the hook did already (another optimizer's sync, of other weights).
  hooks.before_last_backward = [this, before = hooks.before_last_backward] {
    if (before) before();
    if (sync_) sync_->set_enabled(true);
    enabled_ = true;
  };
}
// [no_sync_hook]

void ReplicaOptimizer::reduce() {
  if (sync_) sync_->finish();
}

ReplicaOptimizer::Reduced ReplicaOptimizer::reduced() {
  if (zero_) return {zero_->reduce_now(), zero_->shard_ranges(), false};
  return {store_.grads(), {{0, store_.size()}}, true};
}

ReplicaOptimizer::State ReplicaOptimizer::state() const {
  if (zero_) {             // over the range shard_range(P, N, r), whatever the buckets
    zero_->wait_values();  // what a save reads next
    const ch05::ZeroOptimizer::RangeState s = zero_->range_state();
    return {s.m, s.v, s.range.offset, s.steps, false};
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
