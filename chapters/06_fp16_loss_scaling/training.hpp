// Chapter 06's training: toy.hpp's MLP fit to its teacher by data-parallel ranks with
// Adam, in fp32 or in mixed precision (fp16 weights, activations and gradients: an f16
// ParameterStore; fp32 master weights and update), with no loss scaling, a static scale
// or GradScaler's dynamic one (LossScaler, loss_scaler.hpp).
//
// The model: out = tanh(x W1) W2 (Linear(I, H), tanh, Linear(H, O), no biases); x is R x I
// (R rows in all, shared out among the ranks); the loss is the mean over the R x O outputs
// of (out - y)^2 / 2, y = s tanh(x T) for toy::Teacher's T and a small `target_scale` s:
// the outputs are small numbers, and so are the gradients — many of them below fp16's
// smallest subnormal, 2^-24.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "loss_scaler.hpp"
#include "shardlab/comm.hpp"
#include "shardlab/results.hpp"
#include "shardlab/tensor.hpp"

namespace ch06 {

/// The model's shape and its data (see the top of this file).
struct ModelConfig {
  int in = 32;      ///< I: input features
  int hidden = 64;  ///< H: hidden units
  int out = 16;     ///< O: outputs
  int rows = 128;   ///< R: the batch, all ranks together (rank r gets shard_range(R, N, r))
  double target_scale = 1e-4;  ///< s: the targets' scale, y = s tanh(x T); W2 starts that small
  std::uint64_t seed = 0;      ///< seeds the initial weights and the teacher's data
  /// I H + H O: the parameters of W1 and W2.
  std::int64_t params() const { return std::int64_t{in} * hidden + std::int64_t{hidden} * out; }
};

/// How one training run computes and scales.
struct RunConfig {
  bool fp16 = true;                 ///< false: everything in fp32 (the reference run)
  Scaler scaler = Scaler::dynamic;  ///< the loss scaling of an fp16 run (none in fp32)
  float static_scale = 65536.0f;    ///< the scale of Scaler::fixed
  ScalerConfig dynamic;             ///< the settings of Scaler::dynamic
  /// Steps (1-based) whose gradients are made non-finite (on the last rank only).
  std::set<int> inject_overflow;
  int steps = 300;   ///< training steps
  float lr = 3e-5f;  ///< Adam's learning rate; small: the weights are the size of the targets
};

/// What one rank recorded in a training run.
struct RunResult {
  std::vector<double> losses;  ///< per step, the mean over every rank's outputs
  std::vector<double> scales;  ///< the scale each step's loss was multiplied by
  std::vector<int> skipped;    ///< steps (1-based) skipped for non-finite gradients
  /// Every step's skip decision was the same on every rank (checked as it ran).
  bool skips_agreed = true;
  Tensor weights;                         ///< the fp32 master weights at the end (W1 then W2)
  std::uint64_t grad_bytes_per_step = 0;  ///< this rank's gradient allreduce, bytes received
  /// True when grad_bytes_per_step is the backend's model of the traffic, not a measurement.
  bool grad_traffic_modeled = false;
  /// Step 1's gradients before any rounding to fp16 (fp32 run only): dL/dout, dL/dh,
  /// dL/d(xW1), dL/dW1, dL/dW2, every element, for the underflow histogram.
  std::vector<float> first_gradients;
  double first_zero_weight_grads = 0;  ///< fraction of step 1's weight gradients that are 0
  /// "" when the loss stayed finite and below 100x step 1's at every step (chapter 02's
  /// diverged_at); else how it diverged.
  std::string divergence() const;
};

/// Trains on this rank's rows (every rank calls it, with the same configs).
RunResult train(Communicator& comm, const ModelConfig& model, const RunConfig& run,
                shardlab::Memory memory);

/// The fraction of the nonzero values in `gradients` that become 0 in fp16 after
/// multiplying by `scale` (1: unscaled).
double underflow_fraction(const std::vector<float>& gradients, float scale);

/// log2 |g| of the nonzero `gradients` in bins of one power of two, from the smallest bin
/// that holds a value to the largest: each bin's count, a bar, and where the bin lies in
/// fp16 ("0", "subnormal", "normal", "inf") as it is and times `scale` (a power of two).
/// Columns log2_from, log2_to, count, histogram, fp16_zone, scaled_zone, scale.
shardlab::Table gradient_histogram(const std::vector<float>& gradients, float scale);

/// The formats' landmarks, each from the conversions themselves (half.hpp): largest,
/// smallest normal, smallest subnormal and epsilon of fp32, fp16 and bf16, one row each.
shardlab::Table format_landmarks();

/// `value` rounded to fp16 and bf16: the bits, the value they hold, fp16's kind (normal,
/// subnormal, zero, infinity, NaN) and what was lost (one row; keys fp16_bits, fp16_value,
/// fp16_kind, bf16_bits, bf16_value, note).
shardlab::Table to_half_table(double value);

/// "30,31" -> {30, 31}: step numbers from 1 to `steps`; UsageError (naming `flag`) else.
std::set<int> parse_steps(const std::string& text, int steps, const std::string& flag);
/// {1, 2, 3, 4, 8, 9} -> "1-4, 8, 9" (three or more in a row as a range); "none" when empty.
std::string format_steps(const std::vector<int>& steps);

/// What must hold of the fp32 run `fp32` and the scaled fp16 run `scaled` (both trained with
/// `run`'s steps, `scaled` with its scaler), whatever the flags: the failures' messages,
/// none when all hold. fp16's gradient allreduce moves half fp32's bytes; every rank made
/// the same skip decisions; neither run diverged (chapter 02's rule); the scale never
/// reached 0 and some step was taken; every injected overflow was skipped.
std::vector<std::string> failed_checks(const RunConfig& run, const RunResult& fp32,
                                       const RunResult& scaled);

}  // namespace ch06
