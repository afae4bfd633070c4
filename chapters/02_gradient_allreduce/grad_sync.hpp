// Chapter 02 API: keeping data-parallel replicas in sync by allreducing gradients.
//
// Names: P = comm.size() ranks; B = global batch, B_r = rank r's rows of it (uneven
// when P does not divide B). Each rank's gradients are the mean over its own B_r rows;
// the gradient of the global batch's mean loss is the *weighted* average
//     g = sum_r (B_r / B) * g_r,
// which is allreduce-then-divide-by-P when every B_r = B/P.
//
// The gradients live in one flat buffer (nn::ParameterStore): each parameter's grad is a
// view of its range, parameters one after another in the order the model added them. A
// bucket is a range of that buffer, so allreducing it moves the gradients in place: no
// packing into a separate buffer, no unpacking after (PyTorch DDP's gradient views of its
// buckets do the same).
//
// Two layers:
//   - the building blocks (allreduce_gradients, plan_buckets, start_bucket_allreduce): the
//     learner writes them in exercises/02_gradient_allreduce/grad_sync.cpp; the reference
//     is solutions/02_gradient_allreduce/grad_sync.cpp;
//   - GradSync, the sync any trainer uses (PyTorch DDP's Reducer), built on those blocks
//     (gradient_sync.cpp), so the learner's code runs inside every trainer that uses it.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/tensor.hpp"

namespace ch02 {

using shardlab::Communicator;
using shardlab::Request;
using shardlab::Tensor;
using shardlab::nn::Parameter;

/// An allreduce (sum, in place, blocking) over `comm`: the communicator's own by default;
/// chapter 03's ring, or any other, can be plugged in instead.
using AllreduceFn = std::function<void(Communicator& comm, Tensor& data)>;
/// The default AllreduceFn: the communicator's own allreduce (sum, in place, blocking).
inline void native_allreduce(Communicator& comm, Tensor& data) {
  comm.allreduce(data, shardlab::ReduceOp::sum);
}

// ---------------------------------------------------------------------------
// The building blocks (the exercise)

// [exercise]
/// Replaces every parameter's gradient with its weighted average over ranks (above):
/// scale it by local_batch / global_batch, then one allreduce(comm, grad) (sum) per
/// gradient tensor, in params order.
void allreduce_gradients(Communicator& comm, std::span<Parameter* const> params,
                         std::int64_t local_batch, std::int64_t global_batch,
                         const AllreduceFn& allreduce = native_allreduce);

/// A bucket: gradients that travel together in one allreduce, a contiguous range of the
/// flat gradient buffer.
struct Bucket {
  std::vector<std::size_t> params;  ///< indices into params, in the order they were added
  std::int64_t offset = 0;          ///< where the range starts in the flat buffer (elements)
  std::int64_t elements = 0;        ///< its length: the sum of the parameters' sizes
};

/// Groups `params` into buckets of at most `bucket_bytes` bytes (float32), walking them
/// from the last to the first — the order backward finishes their gradients, as DDP
/// buckets them. A gradient is never split: one larger than a bucket gets a bucket of its
/// own. Parameters next to each other in the walk are next to each other in the flat
/// buffer, so each bucket is one range [offset, offset + elements).
std::vector<Bucket> plan_buckets(std::span<Parameter* const> params, std::int64_t bucket_bytes);

/// Starts one bucket's weighted average: scales the bucket's range of `flat_grads` by
/// local_batch / global_batch and starts a non-blocking allreduce (sum) of that range, in
/// place. The gradients are averaged once the returned request is waited for.
[[nodiscard]] Request start_bucket_allreduce(Communicator& comm, Tensor& flat_grads,
                                             const Bucket& bucket, std::int64_t local_batch,
                                             std::int64_t global_batch);
// [exercise]

// ---------------------------------------------------------------------------
// GradSync: data-parallel gradient sync for any trainer

/// none: every replica steps on its own gradient (they drift apart);
/// allreduce: one allreduce per gradient tensor, at finish();
/// bucketed: one per bucket, each waited for at once, at finish();
/// overlap: each bucket's allreduce starts as soon as backward has finished all of its
/// gradients (ready()), and runs while backward goes on; finish() waits for them.
enum class Sync {
  none,       ///< no sync: each replica keeps its own gradient
  allreduce,  ///< one blocking allreduce per gradient tensor, at finish()
  bucketed,   ///< one blocking allreduce per bucket, at finish()
  overlap     ///< each bucket's allreduce started as soon as its gradients are ready
};
/// "none", "allreduce", "bucketed", "overlap" -> Sync; UsageError for any other name.
Sync parse_sync(std::string_view name);
/// The name parse_sync reads: "none", "allreduce", "bucketed" or "overlap".
std::string_view sync_name(Sync sync);

/// How a GradSync averages the gradients.
struct GradSyncConfig {
  Sync mode = Sync::allreduce;  ///< when and in what pieces the gradients are allreduced
  /// Bucket capacity in bytes (float32 gradients), for bucketed and overlap (PyTorch DDP's
  /// 25 MiB).
  std::int64_t bucket_bytes = 25 << 20;
  /// Runs instead of the communicator's allreduce when set: once per tensor (allreduce)
  /// or per bucket (bucketed; overlap too, where a blocking one runs when its bucket is
  /// ready: correct, but nothing then overlaps).
  AllreduceFn allreduce = {};
};

/// Averages the gradients of a ParameterStore over the ranks of `comm` (the world, or one
/// axis of a mesh: the data-parallel ranks). Per step, on every rank of `comm`:
///
///   ch02::GradSync sync(dp, store, {.mode = Sync::overlap, .bucket_bytes = 1 << 20});
///   sync.set_batch(my_rows, global_rows);         // the weights B_r / B (default 1 / P)
///   store.zero_grad();
///   { ch02::NoSync accumulate(sync);  forward; backward; }  // micro-batches: local only
///   forward; backward, calling sync.ready(layer) as each layer's gradients are final;
///   sync.finish();                                 // waits; the flat grads hold g
///
/// Every rank must run the same modes, the same ready() calls in the same order, and
/// finish() once per synced step: the collectives they start must match.
class GradSync {
 public:
  /// Syncs the gradients of `store`, which must already be allocated (shardlab::Error if not),
  /// over the ranks of `comm`; plans the buckets for bucketed and overlap. Weights default
  /// to 1 / P until set_batch(). Both references must outlive the GradSync.
  GradSync(Communicator& comm, shardlab::nn::ParameterStore& store, GradSyncConfig config = {});
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  /// This rank's share of the batch: gradients are weighted by local_batch / global_batch.
  void set_batch(std::int64_t local_batch, std::int64_t global_batch);
  /// Off: ready() and finish() communicate nothing; the gradients keep accumulating
  /// locally (DDP's no_sync(): every micro-batch but the last, or a pipeline's).
  void set_enabled(bool enabled) { enabled_ = enabled; }
  /// Whether ready() and finish() communicate (see set_enabled).
  bool enabled() const { return enabled_; }

