// Chapter 09's measurements next to their predictions, each one table of the report:
// the bytes each axis sent against the formulas (train.hpp), the model states each rank
// holds against chapter 05's formula and its activations against this model's per-layer
// count, the pipeline's bubble against chapter 04's simulation and formula; and the
// benchmark that trains every mesh shape of the ranks in turn (tokens per second, the
// seed's "compare the strategies' throughput").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardlab/launch.hpp"
#include "shardlab/memory.hpp"
#include "train.hpp"

namespace ch09 {

/// |a - b| / max(1, |b|).
double relative(double a, double b);

/// One device's training: the loss of each step and the validation loss at the end.
struct Curve {
  std::vector<double> loss;  ///< per step, the batch's mean loss
  double validation = 0;     ///< the validation loss after the last step
};
/// The same model trained on one device (a 1 x 1 x 1 mesh): the whole batch at once, and
/// the batch in the mesh's pieces (dp x m microbatches, their gradients accumulated). Only
/// the order of the additions differs between the two.
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
  /// The rows added so far, to report.
  shardlab::Table& table() { return table_; }
  /// "" unless the loss scaler skipped every step added: then why the run did not train
  /// (chapter 06's no_step_taken).
  std::string dead_run() const;

 private:
  const References* ref_;
  ch06::Scaler scaler_;
  bool scaled_;
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
/// to the chaos the order alone causes. A table and the checks, on every rank (rank 0's
/// curves).
void compare_with_one_device(shardlab::Context& ctx, const References& ref,
                             const std::vector<double>& mesh, double validation);

/// Bytes per axis of the last step, every rank, measured and by formula; a check that
/// they are equal.
void report_bytes(shardlab::Context& ctx, const TrainConfig& c, const StepResult& last);

/// Activations one block keeps per token for its backward, in floats, with tp ranks t:
/// each LayerNorm's input (C) and its normalised output the next Linear keeps (C), c_attn's
/// output q, k, v (3C/t), the attention weights (H T/t), c_proj's input (C/t), c_fc's
/// output before and after GELU (4C/t each): 4C + 12C/t + HT/t. Selective recompute
/// drops the H T/t; full recompute keeps the block's input alone, C. Sequence parallel:
/// the LayerNorms' inputs and outputs are this rank's rows only, so everything is over t:
/// 16C/t + HT/t, 16C/t, C/t. (Korthikanti et al. 2022's 34 + 5aT/h and, sequence
/// parallel, 34/t + 5aT/(ht), count 16-bit values and dropout masks; this model has
/// neither.)
double block_activation_floats(const GptShape& g, int tp, Recompute recompute,
                               bool sequence_parallel = false);

/// Model states per rank against chapter 05's formula (its tp x pp shard; ZeRO-1: its
/// dp shard of Adam's state), and the activations' peak against the blocks' count for
/// the microbatches 1F1B keeps in flight on its stage (min(p - s, m)); a check that the
/// states are equal.
void report_memory(shardlab::Context& ctx, const TrainConfig& c, Mesh& mesh, GptModel& model,
                   const shardlab::memory::Usage& used);

/// The last step's bubble (idle over busy time), measured on the stages of replica 0's
/// tp rank 0, next to chapter 04's simulation with the measured op times and its formula.
/// Returns the measured bubble (over the ideal).
double report_bubble(shardlab::Context& ctx, const TrainConfig& c, Mesh& mesh,
                     const std::vector<ch04::Event>& mine);

/// Chapter 08's planner applied to this model and mesh (planner.hpp: Narayanan et al.'s
/// and Korthikanti et al.'s formulas, as it plans GPT-3), next to what rank 0 (the first
/// stage) measured: its model states, activations, bytes per axis, and the bubble. The
/// planner speaks of 16-bit training; its activation and wire bytes are doubled here for
/// this fp32 run, and it counts neither the embedding's, head's and loss's allreduces nor
/// the embedding group's, which the table's heading says.
void report_planner(shardlab::Context& ctx, const TrainConfig& c, const StepResult& last,
                    const shardlab::memory::Usage& used, double measured_bubble);

/// Tokens per second over the run's steps, and the model FLOPs utilisation (PaLM's MFU,
/// Chowdhery et al. 2022, appendix B): (6 N + 12 L H Q T) FLOPs a token, N the parameters
/// that take part in a product (all but the learned positions; the tied wte once, as the
/// head), over the peak of the cores the ranks run on (one core's measured GEMM peak, or
/// the GPU's FP32 peak, times their number).
void report_throughput(shardlab::Context& ctx, const TrainConfig& c, int steps, double seconds);

/// --benchmark: every mesh shape of the ranks that can run `c`'s model, `steps` steps each
/// (the first not timed), one after another: tokens per second and the loss curve, as
/// tables and as CSV files (09_gpt_throughput.csv, 09_gpt_loss.csv) for the notebook.
void run_benchmark(shardlab::Context& ctx, const TrainConfig& c, const Corpus& data, int steps);

}  // namespace ch09
