// Data parallelism as the pipelined trainers run it (chapter 08's MLP blocks, chapter 09's
// GPT), over a mesh's dp axis: chapter 02's GradSync with one bucket (one allreduce of the
// rank's gradients per step, started before the pipeline's last backward) and Adam or
// SGD; or chapter 05's ZeRO-1 (reduce-scatter, Adam on this rank's shard, all-gather).
//
//   ReplicaOptimizer opt(mesh.dp(), store, zero, adam);
//   store.zero_grad();
//   ch04::Hooks hooks;  opt.accumulate(hooks);   // microbatches add up locally
//   pipeline.run(schedule, stage, hooks);
//   opt.reduce();                                 // the replicas' gradients summed
//   ... (clip the gradients here)
//   opt.update();
#pragma once

#include <memory>

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

class ReplicaOptimizer {
 public:
  /// `zero` 0 (GradSync) or 1 (ZeRO-1); `sgd`: plain SGD at adam.lr instead of Adam (not
  /// with ZeRO-1). Each rank's loss must already be its share of the global batch's mean:
  /// the replicas' gradients are added up (weight 1). The state is allocated in `memory`.
  ReplicaOptimizer(shardlab::Communicator& dp, shardlab::nn::ParameterStore& store, int zero,
                   const shardlab::nn::AdamConfig& adam, bool sgd = false,
                   shardlab::Memory memory = shardlab::Memory::host);
  ~ReplicaOptimizer();
  ReplicaOptimizer(const ReplicaOptimizer&) = delete;
  ReplicaOptimizer& operator=(const ReplicaOptimizer&) = delete;

  /// Before a step's pipeline run: the sync is off while the microbatches accumulate, and
  /// `hooks` switch it back on before the last backward.
  void accumulate(ch04::Hooks& hooks);
  /// After the run: every replica holds the sum of the replicas' gradients (GradSync).
  /// Nothing under ZeRO-1, whose update() reduces them itself.
  void reduce();
  /// The step: Adam or SGD on the whole store, or ZeRO-1's on this rank's shard.
  void update();
  /// Adam's state (nullptr under ZeRO-1 or SGD): what a checkpoint saves and restores.
  shardlab::nn::Adam* adam() { return adam_.get(); }

 private:
  shardlab::nn::ParameterStore& store_;
  float lr_;
  std::unique_ptr<ch02::GradSync> sync_;
  std::unique_ptr<shardlab::nn::Adam> adam_;
  std::unique_ptr<ch05::ZeroOptimizer> zero_;
};

}  // namespace ch08
