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
//   t.slice(offset, length)                        a view of a range (no copy)
//   zeros(Shape{n}, DType::f32, t.memory())        a new tensor, where t lives
//   memory::Scope scope(memory::Category::master)  what this block allocates is counted as
//                                                  master (also optimizer, comm: memory.hpp)
//   comm.reduce_scatter(in, out, ReduceOp::sum)    out = the sum over ranks of in's range r
//   nn::adam_update(w, grad, m, v, t, config)      one Adam step t = 1, 2, ... over f32
//                                                  weights (grad f32 or f16), in place
//   comm.allgatherv(in, out, counts)               every rank's `in`, in rank order, in out
//   shard_counts(P, N)                             every rank's range length
//   cast(t, type), t.copy_from(src)                (tensor.hpp)
//
// Stuck? The chapter README's Exercise section has hints, one at a time.
#include "zero1.hpp"

#include "shardlab/check.hpp"
#include "shardlab/memory.hpp"

using namespace shardlab;

namespace ch05 {

// TODO(ch05): make_shard
// What stage 1 keeps on rank r for its range of `params` (zero1.hpp's Shard): the weights
// the optimizer updates, in f32, Adam's m and v, and the buffers the step's two
// collectives need, each charged to its memory-ledger category. The tests count every
// category's bytes: allocate nothing the size of the whole buffer, and nothing at all
// where a view will do.
Shard make_shard(Communicator& comm, Tensor& params, DType grad_type) {
  (void)comm, (void)params, (void)grad_type;
  SHARDLAB_TODO("ch05: make_shard");
}

// TODO(ch05): zero1_step
// Afterwards every rank's params are what Adam on the sum over ranks of the gradients
// gives (zero1.hpp), while this rank has updated, and moved, only its own range: the
// tests count what each rank receives and allocates during the step.
void zero1_step(Communicator& comm, Tensor& params, const Tensor& grads, Shard& shard,
                const AdamConfig& config) {
  (void)comm, (void)params, (void)grads, (void)shard, (void)config;
  SHARDLAB_TODO("ch05: zero1_step");
}

}  // namespace ch05
