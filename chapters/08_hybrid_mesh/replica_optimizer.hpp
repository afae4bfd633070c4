// Data parallelism as the pipelined trainers run it (chapter 08's MLP blocks, chapter 09's
// GPT), over a mesh's dp axis: chapter 02's GradSync with one bucket (one allreduce of the
// rank's gradients per step, started before the pipeline's last backward) and Adam or
// SGD; or chapter 05's ZeRO-1 (reduce-scatter, Adam on this rank's shard, all-gather),
// by buckets with set_buckets (Megatron-LM's distributed optimizer: each bucket sharded on
// its own, reduce-scattered as backward finishes it, all-gathered under the next forward).
//
//   ReplicaOptimizer opt(mesh.dp(), store, zero, adam);
//   store.zero_grad();
//   ch04::Hooks hooks;  opt.accumulate(hooks);   // microbatches add up locally
//   pipeline.run(schedule, stage, hooks);
//   opt.reduce();                                 // the replicas' gradients summed
//   auto [g, ranges, same] = opt.reduced();       // clip them here, if at all
//   opt.update();
//   // ZeRO-1 by buckets with overlap: the weights arrive bucket by bucket; a layer waits:
//   opt.wait_values(layer.parameters());         // then runs its forward
#pragma once

#include <memory>
#include <unordered_map>
#include <vector>

#include "pipeline.hpp"
#include "shardlab/comm.hpp"
#include "shardlab/nn.hpp"

namespace ch02 {
class GradSync;
}
namespace ch05 {
class ZeroOptimizer;
}

namespace ch08 {

/// Data parallelism over the dp axis for a pipelined trainer: chapter 02's GradSync (one
/// bucket) with Adam or SGD, or chapter 05's ZeRO-1. A step: store.zero_grad(),
/// accumulate(hooks), the pipeline's run with those hooks, reduce(), reduced() (to clip),
/// update().
class ReplicaOptimizer {
 public:
  /// `zero` 0 (GradSync) or 1 (ZeRO-1); `sgd`: plain SGD at adam.lr instead of Adam (not
  /// with ZeRO-1). Each rank's loss must already be its share of the global batch's mean:
  /// the replicas' gradients are added up (weight 1). The state is allocated in `memory`.
  ReplicaOptimizer(shardlab::Communicator& dp, shardlab::nn::ParameterStore& store, int zero,
                   const shardlab::nn::AdamConfig& adam, bool sgd = false,
                   shardlab::Memory memory = shardlab::Memory::host);
  /// How the gradients travel: in buckets of `bucket_bytes` (0: one, the whole store),
  /// each reduced as soon as ready() has announced all of its gradients (`overlap`,
  /// chapter 02's Sync::overlap: Megatron-LM's overlap_grad_reduce) or all of them in
  /// reduce() (Sync::bucketed). The same buckets either way, so the same sums. Under ZeRO-1
  /// the buckets are runs of parameters of about `bucket_bytes`, each sharded on its own
  /// (ZeroConfig::by_group): a bucket's reduce-scatter starts as ready() completes it, and
  /// with `overlap` update() leaves each bucket's all-gather in flight until
  /// wait_values() (Megatron-LM's overlap_param_gather). One bucket: chapter 05's stage 1
  /// as it was (the learner's make_shard and zero1_step).
  void set_buckets(std::int64_t bucket_bytes, bool overlap);
  /// Under ZeRO-1 by buckets: these parameters' gradients change after backward (a sum
  /// over other ranks the trainer adds later), so their buckets are reduced in reduced()
  /// or update(), not as ready() completes them.
  void set_late(const std::vector<shardlab::nn::Parameter*>& params);
  /// Under ZeRO-1 by buckets with overlap: waits until `params`' values, all-gathered by
  /// the last update(), have arrived (before a layer's forward reads them); with no
  /// argument, every bucket's. Otherwise nothing.
  void wait_values(const std::vector<shardlab::nn::Parameter*>& params);
  /// wait_values for every bucket.
  void wait_values();
  /// Under ZeRO-1 by buckets with overlap: starts the all-gathers of the last update()'s
  /// values, first bucket first (ZeroOptimizer::start_gathers), as a step begins: they
  /// travel under its forward. Otherwise nothing.
  void start_values();
  /// The bytes this rank sends in ZeRO-1's all-gathers still in flight (0 otherwise): a
  /// step that leaves them to the next counts them as its own.
  std::uint64_t values_in_flight_sent() const;
  /// The elements of each bucket the gradients travel in (GradSync's plan, or ZeRO-1's
  /// buckets; one: the whole store), in the store's order.
  std::vector<std::int64_t> bucket_elements() const;
  /// Backward has finished these gradients for the step (the parameters of this store
  /// among them; the others are ignored): with overlap, their buckets' reductions start.
  void ready(const shardlab::nn::Parameter& param);
  /// ready() for every parameter of `layer`.
  void ready(const shardlab::nn::Layer& layer);
  ~ReplicaOptimizer();
  ReplicaOptimizer(const ReplicaOptimizer&) = delete;
  ReplicaOptimizer& operator=(const ReplicaOptimizer&) = delete;

