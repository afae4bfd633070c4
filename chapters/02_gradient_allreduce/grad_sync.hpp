// Chapter 02 API: keeping data-parallel replicas in sync by allreducing gradients.
//
// Names: P = comm.size() ranks; B = global batch, B_r = rank r's rows of it (uneven
// when P does not divide B). Each rank's gradients are the mean over its own B_r rows;
// the gradient of the global batch's mean loss is the *weighted* average
//     g = sum_r (B_r / B) * g_r,
// which is allreduce-then-divide-by-P when every B_r = B/P.
//
// The learner writes these in exercises/02_gradient_allreduce/grad_sync.cpp; the
// reference is solutions/02_gradient_allreduce/grad_sync.cpp.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/tensor.hpp"

namespace ch02 {

using shardlab::Communicator;
using shardlab::Tensor;

/// Replaces every gradient in `grads` with its weighted average over ranks (above):
/// scale by local_batch / global_batch, then one allreduce (sum) per tensor.
void allreduce_gradients(Communicator& comm, std::span<Tensor* const> grads,
                         std::int64_t local_batch, std::int64_t global_batch);

/// A bucket: which gradients travel together in one flat allreduce.
struct Bucket {
  std::vector<std::size_t> tensors;  // indices into grads, in order
  std::int64_t elements = 0;         // sum of their sizes
};

/// Groups `grads`, in the order given, into buckets of at most `bucket_bytes` bytes
/// each (float32). A gradient is never split: one larger than a bucket gets a bucket of
/// its own. PyTorch DDP does the same, in reverse parameter order (the order backward
/// produces the gradients).
std::vector<Bucket> plan_buckets(std::span<Tensor* const> grads, std::int64_t bucket_bytes);

/// Copies the bucket's gradients, one after another, into `flat` (bucket.elements long).
void pack_bucket(const Bucket& bucket, std::span<Tensor* const> grads, Tensor& flat);

/// Copies `flat` back into the bucket's gradients: the inverse of pack_bucket.
void unpack_bucket(const Bucket& bucket, const Tensor& flat, std::span<Tensor* const> grads);

/// One bucket's weighted average: pack, scale by local_batch / global_batch, one
/// allreduce (sum), unpack.
void allreduce_bucket(Communicator& comm, const Bucket& bucket, std::span<Tensor* const> grads,
                      std::int64_t local_batch, std::int64_t global_batch);

}  // namespace ch02
