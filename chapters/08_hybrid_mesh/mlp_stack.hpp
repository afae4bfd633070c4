// Chapter 08's 3-D training: a stack of Megatron MLP blocks trained on a pp x dp x tp mesh,
// with every earlier chapter's piece in its place:
//   pp  chapter 04's pipeline runtime: stage s holds blocks [s L/pp, (s + 1) L/pp), runs a
//       schedule (1F1B by default) over m microbatches, activations sent stage to stage;
//   tp  each block's weights cut Megatron's way (tensor_parallel.hpp): 2 allreduces of the
//       microbatch's activation per block, one forward (g) and one backward (f);
//   dp  replicas of the whole, each on its own rows of the batch, its loss already its
//       share of the global batch's mean; chapter 02's GradSync sums the gradients once
//       per step, after the last microbatch (switched on before the pipeline's last
//       backward); or chapter 05's ZeRO-1 over the dp ranks.
// Every rank also trains the same model on one device (train_reference), from the same
// weights, on the same batches: the loss curves and the final weights must agree.
//
// Names: L blocks of hidden width h and inner width f (4h), B rows per step (the global
// batch), m microbatches per replica, B_r = the rows of replica r (shard_range(B, dp, r)).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "mesh.hpp"
#include "pipeline.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/memory.hpp"
#include "shardlab/nn.hpp"
#include "tensor_parallel.hpp"

namespace ch08 {

using shardlab::Memory;

/// One training run: the mesh, the blocks' sizes, the batch, the schedule and the optimizer.
struct HybridConfig {
  MeshShape mesh;                    ///< pp x dp x tp (cp and ep 1)
  int blocks = 4;                    ///< L: pp must divide it
  std::int64_t hidden = 16;          ///< h: tp must divide it
  std::int64_t ffn = 64;             ///< f: the blocks' inner width
  std::int64_t batch = 32;           ///< B, all replicas together
  int microbatches = 4;              ///< m, per replica: B_r rows cut into m
  int steps = 4;                     ///< training steps, each on a fresh batch
  std::string schedule = "1f1b";     ///< any of chapter 04's with one chunk per stage
  int zero = 0;                      ///< 0: GradSync + Adam; 1: ZeRO-1 over dp
  nn::AdamConfig adam{.lr = 1e-2f};  ///< Adam's settings (adam.lr is SGD's rate too)
  bool sgd = false;                  ///< plain SGD at adam.lr instead of Adam (not with ZeRO-1)
  std::uint64_t seed = 0;            ///< the initial weights and the task's batches derive from it
};

/// Bytes a rank sent in one training step, by axis (AxisMeter's: dp's are data
/// parallelism's, over the replicas).
using AxisBytes = PerAxis<std::uint64_t>;

/// The larger of a and b, NaN when either is: a difference that is NaN must not vanish in
/// a maximum (std::max drops it when it comes second).
inline double nan_max(double a, double b) { return a != a || b != b ? a + b : std::max(a, b); }

/// UsageError unless `c` can run on its mesh: pp divides the blocks, tp the widths, and
/// every replica's every microbatch has a row.
void check_config(const HybridConfig& c);
/// "4 Megatron MLP blocks (h 16, f 64) on pp x dp x tp = 2 x 2 x 2 (threads), 1f1b, ...".
std::string describe(const HybridConfig& c, std::string_view backend);
/// About how many bytes one rank holds at most (the memory check before the ranks start).
double run_bytes(const HybridConfig& c);

/// What the formulas say one rank sends per step (ring allreduce: 2 (N-1)/N of S, as the
/// ledger counts it; shardlab::collective_traffic exactly):
///   tp  2 L/pp allreduces per microbatch of its B_r/m x h activation, each 2 (t-1)/t x 4 B
///   dp  one allreduce of the rank's parameters (ZeRO-1: reduce-scatter + all-gather, the
///       same volume), 2 (d-1)/d x 4 bytes each
///   pp  each microbatch's activation to the next stage and its gradient to the one before:
///       4 h B_r bytes each way that has a neighbour
AxisBytes formula_bytes(const HybridConfig& c, const Coords& at);

/// This rank's model: its stage's blocks, each cut over tp.
class HybridModel {
 public:
  /// The blocks of this rank's stage, cut over tp, from the same weights as the one-device
  /// model's; the store allocated in `memory`.
  HybridModel(Mesh& mesh, const HybridConfig& c, Memory memory);
  /// The store that holds this rank's parameters and gradients.
  nn::ParameterStore& store() { return store_; }
  /// The stage's blocks, in order: what the pipeline runs on this rank.
  nn::Sequential& chunk() { return chunk_; }
  /// The blocks this rank's stage holds: [first, first + count).
  int first_block() const { return first_; }
  /// How many blocks this rank's stage holds: L/pp.
  int block_count() const { return static_cast<int>(chunk_.size()); }
  /// The largest |difference| between this rank's weights and the matching slices of the
  /// one-device model's (`reference`: L mlp_blocks, as train_reference builds them).
  double max_weight_diff(nn::Sequential& reference);

