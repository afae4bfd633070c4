// Chapter 06's exercise API: the dynamic loss scaler, and the unscale-and-check step.
//
// The rule is PyTorch's torch.cuda.amp.GradScaler (torch.amp), written out:
//   each step, the loss is multiplied by `scale` before the backward, so every gradient
//   is `scale` times too large; before the optimizer, the gradients are divided by it
//   again (unscaled, in fp32) and checked for inf and NaN;
//   a step with a non-finite gradient on any rank is skipped on every rank, and the
//   scale is multiplied by backoff_factor (0.5);
//   after growth_interval (2000) finite steps in a row, the scale is multiplied by
//   growth_factor (2) — unless that would make it infinite.
#pragma once

#include "shardlab/comm.hpp"
#include "shardlab/tensor.hpp"

namespace ch06 {

using shardlab::Communicator;
using shardlab::Tensor;

/// GradScaler's settings and defaults (init_scale 2^16, growth x2 after 2000 finite
/// steps, backoff x0.5). The factors are doubles, as GradScaler's are (Python floats): its
/// _amp_update_scale_ kernel multiplies the f32 scale by them in double and rounds the
/// product to f32 once, and so does update() (for a factor like 0.3, multiplying in f32
/// would be 1 ulp off now and then). GradScaler has no lowest scale: backing off can take
/// the scale below 1 (DeepSpeed's loss scaler floors it at min_loss_scale; not here).
struct ScalerConfig {
  float init_scale = 65536.0f;  ///< the scale of the first step
  double growth_factor = 2.0;   ///< what the scale is multiplied by when it grows
  double backoff_factor = 0.5;  ///< what the scale is multiplied by after a non-finite step
  int growth_interval = 2000;   ///< finite steps in a row after which the scale grows
};

// [exercise]
/// The dynamic loss scale and its growth tracker (the finite steps since the scale last
/// changed), as GradScaler keeps them.
class DynamicScaler {
 public:
  /// Starts at config.init_scale with the growth tracker at 0.
  explicit DynamicScaler(const ScalerConfig& config = {})
      : config_(config), scale_(config.init_scale) {}
  /// The scale to multiply this step's loss by.
  float scale() const { return scale_; }
  /// Finite steps in a row since the last change of the scale.
  int growth_tracker() const { return growth_tracker_; }
  /// The settings it was made with.
  const ScalerConfig& config() const { return config_; }
  /// After a step: `found_inf` says whether its gradients held an inf or NaN (on any
  /// rank). Backs off, or counts the step and grows the scale when the interval is full.
  void update(bool found_inf);

 private:
  ScalerConfig config_;
  float scale_;
  int growth_tracker_ = 0;
};

/// Unscales this rank's gradients and says whether the step must be skipped:
///   grads   the gradients of the scaled loss (f16 or f32), as the backward left them
///   out     f32, the same length: grads / loss_scale, computed in f32 (the name is not `scale`,
///           which would hide shardlab::scale() inside the function)
/// Returns true on every rank when any rank's unscaled gradients hold an inf or a NaN
/// (every rank calls it: the ranks agree, as FSDP's ShardedGradScaler makes them; under
/// DDP the allreduced gradients agree already).
bool unscale_and_check(Communicator& comm, const Tensor& grads, Tensor& out, float loss_scale);
// [exercise]

}  // namespace ch06
