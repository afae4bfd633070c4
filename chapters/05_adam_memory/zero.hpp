// Chapter 05's optimizer: ZeRO (Rajbhandari et al. 2020) stages 0-3 with Adam, over any
// model's ParameterStore and any data-parallel communicator (a mesh's dp axis, or all
// the ranks).
//
// Names: N = ranks of the data-parallel communicator, r = this rank, P = the store's
// parameters, G groups (runs of consecutive parameters: FSDP's units, e.g. a model's
// blocks) of n_g elements, S_r = the elements rank r updates (its shard).
//
//   stage  rank r keeps                                 one step
//   0      values, grads, Adam's state of all P         allreduce the grads; Adam on all
//   1      values, grads of all P; state of S_r         reduce-scatter, Adam on S_r,
//                                                       all-gather (zero1_step: exercise)
//   2      values of all P; grads and state of S_r      each group's grads reduce-scattered
//                                                       after its backward; Adam on S_r;
//                                                       each group all-gathered
//   3      values, grads and state of S_r only          each group's values all-gathered
//                                                       before it runs, freed after
// Stage 1 shards the whole flat buffer (DeepSpeed): S_r = shard_range(P, N, r). Stages 2
// and 3 shard each group on its own (FSDP), so a group is gathered or reduced in one
// collective: S_r = the sum over groups of shard_range(n_g, N, r).
//
// The store's type is the precision: an f32 store trains in fp32 (the optimizer updates
// the values themselves), an f16 store in mixed precision (an fp32 master copy of S_r).
//
// A training step, the same at every stage (what a stage does not need does nothing):
//   for g in 0 .. G-1:  opt.gather(g);  forward of group g;  opt.release(g);
//   loss
//   for g in G-1 .. 0:  opt.gather(g);  opt.prepare_gradients(g);  backward of group g;
//                       opt.reduce_gradients(g);  opt.release(g);
//   opt.step();
// Stage 3 prefetches: gather(g) waits for group g's all-gather (started by the gather
// before it) and starts the next one in that order (0 .. G-1, then G-1 .. 0), so the
// exchange of group g + 1 runs while group g computes.
#pragma once

#include <cstdint>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/tensor.hpp"
#include "zero1.hpp"

