// Chapter 09's measurements next to their predictions, each one table of the report:
// the bytes each axis sent against the formulas (train.hpp), the model states each rank
// holds against chapter 05's formula and its activations against this model's per-layer
// count, the pipeline's bubble against chapter 04's simulation and formula, chapter 08's
// planner against all of them, the throughput; and the benchmark that trains every mesh
// shape of the ranks in turn (tokens per second, the seed's "compare the strategies'
// throughput").
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "machine.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/memory.hpp"
#include "train.hpp"

namespace ch09 {

/// Bytes per axis of the last step, every rank, measured and by formula; a check that
/// they are equal.
void report_bytes(shardlab::Context& ctx, const TrainConfig& c, const StepResult& last,
                  const DpBuckets& buckets);

/// Activations one block keeps per token for its backward, in floats, with tp ranks t:
/// each LayerNorm's input (C) and its normalised output the next Linear keeps (C), c_attn's
/// output q, k, v (3C/t), the attention weights (H T/t), c_proj's input (C/t), c_fc's
/// output before and after GELU (4C/t each): 4C + 12C/t + HT/t. Selective recompute
/// drops the H T/t; full recompute keeps the block's input alone, C. Sequence parallel:
/// the LayerNorms' inputs and outputs are this rank's rows only, so everything is over t:
/// 16C/t + HT/t, 16C/t, C/t. (Korthikanti et al. 2022's 34 + 5aT/h and, sequence
/// parallel, 34/t + 5aT/(ht), count 16-bit values and dropout masks; this model has
/// neither.) Context parallel (`context`): the attention keeps its
/// kept_per_token_and_head() instead of the T weights (the ring: a log-sum-exp).
double block_activation_floats(const GptShape& g, int tp, Recompute recompute,
                               bool sequence_parallel = false,
                               const ContextParallel* context = nullptr);

/// The bytes of activations this rank holds at its peak, as this program allocates them:
/// its stage's ops in chapter 04's schedule order, each F adding what the microbatch's
/// blocks keep (block_activation_floats, and the two LayerNorms' mean and rstd), the
/// embedding's ids and ln_f's tensors, and the stage's messages (an F's output kept until
/// its B under pp's overlap, a receive posted one op ahead, a B's gradient sent and kept
/// to the end of the step); each B freeing its microbatch's and reaching, first, the
/// largest of four moments of its last block's backward (the MLP's two input gradients,
/// its residual's sum, fc2's weight gradient) or of the loss (the logits, their softmax and
/// gradient, the head's weight gradient). `held`: the tokens of a sequence on this rank;
/// `vocab_rows`: its share of the vocabulary. std::nullopt where the model does not
/// reach: recomputation, sequence parallelism, experts, 16-bit products, a GPU, the
/// interleaved and ZB-H1 schedules, dp's or pp's communication not overlapped (which
/// change when a layer's weight gradient is made and when a message is let go).
std::optional<double> modelled_activation_peak(const TrainConfig& c, const Coords& at,
                                               std::int64_t held, std::int64_t vocab_rows);

/// Model states per rank against chapter 05's formula (its tp x pp shard; ZeRO-1: its
/// dp shard of Adam's state), and the activations' peak against the blocks' count for
/// the microbatches 1F1B keeps in flight on its stage (min(p - s, m)); a check that the
/// states are equal. `buckets`: ZeRO-1 shards each on its own.
void report_memory(shardlab::Context& ctx, const TrainConfig& c, Mesh& mesh, GptModel& model,
                   const shardlab::memory::Usage& used, const DpBuckets& buckets);

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

/// Tokens per second over the run's steps, and PaLM's model FLOPs utilisation (Chowdhery
/// et al. 2022, appendix B): (6 N + 12 L H Q T) a token (N every parameter but the learned
/// positions, the tied wte once, a MoE block's k experts a token) times tokens/s, over the
/// devices' theoretical peak: on a CPU cores x clock x FMA lanes x FMA units x 2
/// (bench::host_cpu), on a GPU its FP32 peak. On a CPU also the same FLOPs over what the
/// cores achieve (one core's best 512^3 GEMM, measured), and, with recomputation, the
/// hardware FLOPs utilisation (Korthikanti et al. 2022: the second forward counted). JSON:
/// tokens_per_second, model_flops_per_token, hardware_flops_per_token,
/// peak_gflops_per_device, peak_is, mfu, hfu, gemm_gflops_per_device, model_flops_over_gemm.
void report_throughput(shardlab::Context& ctx, const TrainConfig& c, int steps, double seconds);

/// The meshes of `ranks` ranks over the five axes that can run `c`'s model (check_config:
/// cp needs c.context, ep a model with experts), in the grid's order.
std::vector<MeshShape> benchmark_meshes(const TrainConfig& c, int ranks);

/// --benchmark: every mesh of benchmark_meshes, `steps` steps each (the first not timed),
/// one after another: tokens per second and the loss curve, as tables and as CSV files
/// (09_gpt_throughput.csv, 09_gpt_loss.csv) for the notebook. With a `machine` profile
/// (--predict): each mesh's predicted step beside the measured one (calibrate.hpp), and how
/// well they agree: the median and largest |predicted - measured| / measured, and
/// Spearman's correlation of the two orders.
void run_benchmark(shardlab::Context& ctx, const TrainConfig& c, const Corpus& data, int steps,
                   const ch08::MachineProfile* machine = nullptr);

}  // namespace ch09
