// Chapter 09 against one device: the same model trained on one device twice (the whole
// batch at once, and the batch in the mesh's pieces: only the order of the additions
// differs), by a step of its own on the library's loss and optimizer; the loss curve's
// table next to them; the verdict that the mesh trains as one device does, to what the
// order alone changes; and what any training must show, whatever computed it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardlab/launch.hpp"
#include "train.hpp"

namespace ch09 {

/// |a - b| / max(1, |b|).
double relative(double a, double b);

/// One device's training: the loss of each step and the validation loss at the end; with
/// experts, each step's aux loss and dropped choices too.
struct Curve {
  std::vector<double> loss;     ///< per step, the batch's mean loss
  double validation = 0;        ///< the validation loss after the last step
  std::vector<double> aux;      ///< per step, the MoE blocks' load-balancing loss
  std::vector<double> dropped;  ///< per step, the choices the experts' capacity dropped
  /// A step of `result` added.
  void add(const StepResult& result) {
    loss.push_back(result.loss);
    aux.push_back(result.routing.aux_loss);
    dropped.push_back(result.routing.dropped);
  }
};
/// The same model trained on one device (a 1 x 1 x 1 mesh): the whole batch at once, and
/// the batch in the mesh's pieces (dp x m microbatches, their gradients accumulated). Only
/// the order of the additions differs between the two. Their step is written apart from
/// the mesh's Trainer, from the library's pieces: the loss is nn::cross_entropy, not the
/// exercise's vocabulary-parallel one, the update nn::Adam; so a loss the exercise gets
/// wrong the same way on every rank still disagrees with them.
struct References {
  Curve whole;   ///< the whole batch at once
  Curve pieces;  ///< the batch in the mesh's pieces
};
/// Trains both on the job's ranks 0 and 1 at once (rank 0 alone: one after the other),
/// while the others wait (each step may take --timeout); rank 0 gets both curves.
References train_references(shardlab::Context& ctx, const TrainConfig& c, const Corpus& data,
                            int steps);

/// The loss curve's table: each row a step's loss on the mesh next to the references'
/// (empty cells without them: --no-reference, --load), their relative differences, the
/// gradient norm and, under a loss scaler, the scale and the steps skipped so far.
class CurveTable {
 public:
  /// `ref`: the references' curves (rank 0's), or nullptr.
  CurveTable(const TrainConfig& c, const References* ref);
  /// Step `index` of the run (its number as printed: `step`); a row when `shown`.
  void add(std::size_t index, int step, const StepResult& result, bool shown);
  /// The mesh's curve so far: the steps added.
  const Curve& mesh() const { return mesh_; }
  /// The rows added so far, to report.
  shardlab::Table& table() { return table_; }
  /// "" unless the loss scaler skipped every step added: then why the run did not train
  /// (chapter 06's no_step_taken).
  std::string dead_run() const;

 private:
  const References* ref_;
  ch06::Scaler scaler_;
  bool scaled_, experts_;
  Curve mesh_;
  int skipped_ = 0, steps_ = 0;
  double first_scale_ = 0;
  shardlab::Table table_;
};

/// The least tolerance: the mesh's loss never needs to be closer than this to one device's
/// (relative).
inline constexpr double kTolerance = 1e-4;
/// The mesh is held to this many times the relative difference the order of additions
/// alone makes on one device.
inline constexpr double kOrder = 4;
/// With experts the chaos comes in bursts: a routing choice flips on a last-bit difference,
/// a token goes to another expert, and a run's batch loss can spike at a step where the
/// other's does not (the two trade such spikes a few steps apart). A MoE run is held to this
/// many times what the order alone does, room for such a spike: over 18 runs of 6 meshes, 6
/// to 60 steps each, the mesh's worst step was at most 1.4 times the order alone's wherever
/// either passed kTolerance.
inline constexpr double kOrderExperts = 10;
/// How close is equal? The mesh adds the same products in another order (tp's partial
/// sums, the microbatches' and replicas' gradient sums), so at first its loss differs from
/// one device's in the last bits (1e-9 to 1e-8 over the default run's first 20 steps).
/// Training then amplifies those bits, as it amplifies any change in the order of
/// additions (Adam moves a weight whose gradient is rounding noise by lr, one way or the
/// other), until, after some 30 steps, the two are two runs of one recipe. So the mesh is
/// held to kOrder times what the order of additions alone does to one device over the
/// same run (References::pieces against ::whole: its worst step, or its validation loss),
/// and never needs to be closer than kTolerance: every step, and the validation loss. A
/// short run is held to kTolerance (a wrong cut gives 2e-3 at step 1); a long one is held
/// to the chaos the order alone causes. With experts, the aux loss and the dropped choices
/// are held to the same rule (the routing is one device's: each sequence routed on its
/// own, however the mesh cuts the batch). A table and the checks, on every rank (rank 0's
/// curves).
void compare_with_one_device(shardlab::Context& ctx, const References& ref, const Curve& mesh,
                             double validation);

/// A fresh model's first loss lies within this many nats of ln V (its logits are all near
/// 0: 5.60 for the default model, ln 256 = 5.55).
inline constexpr double kFirstStepSpread = 0.5;
/// A run from scratch of at least this many steps must have learnt something: a step of
/// its second half below ln V, the uniform guess's loss (the default model is there by
/// step 2).
inline constexpr int kLearnSteps = 10;
/// What must hold of a training run whatever the code that computed it, on the mesh's
/// curve (every rank calls it; each records the same checks): it did not diverge (the last
/// loss finite and less than a nat above ln V), some step was taken (the loss scaler did
/// not skip them all: CurveTable::dead_run), and once either is said, nothing more; no
/// step's loss and not the validation loss is negative (a cross-entropy is -log of a
/// probability); and `from_scratch` (no --load), the first step's loss is within
/// kFirstStepSpread of ln V, and a run of kLearnSteps or more beats the uniform guess.
void check_training(shardlab::Context& ctx, const CurveTable& curve, std::int64_t vocab,
                    bool from_scratch, double validation);

}  // namespace ch09
