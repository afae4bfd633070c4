// Chapter 05 solution: what ZeRO stage 1 keeps on a rank, and its sharded step.
#include "zero1.hpp"

#include "shardlab/memory.hpp"

using namespace shardlab;

namespace ch05 {

Shard make_shard(Communicator& comm, Tensor& params, DType grad_type) {
  Shard s;
  s.range = shard_range(params.size(), comm.size(), comm.rank());
  const Tensor mine = params.slice(s.range.offset, s.range.length);
  const Shape shape{s.range.length};
  if (params.dtype() == DType::f32) {
    s.master = mine;  // fp32 training: the optimizer updates the parameters themselves
  } else {
    memory::Scope scope(memory::Category::master);
    s.master = cast(mine, DType::f32);
  }
  {
    memory::Scope scope(memory::Category::optimizer);
    s.m = zeros(shape, DType::f32, params.memory());
    s.v = zeros(shape, DType::f32, params.memory());
  }
  memory::Scope scope(memory::Category::comm);
  s.grad = Tensor(shape, grad_type, params.memory());
  s.send = Tensor(shape, params.dtype(), params.memory());
  return s;
}

void zero1_step(Communicator& comm, Tensor& params, const Tensor& grads, Shard& shard,
                const AdamConfig& config) {
  const int N = comm.size();
  // 1. Each rank gets the sum over ranks of its own range of the gradients: P (N-1)/N
  //    elements in, no more (an allreduce would bring in twice that).
  comm.reduce_scatter(grads, shard.grad, ReduceOp::sum);
  // 2. Adam on that range only: the state of the others' ranges lives on their ranks.
  nn::adam_update(shard.master, shard.grad, shard.m, shard.v, ++shard.step, config);
  // 3. The updated range, in the parameters' type, goes to every rank.
  {
    memory::Scope scope(memory::Category::comm);
    shard.send.copy_from(shard.send.dtype() == DType::f32 ? shard.master
                                                          : cast(shard.master, shard.send.dtype()));
  }
  comm.allgatherv(shard.send, params, shard_counts(params.size(), N));
}

}  // namespace ch05
