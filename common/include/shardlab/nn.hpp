// nn: the few layers the chapters train, forward and backward written out.
//
// Shapes: B = batch rows, I = input features, O = output features.
//   Linear    y = x @ W + b            x is B x I, W is I x O, b is 1 x O, y is B x O
//   tanh      y = tanh(x)              dx = dy * (1 - y^2)
//   MSE       L = 1/(2B) * sum (p - t)^2   dp = (p - t) / B
// Gradients accumulate (+=) until zero_grad, so micro-batches can add up.
#pragma once

#include <cstdint>
#include <vector>

#include "shardlab/tensor.hpp"

namespace shardlab::nn {

/// A parameter and its gradient, side by side.
struct Parameter {
  Tensor value;
  Tensor grad;
  explicit Parameter(Tensor v) : value(std::move(v)), grad(value.rows(), value.cols()) {}
};

class Linear {
 public:
  /// W ~ N(0, 1/I) from `seed` (LeCun init), b = 0.
  Linear(std::int64_t in, std::int64_t out, std::uint64_t seed);
  /// y = x @ W + b; remembers x for backward.
  Tensor forward(const Tensor& x);
  /// Given dL/dy, adds dL/dW = x^T @ dy and dL/db = column sums of dy to the gradients
  /// and returns dL/dx = dy @ W^T.
  Tensor backward(const Tensor& dy);
  Parameter weight, bias;

 private:
  Tensor input_;
};

Tensor tanh_forward(const Tensor& x);
/// dL/dx from dL/dy and y = tanh(x).
Tensor tanh_backward(const Tensor& y, const Tensor& dy);

/// sum over elements of (pred - target)^2; the MSE loss is this / (2B).
double squared_error(const Tensor& pred, const Tensor& target);
/// dL/dpred for L = sum (pred - target)^2 / (2 * denominator): (pred - target) / denominator.
Tensor mse_backward(const Tensor& pred, const Tensor& target, double denominator);

/// value -= lr * grad.
void sgd_step(Parameter& p, float lr);

/// Adam's state for one parameter: first and second moments, and the step count.
struct AdamState {
  Tensor m, v;
  int t = 0;
};
/// One Adam step (Kingma & Ba 2015, Algorithm 1), element by element:
///   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
///   value -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).
/// The CPU reference of cuda::adam_step.
void adam_step(Parameter& p, AdamState& state, float lr, float b1 = 0.9f, float b2 = 0.999f,
               float eps = 1e-8f);

}  // namespace shardlab::nn