namespace ch05 {

/// Which ZeRO stage a ZeroOptimizer runs, and its optimizer.
struct ZeroConfig {
  int stage = 1;                    ///< 0 = plain data parallelism, 1, 2, 3
  shardlab::nn::AdamConfig adam{};  ///< Adam's settings (its lr is SGD's too)
  bool sgd = false;      ///< stage 0, fp32 only: plain SGD (lr = adam.lr), no optimizer state
  bool prefetch = true;  ///< stage 3: gather the next group while this one runs
  /// Stage 1 sharded group by group, as stages 2 and 3 shard (Megatron-LM's distributed
  /// optimizer shards each gradient bucket): a group's gradients can be reduce-scattered as
  /// soon as its backward is done (reduce_group), and its updated values all-gathered while
  /// the next step's earlier groups compute (step() with `overlap`, wait_values). S_r is the
  /// sum of each group's shard_range(n_g, N, r), as at stages 2 and 3.
  bool by_group = false;
  /// Stage 1 by group: step() leaves the groups' all-gathers to start with the next step
  /// (start_gathers(), or the first wait_values) and to travel under its forward
  /// (wait_values(g) before group g's values are read) instead of waiting for them.
  bool overlap = false;
};

/// The model states ZeRO counts (§3.1), in bytes, on one rank.
struct StateBytes {
  std::uint64_t params = 0;     ///< the weights, in the store's type
  std::uint64_t grads = 0;      ///< the gradients, in the store's type
  std::uint64_t master = 0;     ///< the fp32 master copy (mixed precision only)
  std::uint64_t optimizer = 0;  ///< Adam's m and v, f32 (none with SGD)
  /// All four together.
  std::uint64_t total() const { return params + grads + master + optimizer; }
  /// Equal when every category is.
  friend bool operator==(const StateBytes&, const StateBytes&) = default;
};

/// ZeRO stages 0-3 with Adam (or SGD) over one ParameterStore and the ranks of a
/// data-parallel communicator; see the top of this file for what each stage keeps and how
/// a training step calls it.
class ZeroOptimizer {
 public:
  /// Takes over `store` (allocated; f32 or f16) for the ranks of `dp`: every rank passes
  /// a store with the same parameters and values. `groups` are runs of the store's
  /// parameters in order, covering it (each group's parameters one after the other, e.g.
  /// a block's parameters()); none: one group. Stages 2 and 3 release the store's
  /// gradient buffer, stage 3 its values too, and keep this rank's shard instead; the
  /// store's parameters then point at what gather() and prepare_gradients() hold.
  ZeroOptimizer(shardlab::Communicator& dp, shardlab::nn::ParameterStore& store, ZeroConfig config,
                std::vector<std::vector<shardlab::nn::Parameter*>> groups = {});
  /// Waits for a stage-3 prefetch still in flight (a step an error left half done).
  ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  /// Stage 3: group g's values, all-gathered from every rank's shard into a buffer of
  /// n_g (the ledger's comm); its parameters point there until release(g). Other stages:
  /// nothing (the values are whole).
  void gather(int g);
  /// Stage 3: frees group g's gathered values; its parameters point at nothing until the
  /// next gather(g). Other stages: nothing.
  void release(int g);
  /// Group g's gradients, zero, ready for its backward to add into: stages 0 and 1 zero
  /// the group's range of the store's gradients; stages 2 and 3 point the group's
  /// parameters at a new zeroed buffer of n_g (comm), until reduce_gradients(g).
  void prepare_gradients(int g);
  /// Stages 2 and 3: the sum over ranks of this rank's range of group g's gradients into
  /// its gradient shard (a reduce-scatter), and the group's full gradients are freed.
  /// Stages 0 and 1: nothing (step() reduces the whole buffer at once).
  void reduce_gradients(int g);
  /// Reduces what is not reduced yet, applies Adam (or SGD) to this rank's S_r and brings
  /// the updated values where the stage keeps them: after it (stage 1 by group with
  /// overlap: after wait_values) every rank's values (its shard at stage 3) are those of
  /// plain data parallelism with the summed gradients.
  void step();
  /// Stage 1, for a step that needs the summed gradients before the update (clipping by
  /// the global norm, as DeepSpeed's ZeRO-1 does it: reduce, take the norm of the
  /// partitions, scale, update): the reduce-scatter of step(), now. Returns this rank's
  /// range of the summed gradients (element 0 is element shard_offset() of the flat
  /// order; by group, the ranges shard_ranges() lists, back to back), to read and scale in
  /// place; the next step() updates from it without
  /// reducing again. Other stages refuse it.
  Tensor reduce_now();
  /// Stage 1: the step that reduce_now() began is not taken (a loss scaler found an inf):
  /// the reduced range is dropped, and the next step reduces afresh.
  void skip_step() { reduced_ = false; }
  /// Stage 1 by group: starts group g's reduce-scatter of the store's gradients into this
  /// rank's shard of it (non-blocking; reduce_now() or step() waits). Each group once per
  /// step, in the same order on every rank; the groups not started by then start in
  /// reduce_now(), last group first.
  void reduce_group(int g);
  /// Stage 1 by group with overlap: starts the all-gathers of the values step() updated,
  /// group by group in order (every rank at the same point: a step's beginning). Step()
  /// leaves them unstarted: a call of any communicator across the same link between the
  /// update and the next forward (the loss a step reports, a barrier) would otherwise
  /// queue behind their bytes. Nothing when none is due.
  void start_gathers();
  /// Stage 1 by group: waits for group g's all-gather of the values step() updated
  /// (start_gathers() first, when they are not started).
  void wait_values(int g);
  /// Stage 1 by group: waits for every all-gather of them.
  void wait_values();
  /// The bytes this rank sends in the all-gathers of step()'s values not counted yet by
  /// the communicator: those still to start, and those in flight where the backend counts
  /// a collective when it is waited for (the threads backend; a backend that models its
  /// traffic counts it when it starts).
  std::uint64_t values_in_flight_sent() const;
  /// Stage 1: the ranges of the store's flat order this rank's reduced gradients hold,
  /// back to back (reduce_now()'s tensor): one, or by group one a group.
  std::vector<shardlab::ShardRange> shard_ranges() const;
  /// Stage 1: Adam's m and v over this rank's range shard_range(P, N, r) of the flat order,
  /// whatever the sharding (by group they are gathered from the ranks first: every rank
  /// calls it), and the steps taken: what a checkpoint saves.
  struct RangeState {
    Tensor m;                    ///< Adam's first moments over `range`
    Tensor v;                    ///< its second moments
    shardlab::ShardRange range;  ///< shard_range(P, N, r) of the flat order
    int steps = 0;               ///< the steps Adam has taken
  };
  /// This rank's RangeState (every rank calls it).
  RangeState range_state();
  /// Where this rank's range starts in the flat order (stage 1).
  std::int64_t shard_offset() const;
  /// Stage 1: Adam's m and v of this rank's range (views: what a checkpoint saves), and
  /// restore(), which sets them from a saved whole-buffer m and v (P elements each; this
  /// rank takes its range) after `steps` steps. The values are the store's, restored by
  /// their owner first (the master copy, in mixed precision, is taken from them).
  const Shard& shard() const;
  /// Sets Adam's state and step count (see shard()); shardlab::Error unless stage 1 with
  /// `m` and `v` of the whole store.
  void restore(const Tensor& m, const Tensor& v, int steps);

