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
// On an overflow (found_inf): multiply the scale by backoff_factor and restart the
// count of finite steps. Otherwise: one more finite step; when the count reaches
// growth_interval, multiply the scale by growth_factor (only if the result is finite)
// and restart the count.
void DynamicScaler::update(bool found_inf) {
  (void)found_inf;
  SHARDLAB_TODO("ch06: DynamicScaler::update");
}

// TODO(ch06): unscale_and_check
// 1. out = grads / loss_scale, computed in f32 (grads may be f16);
// 2. does out hold an inf or a NaN on this rank?
// 3. the answer for the whole job: true on every rank if true on any.
bool unscale_and_check(Communicator& comm, const Tensor& grads, Tensor& out, float loss_scale) {
  (void)comm, (void)grads, (void)out, (void)loss_scale;
  SHARDLAB_TODO("ch06: unscale_and_check");
}

}  // namespace ch06
