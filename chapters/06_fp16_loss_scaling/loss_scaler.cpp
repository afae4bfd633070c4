// Chapter 06's loss scaler for any trainer (see loss_scaler.hpp).
#include "loss_scaler.hpp"

#include "shardlab/check.hpp"

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

}  // namespace ch06
