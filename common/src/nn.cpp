// nn: Linear, tanh, MSE and SGD.
#include "shardlab/nn.hpp"

#include <cmath>

#include "shardlab/check.hpp"

namespace shardlab::nn {

Linear::Linear(std::int64_t in, std::int64_t out, std::uint64_t seed)
    : weight(scale(randn(in, out, seed), 1.0f / std::sqrt(static_cast<float>(in)))),
      bias(Tensor(1, out)) {}

Tensor Linear::forward(const Tensor& x) {
  input_ = x;
  Tensor y = matmul(x, weight.value);
  for (std::int64_t i = 0; i < y.rows(); ++i)
    for (std::int64_t j = 0; j < y.cols(); ++j) y(i, j) += bias.value(0, j);
  return y;
}

Tensor Linear::backward(const Tensor& dy) {
  require(dy.rows() == input_.rows(), "Linear::backward: dy has " + std::to_string(dy.rows()) +
                                          " rows, the input had " + std::to_string(input_.rows()));
  const Tensor dw = matmul(transpose(input_), dy);
  for (std::int64_t i = 0; i < dw.size(); ++i) weight.grad[i] += dw[i];
  for (std::int64_t j = 0; j < dy.cols(); ++j) {
    float column = 0;
    for (std::int64_t i = 0; i < dy.rows(); ++i) column += dy(i, j);
    bias.grad(0, j) += column;
  }
  return matmul(dy, transpose(weight.value));
}

Tensor tanh_forward(const Tensor& x) {
  Tensor y = x;
  for (float& v : y) v = std::tanh(v);
  return y;
}

Tensor tanh_backward(const Tensor& y, const Tensor& dy) {
  Tensor dx = dy;
  for (std::int64_t i = 0; i < dx.size(); ++i) dx[i] *= 1.0f - y[i] * y[i];
  return dx;
}

double squared_error(const Tensor& pred, const Tensor& target) {
  require(pred.same_shape(target), "squared_error: shapes differ");
  double sum = 0;
  for (std::int64_t i = 0; i < pred.size(); ++i) {
    const double d = static_cast<double>(pred[i]) - static_cast<double>(target[i]);
    sum += d * d;
  }
  return sum;
}

Tensor mse_backward(const Tensor& pred, const Tensor& target, double denominator) {
  Tensor d = sub(pred, target);
  const auto inv = static_cast<float>(1.0 / denominator);
  for (float& v : d) v *= inv;
  return d;
}

void sgd_step(Parameter& p, float lr) { axpy(-lr, p.grad, p.value); }

void adam_step(Parameter& p, AdamState& s, float lr, float b1, float b2, float eps) {
  if (s.m.empty() && !p.value.empty()) {
    s.m = Tensor(p.value.rows(), p.value.cols());
    s.v = Tensor(p.value.rows(), p.value.cols());
  }
  ++s.t;
  const float c1 = 1.0f - std::pow(b1, static_cast<float>(s.t)),
              c2 = 1.0f - std::pow(b2, static_cast<float>(s.t));
  for (std::int64_t i = 0; i < p.value.size(); ++i) {
    const float g = p.grad[i];
    s.m[i] = b1 * s.m[i] + (1.0f - b1) * g;
    s.v[i] = b2 * s.v[i] + (1.0f - b2) * g * g;
    p.value[i] -= lr * (s.m[i] / c1) / (std::sqrt(s.v[i] / c2) + eps);
  }
}

}  // namespace shardlab::nn
