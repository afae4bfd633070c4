// Chapter 06's loss scaler for any trainer (see loss_scaler.hpp).
#include "loss_scaler.hpp"

#include <algorithm>

#include "shardlab/check.hpp"
#include "shardlab/format.hpp"

using namespace shardlab;

namespace ch06 {

LossScaler::LossScaler(Scaler kind, ScalerConfig dynamic, float fixed_scale)
    : kind_(kind), dynamic_(dynamic), fixed_(fixed_scale) {
  require(fixed_scale > 0 && dynamic.init_scale > 0, "LossScaler: scales are positive");
}

float LossScaler::scale() const {
  switch (kind_) {
    case Scaler::none:
      return 1.0f;
    case Scaler::fixed:
      return fixed_;
    case Scaler::dynamic:
      break;
  }
  return dynamic_.scale();
}

bool LossScaler::unscale_and_check(Communicator& comm, const Tensor& grads, Tensor& out) const {
  if (kind_ != Scaler::none) return ch06::unscale_and_check(comm, grads, out, scale());
  out.copy_from(grads.dtype() == DType::f32 ? grads : cast(grads, DType::f32));
  return false;
}

void LossScaler::update(bool found_inf) {
  if (kind_ == Scaler::dynamic) dynamic_.update(found_inf);
}

void LossScaler::restore(float scale, int growth_tracker) {
  require(scale > 0 && growth_tracker >= 0 &&
              growth_tracker < std::max(1, dynamic_.config().growth_interval),
          "LossScaler::restore: a positive scale and a growth tracker below the interval");
  if (kind_ == Scaler::fixed) fixed_ = scale;
  if (kind_ != Scaler::dynamic) return;
  ScalerConfig config = dynamic_.config();
  config.init_scale = scale;
  dynamic_ = DynamicScaler(config);
  for (int i = 0; i < growth_tracker; ++i) dynamic_.update(false);
}

std::string no_step_taken(Scaler kind, int skipped, int steps, double first_scale) {
  if (skipped < steps) return "";
  return "every one of the " + std::to_string(steps) +
         " steps was skipped (non-finite gradients from a loss scale of " +
         shardlab::format_number(first_scale) + " on): the weights never moved; " +
         (kind == Scaler::dynamic ? "start lower (--init-scale) or train longer"
                                  : "use a lower --scale");
}

}  // namespace ch06
