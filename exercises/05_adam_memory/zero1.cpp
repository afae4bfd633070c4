// Chapter 05 exercise: Adam's update, and ZeRO stage 1's sharded step.
// Read chapters/05_adam_memory/README.md first (its picture shows where each of the 16
// bytes per parameter lives, and what stage 1 shards); check your work with
// `make check CH=05`, and watch your code train with
// `build/learner/bin/ch05_adam_memory --train --ranks 4`.
//
// Names: N = ranks, r = this rank (comm.rank()), P = elements of the flat buffer, and
// shard.range = shard_range(P, N, r): the elements [offset, offset + length) rank r owns.
//
// Useful:
//   master.data()                 float* to the f32 elements (host)
//   grad.data<Half>()[i]          an f16 element; to_float(...) makes it a float
//   grad.dtype() == DType::f16    which type the gradient is (f16 or f32)
//   comm.reduce_scatter(in, out, ReduceOp::sum)    out = the sum over ranks of in's range r
//   comm.allgatherv(in, out, shard_counts(P, N))   every rank's `in`, in rank order, in out
//   cast(t, type), t.copy_from(src)                (tensor.hpp)
//
// Stuck? The chapter README's Exercise section has hints, one at a time.
#include "zero1.hpp"

#include <cmath>

#include "shardlab/check.hpp"
#include "shardlab/half.hpp"
#include "shardlab/memory.hpp"

using namespace shardlab;

namespace ch05 {

// TODO(ch05): adam_update
// For every element i, with g the gradient's element i as a float (f16 or f32: see
// "Useful" above) and p = master[i]:
//   Adam (config.decoupled false): g += weight_decay * p
//   AdamW (config.decoupled true): p -= lr * weight_decay * p, before the rest
//   m[i] = beta1 m[i] + (1 - beta1) g
//   v[i] = beta2 v[i] + (1 - beta2) g^2
//   p -= lr * (m[i] / (1 - beta1^t)) / (sqrt(v[i] / (1 - beta2^t)) + eps),  t = step
// Everything in float (f32), in this order: the tests compare with this update written
// out in double, and a GPU runs the library's kernel, which does the same.
void adam_update(Tensor& master, const Tensor& grad, Tensor& m, Tensor& v, int step,
                 const AdamConfig& config) {
  // A GPU: the library's kernel, which reads f32 gradients (an f16 one is widened into
  // a temporary the size of `grad` first).
  if (master.on_device()) {  // a GPU: the library's kernel (keep this)
    const Tensor g = grad.dtype() == DType::f32 ? grad : cast(grad, DType::f32);
    return nn::adam_update(master, g, m, v, step, config);
  }
  (void)grad, (void)m, (void)v, (void)step, (void)config;
  SHARDLAB_TODO("ch05: adam_update");
}

// TODO(ch05): zero1_step
// Three steps, on every rank:
//   1. the summed gradient of this rank's range only, into shard.grad;
//   2. Adam on this rank's range only (shard.master, shard.m, shard.v; count the step);
//   3. the updated range, in the parameters' type, into shard.send, then every rank's
//      range from every rank into params.
// Do not touch (or allocate for) the other ranks' ranges: the tests count the bytes each
// rank holds and moves.
void zero1_step(Communicator& comm, Tensor& params, const Tensor& grads, Shard& shard,
                const AdamConfig& config) {
  (void)comm, (void)params, (void)grads, (void)shard, (void)config;
  SHARDLAB_TODO("ch05: zero1_step");
}

}  // namespace ch05
