// Chapter 02, reference solution: gradient averaging, per tensor and in buckets.
#include "grad_sync.hpp"

#include <algorithm>

namespace ch02 {

namespace {
/// B_r / B: rank r's share of the global batch.
float batch_share(std::int64_t local_batch, std::int64_t global_batch) {
  return static_cast<float>(static_cast<double>(local_batch) / static_cast<double>(global_batch));
}
}  // namespace

void allreduce_gradients(Communicator& comm, std::span<Tensor* const> grads,
                         std::int64_t local_batch, std::int64_t global_batch) {
  const float share = batch_share(local_batch, global_batch);
  for (Tensor* g : grads) {
    for (float& v : *g) v *= share;  // my mean gradient, weighted by my share of the batch
    comm.allreduce(*g, shardlab::ReduceOp::sum);
  }
}

std::vector<Bucket> plan_buckets(std::span<Tensor* const> grads, std::int64_t bucket_bytes) {
  const std::int64_t capacity =
      std::max<std::int64_t>(1, bucket_bytes / std::int64_t{sizeof(float)});
  std::vector<Bucket> buckets;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const std::int64_t n = grads[i]->size();
    // Start a new bucket unless this gradient still fits into the open one.
    if (buckets.empty() || buckets.back().elements + n > capacity) buckets.emplace_back();
    buckets.back().tensors.push_back(i);
    buckets.back().elements += n;
  }
  return buckets;
}

void pack_bucket(const Bucket& bucket, std::span<Tensor* const> grads, Tensor& flat) {
  float* dst = flat.data();
  for (std::size_t i : bucket.tensors) dst = std::copy(grads[i]->begin(), grads[i]->end(), dst);
}

void unpack_bucket(const Bucket& bucket, const Tensor& flat, std::span<Tensor* const> grads) {
  const float* src = flat.data();
  for (std::size_t i : bucket.tensors) {
    std::copy(src, src + grads[i]->size(), grads[i]->begin());
    src += grads[i]->size();
  }
}

void allreduce_bucket(Communicator& comm, const Bucket& bucket, std::span<Tensor* const> grads,
                      std::int64_t local_batch, std::int64_t global_batch) {
  Tensor flat(bucket.elements);
  pack_bucket(bucket, grads, flat);
  const float share = batch_share(local_batch, global_batch);
  for (float& v : flat) v *= share;
  comm.allreduce(flat, shardlab::ReduceOp::sum);
  unpack_bucket(bucket, flat, grads);
}

}  // namespace ch02
