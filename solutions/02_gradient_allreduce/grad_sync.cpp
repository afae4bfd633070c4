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

void allreduce_gradients(Communicator& comm, std::span<Parameter* const> params,
                         std::int64_t local_batch, std::int64_t global_batch,
                         const AllreduceFn& allreduce) {
  const float share = batch_share(local_batch, global_batch);
  for (Parameter* p : params) {
    // My mean gradient, weighted by my share of the batch, summed over ranks.
    shardlab::scale_in_place(p->grad, share);
    allreduce(comm, p->grad);
  }
}

std::vector<Bucket> plan_buckets(std::span<Parameter* const> params, std::int64_t bucket_bytes) {
  const std::int64_t capacity =
      std::max<std::int64_t>(1, bucket_bytes / std::int64_t{sizeof(float)});
  std::vector<Bucket> buckets;
  for (std::size_t k = params.size(); k-- > 0;) {  // last parameter first
    const Parameter& p = *params[k];
    const std::int64_t n = p.grad.size();
    // Start a new bucket unless this gradient still fits into the open one.
    if (buckets.empty() || buckets.back().elements + n > capacity) {
      buckets.emplace_back();
      buckets.back().offset = p.offset + n;  // grows downwards as parameters join
    }
    Bucket& b = buckets.back();
    b.params.push_back(k);
    b.elements += n;
    b.offset -= n;  // p sits right before the parameters already in the bucket
  }
  return buckets;
}

Request start_bucket_allreduce(Communicator& comm, Tensor& flat_grads, const Bucket& bucket,
                               std::int64_t local_batch, std::int64_t global_batch) {
  Tensor range = flat_grads.slice(bucket.offset, bucket.elements);  // a view: no copy
  shardlab::scale_in_place(range, batch_share(local_batch, global_batch));
  return comm.iallreduce(range, shardlab::ReduceOp::sum);
}

}  // namespace ch02
