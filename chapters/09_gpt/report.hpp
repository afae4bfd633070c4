// Chapter 09's measurements next to their predictions, each one table of the report:
// the bytes each axis sent against the formulas (train.hpp), the model states each rank
// holds against chapter 05's formula and its activations against this model's per-layer
// count, the pipeline's bubble against chapter 04's simulation and formula; and the
// benchmark that trains every mesh shape of the ranks in turn (tokens per second, the
// seed's "compare the strategies' throughput").
#pragma once

#include <cstdint>
#include <vector>

#include "shardlab/launch.hpp"
#include "shardlab/memory.hpp"
#include "train.hpp"

namespace ch09 {

/// Bytes per axis of the last step, every rank, measured and by formula; a check that
/// they are equal.
void report_bytes(shardlab::Context& ctx, const TrainConfig& c, const StepResult& last);

/// Activations one block keeps per token for its backward, in floats, with tp ranks t:
/// each LayerNorm's input (C) and its normalised output the next Linear keeps (C), c_attn's
/// output q, k, v (3C/t), the attention weights (H T/t), c_proj's input (C/t), c_fc's
/// output before and after GELU (4C/t each): 4C + 12C/t + HT/t. Selective recompute
/// drops the H T/t; full recompute keeps the block's input alone, C. (Korthikanti et al.
/// 2022's 34 + 5aT/h, 34 and 2 bytes per h count 16-bit values and dropout masks; this
/// model has neither.)
double block_activation_floats(const GptShape& g, int tp, Recompute recompute);

/// Model states per rank against chapter 05's formula (its tp x pp shard; ZeRO-1: its
/// dp shard of Adam's state), and the activations' peak against the blocks' count for
/// the microbatches 1F1B keeps in flight on its stage (min(p - s, m)); a check that the
/// states are equal.
void report_memory(shardlab::Context& ctx, const TrainConfig& c, Mesh& mesh, GptModel& model,
                   const shardlab::memory::Usage& used);

/// The last step's bubble (idle over busy time), measured on the stages of replica 0's
/// tp rank 0, next to chapter 04's simulation with the measured op times and its formula.
void report_bubble(shardlab::Context& ctx, const TrainConfig& c, Mesh& mesh,
                   const std::vector<ch04::Event>& mine);

/// --benchmark: every mesh shape of the ranks that can run `c`'s model, `steps` steps each
/// (the first not timed), one after another: tokens per second and the loss curve, as
/// tables and as CSV files (09_gpt_throughput.csv, 09_gpt_loss.csv) for the notebook.
void run_benchmark(shardlab::Context& ctx, const TrainConfig& c, const Corpus& data, int steps);

}  // namespace ch09
