// Chapter 02 API: keeping data-parallel replicas in sync by allreducing gradients.
//
// Names: P = comm.size() ranks; B = global batch, B_r = rank r's rows of it (uneven
// when P does not divide B). Each rank's gradients are the mean over its own B_r rows;
// the gradient of the global batch's mean loss is the *weighted* average
//     g = sum_r (B_r / B) * g_r,
// which is allreduce-then-divide-by-P when every B_r = B/P.
//
// The gradients live in one flat buffer (nn::ParameterStore): each parameter's grad is a
// view of its range, parameters one after another in the order the model added them. A
// bucket is a range of that buffer, so allreducing it moves the gradients in place: no
// packing into a separate buffer, no unpacking after (PyTorch DDP's gradient views of its
// buckets do the same).
//
// The learner writes these in exercises/02_gradient_allreduce/grad_sync.cpp; the
// reference is solutions/02_gradient_allreduce/grad_sync.cpp.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/tensor.hpp"

namespace ch02 {

using shardlab::Communicator;
using shardlab::Request;
using shardlab::Tensor;
using shardlab::nn::Parameter;

/// Replaces every parameter's gradient with its weighted average over ranks (above):
/// scale it by local_batch / global_batch, then one allreduce (sum) per gradient tensor.
void allreduce_gradients(Communicator& comm, std::span<Parameter* const> params,
                         std::int64_t local_batch, std::int64_t global_batch);

/// A bucket: gradients that travel together in one allreduce, a contiguous range of the
/// flat gradient buffer.
struct Bucket {
  std::vector<std::size_t> params;  // indices into params, in the order they were added
  std::int64_t offset = 0;          // where the range starts in the flat buffer (elements)
  std::int64_t elements = 0;        // its length: the sum of the parameters' sizes
};

/// Groups `params` into buckets of at most `bucket_bytes` bytes (float32), walking them
/// from the last to the first — the order backward finishes their gradients, as DDP
/// buckets them. A gradient is never split: one larger than a bucket gets a bucket of its
/// own. Parameters next to each other in the walk are next to each other in the flat
/// buffer, so each bucket is one range [offset, offset + elements).
std::vector<Bucket> plan_buckets(std::span<Parameter* const> params, std::int64_t bucket_bytes);

/// Starts one bucket's weighted average: scales the bucket's range of `flat_grads` by
/// local_batch / global_batch and starts a non-blocking allreduce (sum) of that range, in
/// place. The gradients are averaged once the returned request is waited for.
[[nodiscard]] Request start_bucket_allreduce(Communicator& comm, Tensor& flat_grads,
                                             const Bucket& bucket, std::int64_t local_batch,
                                             std::int64_t global_batch);

}  // namespace ch02
