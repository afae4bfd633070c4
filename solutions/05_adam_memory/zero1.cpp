// Chapter 05 solution: Adam's update, and ZeRO stage 1's sharded step.
#include "zero1.hpp"

#include <cmath>

#include "shardlab/check.hpp"
#include "shardlab/half.hpp"
#include "shardlab/memory.hpp"

using namespace shardlab;

namespace ch05 {

void adam_update(Tensor& master, const Tensor& grad, Tensor& m, Tensor& v, int step,
                 const AdamConfig& config) {
  // A GPU: the library's kernel, which reads f32 gradients (an f16 one is widened into
  // a temporary the size of `grad` first).
  if (master.on_device()) {  // a GPU: the library's kernel, on an f32 gradient
    const Tensor g = grad.dtype() == DType::f32 ? grad : cast(grad, DType::f32);
    return nn::adam_update(master, g, m, v, step, config);
  }
  const std::int64_t n = master.size();
  require(grad.size() == n && m.size() == n && v.size() == n && step >= 1, [&] {
    return "adam_update: master " + master.describe() + ", grad " + grad.describe() + ", m " +
           m.describe() + ", v " + v.describe() + " at step " + std::to_string(step);
  });
  const AdamConfig& c = config;
  // The bias corrections: m and v start at zero, so early averages are too small by
  // these factors.
  const float c1 = 1.0f - std::pow(c.beta1, static_cast<float>(step));
  const float c2 = 1.0f - std::pow(c.beta2, static_cast<float>(step));
  float* p = master.data();
  float* mm = m.data();
  float* vv = v.data();
  const bool half = grad.dtype() == DType::f16;
  const float* g32 = half ? nullptr : grad.data();
  const Half* g16 = half ? grad.data<Half>() : nullptr;
  for (std::int64_t i = 0; i < n; ++i) {
    float g = half ? to_float(g16[i]) : g32[i];
    if (c.decoupled)
      p[i] -= c.lr * c.weight_decay * p[i];  // AdamW: decay the weight itself
    else
      g += c.weight_decay * p[i];  // Adam: L2 through the gradient
    mm[i] = c.beta1 * mm[i] + (1.0f - c.beta1) * g;
    vv[i] = c.beta2 * vv[i] + (1.0f - c.beta2) * g * g;
    p[i] -= c.lr * (mm[i] / c1) / (std::sqrt(vv[i] / c2) + c.eps);
  }
}

void zero1_step(Communicator& comm, Tensor& params, const Tensor& grads, Shard& shard,
                const AdamConfig& config) {
  const int N = comm.size();
  // 1. Each rank gets the sum over ranks of its own range of the gradients: P (N-1)/N
  //    elements in, no more (an allreduce would bring in twice that).
  comm.reduce_scatter(grads, shard.grad, ReduceOp::sum);
  // 2. Adam on that range only: the state of the others' ranges lives on their ranks.
  ch05::adam_update(shard.master, shard.grad, shard.m, shard.v, ++shard.step, config);
  // 3. The updated range, in the parameters' type, goes to every rank.
  {
    memory::Scope scope(memory::Category::comm);
    shard.send.copy_from(shard.send.dtype() == DType::f32 ? shard.master
                                                          : cast(shard.master, shard.send.dtype()));
  }
  comm.allgatherv(shard.send, params, shard_counts(params.size(), N));
}

}  // namespace ch05
