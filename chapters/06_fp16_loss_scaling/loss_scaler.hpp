// Chapter 06's loss scaler, for any trainer: GradScaler's three steps around a backward
// (torch.amp.GradScaler: scale the loss, unscale and check the gradients, update the
// scale), over any gradients (a ParameterStore's flat buffer, a ZeRO shard) and any
// communicator (all the data-parallel ranks, or a mesh's dp axis).
//
//   ch06::LossScaler scaler(ch06::Scaler::dynamic);
//   dL/dout *= scaler.scale();                       before the backward (the loss's
//   ... backward, the gradients' reduction ...        gradient, or the loss itself)
//   const bool skip = scaler.unscale_and_check(comm, grads, unscaled);  every rank agrees
//   if (!skip) optimizer step with `unscaled`;
//   scaler.update(skip);
//
// The rule itself, DynamicScaler::update and unscale_and_check, is the exercise
// (scaler.hpp).
#pragma once

#include <string>

#include "scaler.hpp"

namespace ch06 {

/// Which loss scaling a LossScaler applies (--scaler none | static | dynamic).
enum class Scaler {
  none,    ///< no scaling: the scale is 1 and nothing is checked
  fixed,   ///< --scaler static: one scale for every step
  dynamic  ///< GradScaler's: backs off on inf or NaN, grows after enough finite steps
};

/// GradScaler's three steps around a backward (scale, unscale and check, update) for any
/// trainer, with no scaling, a fixed scale or the dynamic one (see the top of this file).
class LossScaler {
 public:
  /// `fixed_scale` is Scaler::fixed's scale; `dynamic` DynamicScaler's settings.
  explicit LossScaler(Scaler kind = Scaler::dynamic, ScalerConfig dynamic = {},
                      float fixed_scale = 65536.0f);
  /// Which scaling it applies.
  Scaler kind() const { return kind_; }
  /// What this step's loss (or its gradient) is multiplied by: 1 with Scaler::none.
  float scale() const;
  /// out = grads / scale(), in f32 (grads f16 or f32, out f32 of the same length). True
  /// on every rank when any rank's unscaled gradients hold an inf or a NaN: the step must
  /// be skipped everywhere. Scaler::none only copies (nothing is scaled, nothing checked:
  /// false).
  bool unscale_and_check(Communicator& comm, const Tensor& grads, Tensor& out) const;
  /// After the step (skipped or not): the dynamic scale backs off or grows; the others
  /// stay as they are.
  void update(bool found_inf);
  /// The dynamic scaler's state (its scale and growth tracker; kept, unused, by the others).
  const DynamicScaler& dynamic() const { return dynamic_; }
  /// Sets the state to a saved one (a checkpoint's): the scale and, for the dynamic
  /// scaler, its growth tracker (replayed: that many finite steps from that scale).
  void restore(float scale, int growth_tracker);

 private:
  Scaler kind_;
  DynamicScaler dynamic_;
  float fixed_;
};

/// "" when a run took at least one of its `steps` steps; else why it did not train: every
/// step skipped from a loss scale of `first_scale` on (a fixed scale that overflows the
/// gradients every time, a dynamic one that has not backed off enough yet). A run that
/// never updated its weights is dead, never "ok".
std::string no_step_taken(Scaler kind, int skipped, int steps, double first_scale);

}  // namespace ch06