  /// Backward has finished these gradients (index into store.parameters(); a parameter;
  /// every parameter of a layer). In overlap mode, starts every bucket, in plan order,
  /// whose gradients are all ready. Nothing in the other modes, or when disabled.
  /// shardlab::Error if `param` is not an index into store.parameters().
  void ready(std::size_t param);
  /// The same for one parameter; shardlab::Error if it is not a parameter of this store.
  void ready(const Parameter& param);
  /// The same for every parameter of `layer`; shardlab::Error if one is not in this store.
  void ready(const shardlab::nn::Layer& layer);
  /// Syncs what is left and waits: afterwards the flat gradients hold the weighted average
  /// on every rank. Disabled: nothing (the ready marks are dropped).
  void finish();

  /// Whether `param` is one of this store's parameters (what ready() takes).
  bool holds(const Parameter& param) const { return index_.count(&param) != 0; }
  /// The sync mode it was configured with.
  Sync mode() const { return config_.mode; }
  /// The bucket plan (bucketed and overlap; empty for the other modes).
  const std::vector<Bucket>& buckets() const { return buckets_; }
  /// Buckets whose allreduce has started this step (overlap: before finish()).
  std::size_t started() const { return started_; }

 private:
  void start_ready_buckets();
  void sync_bucket(std::size_t b);
  void reset_step();

  Communicator& comm_;
  shardlab::nn::ParameterStore& store_;
  GradSyncConfig config_;
  std::vector<Parameter*> params_;
  std::unordered_map<const Parameter*, std::size_t> index_;
  std::vector<Bucket> buckets_;
  std::int64_t local_batch_ = 1, global_batch_ = 1;
  bool enabled_ = true;
  std::vector<bool> ready_;  // this step, per parameter
  std::size_t started_ = 0;  // buckets started this step, in plan order
  std::vector<Request> pending_;
};

/// Scoped no-sync (DDP's `with model.no_sync():`): the sync is off while it lives, and as
/// it was before once it ends.
class NoSync {
 public:
  /// Turns `sync` off until this object is destroyed.
  explicit NoSync(GradSync& sync) : sync_(sync), was_(sync.enabled()) { sync.set_enabled(false); }
  /// Puts `sync` back as it was when this object was made.
  ~NoSync() { sync_.set_enabled(was_); }
  NoSync(const NoSync&) = delete;
  NoSync& operator=(const NoSync&) = delete;

 private:
  GradSync& sync_;
  bool was_;
};

/// Backward through `model`, its last layer first (nested Sequentials layer by layer),
/// calling sync.ready(layer) as soon as each layer's gradients are final, so that overlap
/// starts a bucket while the layers before it still run. Returns dL/dinput; with
/// input_gradient = false the first layer computes only its weight gradients (its input
/// is the data) and the result is empty.
Tensor backward(shardlab::nn::Sequential& model, const Tensor& dy, shardlab::nn::Saved& saved,
                GradSync& sync, bool input_gradient = true);

}  // namespace ch02
