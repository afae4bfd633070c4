// Chapter 02 exercise: gradient averaging, per tensor and in buckets.
// Read chapters/02_gradient_allreduce/README.md first; check with `make check CH=02`.
//
// Names: P ranks; B = global batch, B_r = this rank's rows (local_batch). Each rank's
// gradients are the mean over its own rows, so the global gradient is the weighted
// average g = sum_r (B_r / B) * g_r (with an even split: allreduce, then divide by P).
//
// Useful: comm.allreduce(tensor, ReduceOp::sum) sums a Tensor over ranks in place;
// a Tensor iterates like a container (for (float& v : t)), t.size() counts elements.
#include "grad_sync.hpp"

#include <algorithm>

#include "shardlab/check.hpp"

namespace ch02 {

// TODO(ch02): allreduce_gradients
// For every gradient tensor g in grads:
//   1. multiply each element by local_batch / global_batch (compute it in double, then
//      use it as a float),
//   2. comm.allreduce(*g, ReduceOp::sum).
// Afterwards every rank holds the same averaged gradients, so the replicas step alike.
void allreduce_gradients(Communicator& comm, std::span<Tensor* const> grads,
                         std::int64_t local_batch, std::int64_t global_batch) {
  (void)comm, (void)grads, (void)local_batch, (void)global_batch;
  SHARDLAB_TODO("ch02: allreduce_gradients");
}

// TODO(ch02): plan_buckets
// Walk grads in order. Capacity = bucket_bytes / 4 elements (at least 1). Open a new
// bucket when there is none yet or when grads[i] would overflow the open one;
// then add i to the open bucket and its size to bucket.elements.
// A gradient bigger than the capacity ends up alone in its bucket (never split).
std::vector<Bucket> plan_buckets(std::span<Tensor* const> grads, std::int64_t bucket_bytes) {
  (void)grads, (void)bucket_bytes;
  SHARDLAB_TODO("ch02: plan_buckets");
}

// TODO(ch02): pack_bucket
// Copy grads[i] for each i in bucket.tensors, in that order, into flat, back to back.
void pack_bucket(const Bucket& bucket, std::span<Tensor* const> grads, Tensor& flat) {
  (void)bucket, (void)grads, (void)flat;
  SHARDLAB_TODO("ch02: pack_bucket");
}

// TODO(ch02): unpack_bucket
// The inverse of pack_bucket: copy consecutive pieces of flat back into each grads[i].
void unpack_bucket(const Bucket& bucket, const Tensor& flat, std::span<Tensor* const> grads) {
  (void)bucket, (void)flat, (void)grads;
  SHARDLAB_TODO("ch02: unpack_bucket");
}

// TODO(ch02): allreduce_bucket
// Steps: Tensor flat(bucket.elements); pack; scale every element by
// local_batch / global_batch; allreduce (sum); unpack.
// Hint: one allreduce for the whole bucket is the point — fewer, larger messages.
void allreduce_bucket(Communicator& comm, const Bucket& bucket, std::span<Tensor* const> grads,
                      std::int64_t local_batch, std::int64_t global_batch) {
  (void)comm, (void)bucket, (void)grads, (void)local_batch, (void)global_batch;
  SHARDLAB_TODO("ch02: allreduce_bucket");
}

}  // namespace ch02
