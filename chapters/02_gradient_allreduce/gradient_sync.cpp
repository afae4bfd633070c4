// GradSync (grad_sync.hpp): when to average which gradients. What averaging is — the
// weights, the buckets, the allreduce of a range — is the building blocks' job
// (allreduce_gradients, plan_buckets, start_bucket_allreduce: the learner's code).
#include <algorithm>
#include <string>

#include "grad_sync.hpp"
#include "shardlab/check.hpp"

namespace ch02 {

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

GradSync::GradSync(Communicator& comm, nn::ParameterStore& store, GradSyncConfig config)
    : comm_(comm),
      store_(store),
      config_(std::move(config)),
      params_(store.parameters()),
      global_batch_(comm.size()) {
  shardlab::require(store.allocated(), "GradSync: allocate the parameter store first");
  for (std::size_t i = 0; i < params_.size(); ++i) index_[params_[i]] = i;
  if (config_.mode == Sync::bucketed || config_.mode == Sync::overlap)
    buckets_ = plan_buckets(params_, config_.bucket_bytes);
  ready_.assign(params_.size(), false);
}

void GradSync::set_batch(std::int64_t local_batch, std::int64_t global_batch) {
  shardlab::require(global_batch > 0 && 0 <= local_batch && local_batch <= global_batch, [&] {
    return "GradSync: " + std::to_string(local_batch) + " of " + std::to_string(global_batch) +
           " rows is not a share of a batch";
  });
  local_batch_ = local_batch;
  global_batch_ = global_batch;
}

void GradSync::ready(std::size_t param) {
  shardlab::require(param < params_.size(), "GradSync::ready: no such parameter");
  if (!enabled_ || config_.mode != Sync::overlap) return;
  ready_[param] = true;
  start_ready_buckets();
}

void GradSync::ready(const Parameter& param) {
  const auto it = index_.find(&param);
  shardlab::require(it != index_.end(), [&] {
    return "GradSync::ready: " + param.name + " is not a parameter of this store";
  });
  ready(it->second);
}

void GradSync::ready(const nn::Layer& layer) {
  for (const Parameter* p : layer.parameters()) ready(*p);
}

void GradSync::start_ready_buckets() {
  // In plan order only, as DDP does: every rank then starts the same collectives in the
  // same order, whatever order its gradients became ready in.
  while (started_ < buckets_.size() &&
         std::all_of(buckets_[started_].params.begin(), buckets_[started_].params.end(),
                     [&](std::size_t i) { return ready_[i]; }))
    sync_bucket(started_++);
}

void GradSync::sync_bucket(std::size_t b) {
  const Bucket& bucket = buckets_[b];
  if (!config_.allreduce) {
    pending_.push_back(
        start_bucket_allreduce(comm_, store_.grads(), bucket, local_batch_, global_batch_));
    return;
  }
  // A plugged (blocking) allreduce: the bucket's range is averaged like one tensor.
  Parameter range{"bucket " + std::to_string(b), Tensor(),
                  store_.grads().slice(bucket.offset, bucket.elements), bucket.offset};
  Parameter* one[] = {&range};
  allreduce_gradients(comm_, one, local_batch_, global_batch_, config_.allreduce);
}

void GradSync::finish() {
  if (enabled_) {
    switch (config_.mode) {
      case Sync::none:
        break;
      case Sync::allreduce:
        allreduce_gradients(comm_, params_, local_batch_, global_batch_,
                            config_.allreduce ? config_.allreduce : AllreduceFn(native_allreduce));
        break;
      case Sync::bucketed:
        for (std::size_t b = 0; b < buckets_.size(); ++b) {
          sync_bucket(b);
          comm_.wait_all(pending_);
          pending_.clear();
        }
        break;
      case Sync::overlap:
        // Buckets whose gradients were never announced (a trainer without ready() calls,
        // a parameter backward did not reach) start now, still in plan order.
        while (started_ < buckets_.size()) sync_bucket(started_++);
        comm_.wait_all(pending_);
        break;
    }
  }
  reset_step();
}

void GradSync::reset_step() {
  pending_.clear();
  std::fill(ready_.begin(), ready_.end(), false);
  started_ = 0;
}

Tensor backward(nn::Sequential& model, const Tensor& dy, nn::Saved& saved, GradSync& sync,
                bool input_gradient) {
  shardlab::require(saved.children.size() == model.size(),
                    "ch02::backward: saved state from a forward of another model");
  Tensor g = dy;
  for (std::size_t i = model.size(); i-- > 0;) {
    nn::Layer& layer = model[i];
    nn::Saved& mine = saved.children[i];
    const bool need_dx = input_gradient || i > 0;
    if (auto* inner = dynamic_cast<nn::Sequential*>(&layer)) {
      g = backward(*inner, g, mine, sync, need_dx);
      continue;  // its layers announced themselves
    }
    if (need_dx) {
      g = layer.backward(g, mine);  // B then W
    } else {
      // The model's input is the data: only the weight gradients are needed. B of nn's
      // layers keeps dy for W and computes dL/dx, which nobody would read.
      mine.dy = g;
      layer.backward_weight(mine);
      g = Tensor();
    }
    sync.ready(layer);  // this layer's gradients are final
  }
  saved = nn::Saved{};
  return g;
}

}  // namespace ch02