 private:
  nn::ParameterStore store_;
  nn::Sequential chunk_;
  int first_ = 0;
};

/// What a run measured of its steps, for report_hosts (mesh_checks.hpp).
struct StepMeasure {
  double seconds = 0;      ///< a step's time on this rank (the median of the steps)
  std::uint64_t wire = 0;  ///< bytes this rank's host sent on its network in the last step
};

/// Times each step and reads the host's network counters around it (chapters 08 and 09):
/// start() before a step, stop() after it, on every rank of `world`. The counters are read
/// with no step running anywhere: start() reads between two barriers (so no rank sends its
/// first message before every host's counter is read), stop() after one (every rank has
/// received all it was sent, but for chapter 09's ZeRO-1 all-gathers left to run under the
/// next step's forward). The barriers are not counted as any axis's bytes.
class StepClock {
 public:
  /// A step begins: a barrier, the reading, a barrier, the clock.
  void start(Communicator& world);
  /// The step ends: a barrier, the clock, the reading.
  void stop(Communicator& world);
  /// The median step's time and the last step's bytes on the wire.
  StepMeasure measure() const;

 private:
  std::chrono::steady_clock::time_point started_;
  std::uint64_t wire_at_start_ = 0, last_wire_ = 0;
  std::vector<double> seconds_;
};

/// What train_hybrid measured.
struct HybridRun {
  std::vector<double> loss;           ///< per step, the global batch's (on every rank)
  AxisBytes bytes;                    ///< sent by this rank in the last step
  std::vector<ch04::Event> events;    ///< every stage's ops in the last step
  std::uint64_t optimizer_bytes = 0;  ///< the optimizer's state (and master copy), as allocated
  std::int64_t parameters = 0;        ///< elements this rank holds
  StepMeasure step;                   ///< its steps' time and the last one's wire bytes
};

/// Trains c.steps steps on the mesh. Every rank of the mesh calls it.
HybridRun train_hybrid(Mesh& mesh, HybridModel& model, const HybridConfig& c, Memory memory);

/// The same training on one device: L unsplit blocks, the whole batch at once; or, with
/// `in_pieces`, the mesh's pieces of the batch one after another (each replica's rows, cut
/// into its microbatches, the gradients accumulated): the same sums in another order. How
/// far the two drift apart is how much the order of the additions alone moves this
/// training: the yardstick the mesh is held to (main.cpp).
struct Reference {
  nn::ParameterStore store;  ///< the parameters of the L blocks
  nn::Sequential model;      ///< the L unsplit blocks (mlp_block)
  std::vector<double> loss;  ///< per step, the global batch's
};
/// Builds the L blocks into `out` (empty; on the host) and trains them c.steps steps on the
/// mesh's batches, with Adam (SGD under c.sgd); `in_pieces` as above.
void train_reference(const HybridConfig& c, Reference& out, bool in_pieces = false);

// ---------------------------------------------------------------------------
// What the program prints (main.cpp), each measurement next to its prediction

/// How close is equal? The mesh adds the same products in another order (tp's partial
/// sums, dp's and the microbatches' gradient sums), so it differs from one device in the
/// last bits, and training carries that on (Adam's first step moves a weight by lr x the
/// sign of its gradient: a gradient that is zero but for rounding can go either way). The
/// mesh must stay within kOrder times what reordering the additions on one device does,
/// and never needs to be closer than kTolerance (relative to the largest value).
inline constexpr double kTolerance = 1e-5;
/// How many times what the order of the additions alone does the mesh may differ by.
inline constexpr double kOrder = 10;

/// The loss curve of the mesh next to one device's (`ref`), the loss and the final weights
/// held to kOrder x what `pieces` (one device, the batch in the mesh's pieces) differs by
/// (mesh_checks.hpp), a verdict that a diverged reference proves nothing, and one that
/// the dp replicas' weights are identical.
void compare_with_one_device(shardlab::Context& ctx, const HybridConfig& c, Reference& ref,
                             Reference& pieces, Mesh& mesh, HybridModel& model,
                             const HybridRun& run);

/// Every rank's model states against chapter 05's formula over its tp x pp shard (and dp
/// shard under ZeRO-1), the ledger's measure of them (`used`) and its activations' peak;
/// a verdict that the states are equal.
void report_memory(shardlab::Context& ctx, const HybridConfig& c, const Coords& at,
                   const HybridRun& run, const shardlab::memory::Usage& used);

}  // namespace ch08