  /// Every parameter's fp32 weights as the optimizer updates them (the master copy; the
  /// values in fp32), gathered on every rank (the traffic is not counted). Every rank
  /// calls it.
  Tensor weights();
  /// The ZeRO stage it runs: 0-3.
  int stage() const { return config_.stage; }
  /// Optimizer steps taken: step() calls, counted from restore()'s `steps` after a restore.
  int steps() const { return steps_; }
  /// Stage 1 sharded group by group (ZeroConfig::by_group).
  bool by_group() const { return config_.stage == 1 && config_.by_group; }
  /// G: the number of groups.
  std::size_t group_count() const { return groups_.size(); }
  /// S_r: the elements this rank updates.
  std::int64_t shard_elements() const { return shard_size_; }

 private:
  struct Group {
    std::vector<shardlab::nn::Parameter*> params;
    std::vector<shardlab::Shape> shapes;    // theirs (their views may be empty)
    std::int64_t offset = 0, size = 0;      // in the store's flat order
    shardlab::ShardRange own;               // this rank's range of the group (stages 2, 3)
    std::int64_t shard_offset = 0;          // where that range sits in the shard buffers
    std::vector<std::size_t> counts;        // every rank's range length
    Tensor gathered, bucket;                // stage 3's values, stages 2-3's full gradients
    Tensor send;                            // stages 1 (by group), 2: the updated range sent
    shardlab::Request reducing, gathering;  // in flight (reducing: stage 1 by group)
    bool reduce_started = false;            // stage 1 by group: this step
    bool gather_due = false;                // updated, its all-gather not started yet
  };
  Tensor shard_of(const Tensor& buffer, const Group& g) const;
  Tensor optimizer_weights(const Group& g);
  /// Points group g's parameters' values (or grads) at views of `flat` (n_g elements),
  /// or at nothing when `flat` is undefined.
  static void point(Group& g, const Tensor& flat, bool grads);
  void start_gather(int g);
  Group& group(int g, const char* who);

  shardlab::Communicator& comm_;
  shardlab::nn::ParameterStore& store_;
  ZeroConfig config_;
  shardlab::DType type_;
  shardlab::Memory memory_ = shardlab::Memory::host;
  std::vector<Group> groups_;
  std::int64_t shard_size_ = 0;
  /// Stage 1 by group: every group's reduce-scatter started and waited for.
  void reduce_groups();
  /// Waits for group g's all-gather, if one is in flight, and frees what it sent.
  void finish_gather(Group& g);

  Tensor values_, grads_;      // stage 3: S_r values; stages 2, 3 (1 by group): S_r gradients
  Tensor master_, m_, v_;      // stages 0, 2, 3 (stage 1: shard1_)
  std::vector<Shard> shard1_;  // stage 1: zero1.hpp's shard of the flat buffer (0 or 1)
  int steps_ = 0;
  bool reduced_ = false;  // stage 1: reduce_now() ran, step() only updates
  // Stage 3's prefetch: the order of use, how far this step has come, what is in flight.
  std::vector<int> order_;
  std::size_t next_ = 0;
  int ahead_group_ = -1;
  Tensor ahead_;
  shardlab::Request pending_;
};

/// The elements of each of `groups` (runs of consecutive parameters covering `store`, as
/// ZeroOptimizer takes them; none: one group of the whole store).
std::vector<std::int64_t> group_sizes(
    const std::vector<std::vector<shardlab::nn::Parameter*>>& groups,
    const shardlab::nn::ParameterStore& store);

/// S_r for groups of these sizes: P at stage 0, shard_range(P, N, r) at stage 1, the sum
/// of each group's shard_range(n_g, N, r) at stages 2 and 3 (and 1 `by_group`).
std::int64_t zero_shard_elements(const std::vector<std::int64_t>& groups, int stage, int ranks,
                                 int rank, bool by_group = false);

/// The paper's per-rank formula (§5), with this rank's own S_r in place of P / N (so
/// exact, uneven shards included). w = 2 bytes (f16) or 4 (f32) per weight or gradient,
/// K = 12 in mixed precision (fp32 master, m, v), 8 in fp32 (m and v):
///   stage 0: w P + w P + K P          stage 1: w P + w P + K S_r
///   stage 2: w P + w S_r + K S_r      stage 3: (w + w + K) S_r
/// SGD keeps no optimizer state (K = 0).
StateBytes zero_state_bytes(const std::vector<std::int64_t>& groups, const ZeroConfig& config,
                            shardlab::DType type, int ranks, int rank);

/// Bytes rank r receives per step, exactly, on the threads backend (whose reduce-scatter
/// reads this rank's shard from the N - 1 others, and whose all-gather reads theirs):
/// stages 0-2 w ((N-1) S + (P - S)) with S the rank's reduce-scatter shard (stage 0's
/// allreduce cuts the buffer as stage 1 does), stage 3 w (P - S) more (the values are
/// gathered twice: forward and backward). Even shards: 2 (N-1)/N P and 3 (N-1)/N P
/// elements, the paper's 2 Psi and 3 Psi (§7). Stage 1 `by_group`: S by group, as stage 2's.
std::uint64_t zero_comm_bytes(const std::vector<std::int64_t>& groups, int stage,
                              shardlab::DType type, int ranks, int rank, bool by_group = false);

}  // namespace ch05
