// Chapter 05's training: toy.hpp's MLP fit to its teacher by data-parallel ranks with
// Adam, in fp32 or mixed precision, as plain data parallelism (ZeRO stage 0) or ZeRO
// stage 1, 2 or 3 (ZeroOptimizer, zero.hpp), with or without activation checkpointing;
// every tensor counted by the memory ledger.
//
// Names: N = ranks, r = this rank, L = blocks, d = width, B = rows per rank,
// P = Psi = 8 L d^2 parameters (each block is Linear(d, 4d), tanh, Linear(4d, d), tanh,
// no biases: one ZeRO group), S_r = the parameters rank r owns (its shard).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/memory.hpp"
#include "shardlab/results.hpp"
#include "shardlab/tensor.hpp"
#include "shardlab/toy.hpp"
#include "zero.hpp"

namespace ch05 {

/// How the model trains: its weights' and gradients' type and what the optimizer keeps.
enum class Precision {
  fp32,  ///< f32 weights and gradients; Adam's m and v
  mixed  ///< f16 weights and gradients; an fp32 master copy, m and v
};
/// "fp32" or "mixed".
std::string precision_name(Precision p);
/// The weights' and gradients' type: f32, or f16 in mixed precision.
shardlab::DType weight_type(Precision p);

/// The toy model's shape and its data.
struct ModelConfig {
  int blocks = 4;          ///< L
  int width = 64;          ///< d
  int batch = 16;          ///< B: rows per rank
  std::uint64_t seed = 0;  ///< seeds the initial weights and the teacher's data
  /// 8 d^2: one block's parameters (Linear(d, 4d) and Linear(4d, d), no biases).
  std::int64_t block_params() const { return 8LL * width * width; }
  /// P = Psi = 8 L d^2: the model's parameters.
  std::int64_t params() const { return block_params() * blocks; }
  /// toy.hpp's shape of it: widths d, 4d, d, 4d, ..., d (2 L Linears), tanh after each.
  shardlab::toy::MlpConfig mlp() const;
  /// The ZeRO groups: L blocks of 8 d^2.
  std::vector<std::int64_t> groups() const;
};

/// How one training run keeps its states.
struct RunConfig {
  ZeroConfig zero{.stage = 0, .adam = {.lr = 1e-2f}};  ///< the ZeRO stage and the optimizer
  Precision precision = Precision::mixed;              ///< fp32 or mixed precision
  bool checkpoint = false;  ///< keep each block's input only, recompute the rest in backward
  int steps = 3;            ///< training steps
  bool keep_grads = false;  ///< stage 0: keep a copy of step 1's summed gradients (counted)
};

/// What one rank measured in a training run.
struct RunResult {
  shardlab::Tensor weights;       ///< every parameter after training, f32 (the optimizer's copy)
  StateBytes states;              ///< measured: live bytes of the model states at the end
  shardlab::memory::Usage usage;  ///< this rank's ledger over the whole run
  std::uint64_t activations_after_forward = 0;  ///< live activation bytes after a forward
  shardlab::CommStats comm;                     ///< this rank's counters over the steps
  std::vector<double> losses;                   ///< per step, over every rank's rows
  /// The fastest step, in seconds: each rank's fastest, the slowest of those over ranks.
  double fastest_step_s = 0;
  std::int64_t shard = 0;        ///< S_r
  shardlab::Tensor first_grads;  ///< with keep_grads: the summed gradients of step 1, f32
};

/// Trains on this rank (every rank calls it, with the same configs): x ~ N(0, 1), y =
/// tanh(x T) from toy::Teacher, rank r's B of the N B rows.
RunResult train(shardlab::Communicator& comm, const ModelConfig& model, const RunConfig& run,
                shardlab::Memory memory);

/// S_r at this stage (zero_shard_elements of the model's groups).
std::int64_t shard_elements(const ModelConfig& model, int stage, int ranks, int rank);
/// The model states the paper's per-rank formula gives (zero_state_bytes, exact).
StateBytes formula_states(const ModelConfig& model, const RunConfig& run, int ranks, int rank);
/// Bytes rank r receives per training step, exactly, on threads (zero_comm_bytes).
std::uint64_t formula_comm_bytes(const ModelConfig& model, const RunConfig& run, int ranks,
                                 int rank);
/// Live activation bytes right after a forward: each block keeps its tanh outputs, 4 B d
/// and B d elements (the second is the next block's input), 5 L B d in all; with
/// checkpointing only each block's output (the next one's input), L B d.
std::uint64_t formula_activations(const ModelConfig& model, const RunConfig& run);

/// One training run measured next to what the formulas say: main's rows.
struct Measured {
  RunResult run;                   ///< what the run measured
  StateBytes formula;              ///< the model states the exact formula gives (formula_states)
  double paper = 0;                ///< ZeRO's formula with Psi / Nd (calculator.hpp); 0 for SGD
  std::uint64_t comm_bytes = 0;    ///< bytes received per step by this rank, measured
  std::uint64_t comm_formula = 0;  ///< the same by the formula (formula_comm_bytes)
  int blocks = 0;                  ///< L, the model's blocks
  int rank = 0;                    ///< this rank
  /// "" when every category's bytes equal the formula's, the traffic too (when
  /// `traffic_measured`: threads), and the exact formula is within what uneven shards
  /// explain (16 bytes a block) of the paper's; else what differs, with the numbers.
  std::string differences(bool traffic_measured) const;
};
/// Trains as `run` says (train) and fills in what the formulas say; every rank calls it.
Measured measure(shardlab::Communicator& comm, const ModelConfig& model, const RunConfig& run,
                 shardlab::Memory memory);

/// The benchmark: every stage's fastest step (stage 3 with and without prefetch) and its
/// bytes by category, measured and formula, for Nd = 1, 2, 4, ... up to the ranks of `comm`
/// (each Nd a sub-communicator): the rows of 05_adam_memory_time.csv and 05_adam_memory.csv.
struct BenchmarkTables {
  /// Per stage (3 with and without prefetch) and Nd: the fastest step (ms) and its ratio to
  /// stage 0's.
  shardlab::Table time{{"stage", "prefetch", "dp", "step_ms", "vs_plain_dp", "params", "precision",
                        "backend", "machine"}};
  /// Per stage and Nd: this rank's bytes of each model-state category, measured and formula.
  shardlab::Table bytes{{"source", "stage", "dp", "category", "bytes", "params", "precision"}};
};
/// Runs the benchmark above on every rank of `comm` (all call it) and returns its rows.
BenchmarkTables benchmark(shardlab::Communicator& comm, const ModelConfig& model, RunConfig run,
                          shardlab::Memory memory);

/// Bytes a training run needs on this machine, for run() to refuse what cannot fit: per
/// rank the model states (at most 16 bytes per parameter, twice: a run and the reference
/// weights), the data set (every rank draws all N B rows) and activations; `here` of the
/// `ranks` ranks run in this process.
double memory_estimate(const ModelConfig& model, int here, int ranks);

}  // namespace ch05