  /// Before a step's pipeline run: the sync is off while the microbatches accumulate, and
  /// `hooks` switch it back on before the last backward (after what they did before: two
  /// optimizers, of two stores, can share them).
  void accumulate(ch04::Hooks& hooks);
  /// After the run: every replica holds the sum of the replicas' gradients (GradSync).
  /// Nothing under ZeRO-1, whose update() reduces them itself.
  void reduce();
  /// The summed gradients this rank holds, to take their norm and clip them in place
  /// before update(): after reduce(), the whole store's, the same on every replica; under
  /// ZeRO-1 this rank's range of them, reduced by this call (DeepSpeed's order: reduce,
  /// norm, scale, update) instead of inside update().
  struct Reduced {
    shardlab::Tensor grads;  ///< the summed gradients: the store's, or ZeRO-1's ranges
    /// The ranges of the store's flat order `grads` holds, back to back.
    std::vector<shardlab::ShardRange> ranges;
    bool every_replica = true;  ///< the replicas hold the same (count one of them)
  };
  /// This rank's Reduced gradients; after reduce() and before update().
  Reduced reduced();
  /// The step: Adam or SGD on the whole store, or ZeRO-1's on this rank's shard.
  void update();
  /// No step this time (a loss scaler found an inf in the gradients): nothing changes.
  void skip();
  /// Adam's state as this rank keeps it, for a checkpoint: m and v of the store's elements
  /// [offset, offset + m.size()): all of them, the same on every replica; or under ZeRO-1
  /// this rank's range. Undefined tensors under SGD (no state).
  struct State {
    shardlab::Tensor m;         ///< Adam's first moments
    shardlab::Tensor v;         ///< Adam's second moments
    std::int64_t offset = 0;    ///< m[0] is element `offset` of the store's flat order
    int steps = 0;              ///< the steps Adam has taken
    bool every_replica = true;  ///< the replicas hold the same (save one of them)
  };
  /// Adam's State as this rank keeps it now.
  State state() const;
  /// Sets Adam's state from a saved one: m and v of the whole store, after `steps` steps
  /// (ZeRO-1 keeps its range of them). Nothing under SGD.
  void restore(const shardlab::Tensor& m, const shardlab::Tensor& v, int steps);

 private:
  shardlab::nn::ParameterStore& store_;
  shardlab::Communicator& dp_;
  float lr_;
  std::unique_ptr<ch02::GradSync> sync_;
  std::unique_ptr<shardlab::nn::Adam> adam_;
  std::unique_ptr<ch05::ZeroOptimizer> zero_;
  shardlab::nn::AdamConfig adam_config_;
  // ZeRO-1 by buckets: each parameter's bucket, the gradients each bucket still waits for
  // this step, the buckets reduced only at the end, whether ready() starts them now.
  std::unordered_map<const shardlab::nn::Parameter*, int> bucket_of_;
  std::vector<int> left_, size_in_params_;
  std::vector<std::int64_t> bucket_sizes_;
  std::vector<bool> late_;
  bool overlap_ = false, enabled_ = true;
};

}  // namespace ch08
