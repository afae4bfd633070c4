// Chapter 02 exercise: gradient averaging, per tensor and in buckets.
// Read chapters/02_gradient_allreduce/README.md first; check with `make check CH=02`.
//
// Names: P ranks; B = global batch, B_r = this rank's rows (local_batch). Each rank's
// gradients are the mean over its own rows, so the global gradient is the weighted
// average g = sum_r (B_r / B) * g_r (with an even split: allreduce, then divide by P).
//
// Useful:
//   p->grad                       a parameter's gradient: a view into the flat buffer
//   p->offset, p->grad.size()     where that view starts in the flat buffer, and its length
//   shardlab::scale_in_place(t, s)          t *= s (on the CPU or the GPU)
//   flat.slice(offset, count)     elements offset .. offset + count of a 1-D tensor, as a
//                                 view: writing to it writes the gradients
//   comm.allreduce(t, ReduceOp::sum)        the sum over ranks, in place
//   comm.iallreduce(t, ReduceOp::sum)       the same, started now; returns a Request
#include "grad_sync.hpp"

#include <algorithm>

#include "shardlab/check.hpp"

namespace ch02 {

// TODO(ch02): allreduce_gradients
// For every parameter p in params:
//   1. multiply p->grad by local_batch / global_batch (compute it in double, then use it
//      as a float),
//   2. comm.allreduce(p->grad, ReduceOp::sum).
// Afterwards every rank holds the same averaged gradients, so the replicas step alike.
void allreduce_gradients(Communicator& comm, std::span<Parameter* const> params,
                         std::int64_t local_batch, std::int64_t global_batch) {
  (void)comm, (void)params, (void)local_batch, (void)global_batch;
  SHARDLAB_TODO("ch02: allreduce_gradients");
}

// TODO(ch02): plan_buckets
// Walk params from the LAST to the first. Capacity = bucket_bytes / 4 elements (at least
// 1). Open a new bucket when there is none yet or when this gradient would overflow the
// open one; then add the parameter's index to bucket.params and its size to
// bucket.elements. A gradient bigger than the capacity ends up alone in its bucket.
// bucket.offset is where the bucket's range starts in the flat buffer: walking backwards,
// each parameter you add sits just before the ones already in the bucket.
std::vector<Bucket> plan_buckets(std::span<Parameter* const> params, std::int64_t bucket_bytes) {
  (void)params, (void)bucket_bytes;
  SHARDLAB_TODO("ch02: plan_buckets");
}

// TODO(ch02): start_bucket_allreduce
// Steps: take the bucket's range of flat_grads as a view (slice); scale it by
// local_batch / global_batch; return comm.iallreduce(view, ReduceOp::sum).
// Hint: one allreduce for the whole bucket is the point — fewer, larger messages, and no
// copy in or out, because the view is the gradients themselves.
Request start_bucket_allreduce(Communicator& comm, Tensor& flat_grads, const Bucket& bucket,
                               std::int64_t local_batch, std::int64_t global_batch) {
  (void)comm, (void)flat_grads, (void)bucket, (void)local_batch, (void)global_batch;
  SHARDLAB_TODO("ch02: start_bucket_allreduce");
}

}  // namespace ch02
