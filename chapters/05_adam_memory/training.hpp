// Chapter 05's training: an MLP trained by data-parallel ranks with Adam, in fp32 or mixed
// precision, as plain data parallelism (ZeRO stage 0) or ZeRO stage 1, 2 or 3, with or
// without activation checkpointing; every tensor counted by the memory ledger.
//
// Names: N = ranks, r = this rank, L = blocks, d = width, B = rows per rank,
// P = Psi = 8 L d^2 parameters (each block is Linear(d, 4d), tanh, Linear(4d, d), tanh,
// no biases), S_r = the parameters rank r owns (its shard).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/memory.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/tensor.hpp"

namespace ch05 {

enum class Precision { fp32, mixed };
/// "fp32" or "mixed".
std::string precision_name(Precision p);

struct ModelConfig {
  int blocks = 4;  // L
  int width = 64;  // d
  int batch = 16;  // B: rows per rank
  std::uint64_t seed = 0;
  std::int64_t block_params() const { return 8LL * width * width; }
  std::int64_t params() const { return block_params() * blocks; }
};

struct RunConfig {
  int stage = 0;  // ZeRO stage: 0 = plain data parallel, 1, 2, 3
  Precision precision = Precision::mixed;
  bool sgd = false;         // plain SGD instead of Adam (fp32, stage 0): the course's 2x
  bool checkpoint = false;  // keep each block's input only, recompute the rest in backward
  bool prefetch = true;     // stage 3: start gathering the next block before this one runs
  int steps = 3;
  bool keep_grads = false;  // stage 0: keep a copy of step 1's summed gradients (counted)
  shardlab::nn::AdamConfig adam{.lr = 1e-2f};
};

/// The model states the ZeRO paper counts (§3.1), in bytes, on one rank.
struct StateBytes {
  std::uint64_t params = 0, grads = 0, master = 0, optimizer = 0;
  std::uint64_t total() const { return params + grads + master + optimizer; }
  friend bool operator==(const StateBytes&, const StateBytes&) = default;
};

struct RunResult {
  shardlab::Tensor weights;  // every parameter after training, f32 (the optimizer's copy)
  StateBytes states;         // measured: live bytes of the model states at the end
  shardlab::memory::Usage usage;                 // this rank's ledger over the whole run
  std::uint64_t activations_after_forward = 0;  // live activation bytes after a forward
  shardlab::CommStats comm;                      // this rank's counters over the steps
  std::vector<double> losses;                    // per step, over every rank's rows
  double fastest_step_s = 0;
  std::int64_t shard = 0;        // S_r
  shardlab::Tensor first_grads;  // with keep_grads: the summed gradients of step 1, f32
};

/// Trains on this rank (every rank calls it, with the same configs).
RunResult train(shardlab::Communicator& comm, const ModelConfig& model, const RunConfig& run,
                shardlab::Memory memory);

/// The parameters rank r owns at this stage: shard_range(P, N, r) for stages 1 (DeepSpeed
/// cuts the one flat buffer), the sum over blocks of shard_range(8 d^2, N, r) for stages 2
/// and 3 (each block cut on its own, as FSDP does), P for stage 0.
std::int64_t shard_elements(const ModelConfig& model, int stage, int ranks, int rank);

/// The model states the paper's per-rank formula gives, with this rank's own shard S_r in
/// place of Psi / N (so exact, uneven shards included). Mixed precision, K = 12:
///   stage 0: 2P + 2P + 12P     stage 1: 2P + 2P + 12 S_r
///   stage 2: 2P + 2 S_r + 12 S_r                stage 3: 16 S_r
/// fp32 (K = 8, no master copy): 4 bytes for params and grads, 8 for Adam's m and v.
StateBytes formula_states(const ModelConfig& model, const RunConfig& run, int ranks, int rank);

/// Bytes rank r receives per training step, exactly, on the threads backend (which
/// reduce-scatters a shard by reading it from the N - 1 others, and all-gathers by
/// reading theirs): stages 0-2 (N-1) S + (P - S) with S the rank's reduce-scatter shard
/// (an allreduce is a reduce-scatter and an all-gather), stage 3 one more all-gather
/// (P - S). Even shards: 2 (N-1)/N P and 3 (N-1)/N P elements: the paper's 2 Psi and 3 Psi.
std::uint64_t formula_comm_bytes(const ModelConfig& model, const RunConfig& run, int ranks,
                                 int rank);

/// Live activation bytes right after a forward: each block keeps its tanh outputs, 4 B d
/// and B d elements (the second is the next block's input), 5 L B d in all; with
/// checkpointing only each block's output (the next one's input), L B d.
std::uint64_t formula_activations(const ModelConfig& model, const RunConfig& run);

}  // namespace ch05
