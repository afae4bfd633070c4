// Chapter 05 exercise: what ZeRO stage 1 keeps on a rank, and its sharded step.
// Read chapters/05_adam_memory/README.md first (its picture shows where each of the 16
// bytes per parameter lives, and what stage 1 shards); check your work with
// `make check CH=05`, and watch your code train with
// `build/learner/bin/ch05_adam_memory --train --ranks 4` (stage 1 runs your step).
//
// Names: N = ranks, r = this rank (comm.rank()), P = elements of the flat buffer, and
// shard.range = shard_range(P, N, r): the elements [offset, offset + length) rank r owns.
//
// Useful:
//   shard_range(P, N, r)                           {offset, length} of rank r's range
//   params.slice(offset, length)                   a view of a range (no copy)
//   zeros(Shape{n}, DType::f32, params.memory())   a new tensor, where params live
//   memory::Scope scope(memory::Category::master)  what this block allocates is counted as
//                                                  master (also optimizer, comm: memory.hpp)
//   comm.reduce_scatter(in, out, ReduceOp::sum)    out = the sum over ranks of in's range r
//   nn::adam_update(master, grad, m, v, t, config) one Adam step t = 1, 2, ... over f32
//                                                  weights (grad f32 or f16), in place
//   comm.allgatherv(in, out, shard_counts(P, N))   every rank's `in`, in rank order, in out
//   cast(t, type), t.copy_from(src)                (tensor.hpp)
//
// Stuck? The chapter README's Exercise section has hints, one at a time.
#include "zero1.hpp"

#include "shardlab/check.hpp"
#include "shardlab/memory.hpp"

using namespace shardlab;

namespace ch05 {

// TODO(ch05): make_shard
// Rank r's part of stage 1's optimizer, for its range of `params` (P = params.size()):
//   range   shard_range(P, N, r)
//   master  f32: a copy of the range (category master) when params are f16; when params
//           are f32, a view of the range itself (no copy: the weights are their own
//           master, and the ledger must count nothing for it)
//   m, v    f32 zeros of the range's length (category optimizer)
//   grad    the range's length, of grad_type; send, of params' type (category comm)
// Everything in params.memory(). Allocate nothing the size of the whole buffer.
Shard make_shard(Communicator& comm, Tensor& params, DType grad_type) {
  (void)comm, (void)params, (void)grad_type;
  SHARDLAB_TODO("ch05: make_shard");
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
