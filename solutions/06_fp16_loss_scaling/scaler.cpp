// Chapter 06 solution: the dynamic loss scaler, and the unscale-and-check step.
#include "scaler.hpp"

#include <cmath>

#include "shardlab/check.hpp"
#include "shardlab/half.hpp"

using namespace shardlab;

namespace ch06 {

void DynamicScaler::update(bool found_inf) {
  // The products in double, rounded to f32 once (as GradScaler's kernel).
  if (found_inf) {  // this step was skipped: a smaller scale, and count again from zero
    scale_ = static_cast<float>(scale_ * config_.backoff_factor);
    growth_tracker_ = 0;
    return;
  }
  const int successful = growth_tracker_ + 1;
  if (successful == config_.growth_interval) {
    const auto grown = static_cast<float>(scale_ * config_.growth_factor);
    if (std::isfinite(grown)) scale_ = grown;  // never an infinite scale
    growth_tracker_ = 0;
  } else {
    growth_tracker_ = successful;
  }
}

bool unscale_and_check(Communicator& comm, const Tensor& grads, Tensor& out, float loss_scale) {
  require(out.dtype() == DType::f32 && out.size() == grads.size(), [&] {
    return "unscale_and_check: out " + out.describe() + " must be f32, as long as grads " +
           grads.describe();
  });
  // In f32: dividing in f16 would underflow the small gradients all over again.
  out.copy_from(grads.dtype() == DType::f32 ? grads : cast(grads, DType::f32));
  scale_in_place(out, 1.0f / loss_scale);  // GradScaler multiplies by the reciprocal, too
  const bool mine = !all_finite(out);
  // One rank's inf must stop every rank: a rank that stepped alone would leave the
  // replicas different from then on.
  return comm.agree(mine ? 1 : 0, ReduceOp::max) == 1;
}

}  // namespace ch06
