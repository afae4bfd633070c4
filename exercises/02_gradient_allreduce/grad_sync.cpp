// Chapter 02 exercise: gradient averaging, per tensor and in buckets.
// Read chapters/02_gradient_allreduce/README.md first; check with `make check CH=02`.
//
// The goal: after the sync, every rank holds the gradient of the whole global batch's
// mean loss, bit for bit the same on every rank, so that every replica takes the same
// step. Each rank arrives with the mean gradient over its own rows only, and the ranks
// may hold different numbers of rows (B = 13 on 4 ranks: 4, 3, 3, 3), so what you want
// is the batch-weighted average
//     g = sum over ranks r of (B_r / B) * g_r
// where B is global_batch and B_r is rank r's local_batch (0 is possible: that rank
// still takes part in every collective).
//
// The gradients live in one flat buffer, parameters back to back in the order the
// model added them; each parameter's grad is a view of its range of that buffer.
//
// Useful (common/include/shardlab/):
//   p->grad                             a parameter's gradient: a view into the flat buffer
//   p->offset, p->grad.size()           where that view starts in the flat buffer, its length
//   shardlab::scale_in_place(t, s)      t *= s (on the CPU or the GPU)
//   flat.slice(begin, count)            count elements of a 1-D tensor from begin, as a
//                                       view: writing to it writes the gradients
//   allreduce(comm, t)                  the sum over ranks, in place (the communicator's
//                                       own allreduce, or one plugged in: chapter 03's ring)
//   comm.iallreduce(t, ReduceOp::sum)   the communicator's sum, started now; returns a
//                                       Request
//
// Stuck? The chapter README's Exercise section has hints, one at a time.
#include "grad_sync.hpp"

#include <algorithm>

#include "shardlab/check.hpp"

namespace ch02 {

// TODO(ch02): allreduce_gradients
// Receives: every parameter of this rank's model (p->grad holds this rank's mean
// gradient over its local_batch rows), this rank's row count and the global batch.
// Afterwards: every p->grad, on every rank, holds the batch-weighted average above.
// One allreduce(comm, grad) per parameter tensor (--sync allreduce), in params order,
// the same calls on every rank. Think first: an allreduce can only add, so what must
// this rank put into the sum?
void allreduce_gradients(Communicator& comm, std::span<Parameter* const> params,
                         std::int64_t local_batch, std::int64_t global_batch,
                         const AllreduceFn& allreduce) {
  (void)comm, (void)params, (void)local_batch, (void)global_batch, (void)allreduce;
  SHARDLAB_TODO("ch02: allreduce_gradients");
}

// TODO(ch02): plan_buckets
// Receives: the parameters (in the order of the flat buffer) and a bucket capacity in
// bytes; the gradients are float32. Returns: the buckets, in the order backward
// finishes their gradients (the last parameter first), each holding
//   params    the indices into params of its parameters, in the order they joined;
//   offset    where its range starts in the flat buffer (in elements);
//   elements  the length of that range: the sum of its parameters' sizes.
// Must hold: every parameter is in exactly one bucket, and concatenating the buckets'
// params gives n-1, n-2, ..., 0; a bucket never exceeds the capacity unless it holds a
// single gradient that is bigger on its own (a gradient is never split); each bucket's
// range [offset, offset + elements) covers exactly its parameters' gradients. It uses
// no communication: every rank plans the same buckets from the same model.
std::vector<Bucket> plan_buckets(std::span<Parameter* const> params, std::int64_t bucket_bytes) {
  (void)params, (void)bucket_bytes;
  SHARDLAB_TODO("ch02: plan_buckets");
}

// TODO(ch02): start_bucket_allreduce
// Receives: the flat gradient buffer (1-D, all parameters), one bucket of it, this
// rank's row count and the global batch. Returns: the request of a started, not yet
// finished, allreduce. Once the trainer has waited for it, the bucket's range of
// flat_grads holds the batch-weighted average, and every element outside the range is
// unchanged. One allreduce for the whole bucket, in place: no copy in or out.
Request start_bucket_allreduce(Communicator& comm, Tensor& flat_grads, const Bucket& bucket,
                               std::int64_t local_batch, std::int64_t global_batch) {
  (void)comm, (void)flat_grads, (void)bucket, (void)local_batch, (void)global_batch;
  SHARDLAB_TODO("ch02: start_bucket_allreduce");
}

}  // namespace ch02
