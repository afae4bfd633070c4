// Chapter 05's exercise API: ZeRO stage 1's sharded step over one flat parameter buffer.
// (Adam itself is the library's, nn::adam_update; ZeroOptimizer in zero.hpp runs this
// step for stage 1.)
//
// N = ranks, r = this rank, P = the number of parameters in the flat buffer, and
// shard_range(P, N, r) the range rank r owns (tensor.hpp: the first P % N ranks own one
// element more).
#pragma once

#include "shardlab/comm.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/tensor.hpp"

namespace ch05 {

using shardlab::Communicator;
using shardlab::Tensor;
using shardlab::nn::AdamConfig;

// [exercise]
/// What rank r keeps of ZeRO stage 1's optimizer for one flat parameter buffer: the state
/// of its own range only. All tensors are `range.length` long.
struct Shard {
  shardlab::ShardRange range;  ///< shard_range(P, N, r)
  /// The weights the optimizer updates, f32: in mixed precision the fp32 master copy of
  /// the range; in fp32 training a view of the range of the parameters themselves.
  Tensor master;
  Tensor m;      ///< Adam's first moment, f32
  Tensor v;      ///< Adam's second moment, f32
  Tensor grad;   ///< the gradients' type: where this rank's reduced gradient arrives
  Tensor send;   ///< the parameters' type: the updated range, sent by the all-gather
  int step = 0;  ///< Adam steps taken
};

/// Allocates rank r's Shard for a flat buffer of `params` (f32 or f16) and grads of type
/// `grad_type`: master (a copy of the range in f32, or a view when params are f32), m and
/// v (zeros), grad and send. Each in its memory-ledger category (memory.hpp).
Shard make_shard(Communicator& comm, Tensor& params, shardlab::DType grad_type);

/// One ZeRO-1 step (Rajbhandari et al. 2020, §5.1), on every rank:
///   params  the whole flat buffer (f32 or f16), identical on every rank; updated in place
///   grads   this rank's gradients of it (its own micro-batch), the same length
/// After it, every rank holds the same new params: Adam (nn::adam_update) applied to the
/// sum over ranks of the gradients. Rank r updates only its own range, and the ranks
/// exchange 2 (N-1)/N P elements each, as plain data parallelism does with its allreduce.
void zero1_step(Communicator& comm, Tensor& params, const Tensor& grads, Shard& shard,
                const AdamConfig& config);
// [exercise]

}  // namespace ch05
