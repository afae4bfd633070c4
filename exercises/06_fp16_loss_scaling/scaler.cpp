// Chapter 06 exercise: the dynamic loss scaler, and the unscale-and-check step.
// Read chapters/06_fp16_loss_scaling/README.md first (its table shows where fp16 runs
// out of numbers, and why scaling the loss brings the gradients back); check your work
// with `make check CH=06`, and watch your scaler at work with
// `build/learner/bin/ch06_fp16_loss_scaling --inject-overflow 30,31 --growth-interval 20`.
//
// Useful:
//   config_.growth_factor, config_.backoff_factor, config_.growth_interval
//   cast(t, DType::f32)            a tensor's values in f32 (tensor.hpp)
//   out.copy_from(t)               copies same-typed values into `out`
//   scale_in_place(t, s)           t *= s, in place (f32)
//   all_finite(t)                  false when t holds an inf or a NaN
//   comm.agree(x, ReduceOp::max)   the largest of every rank's x, on every rank
//
// Stuck? The chapter README's Exercise section has hints, one at a time.
#include "scaler.hpp"

#include <cmath>

#include "shardlab/check.hpp"
#include "shardlab/half.hpp"

using namespace shardlab;

namespace ch06 {

// TODO(ch06): DynamicScaler::update
// GradScaler's rule (scaler.hpp, and the README's "The scaler"), once after every step,
// skipped or not: scale_ and growth_tracker_ afterwards as GradScaler leaves them.
void DynamicScaler::update(bool found_inf) {
  (void)found_inf;
  SHARDLAB_TODO("ch06: DynamicScaler::update");
}

// TODO(ch06): unscale_and_check
// `out`: the gradients as they would be without the scale, in f32; the answer: must this
// step be skipped? It must be the same on every rank (scaler.hpp).
bool unscale_and_check(Communicator& comm, const Tensor& grads, Tensor& out, float loss_scale) {
  (void)comm, (void)grads, (void)out, (void)loss_scale;
  SHARDLAB_TODO("ch06: unscale_and_check");
}

}  // namespace ch06
