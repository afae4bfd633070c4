// Chapter 03 API: allreduce (sum) from scratch, on the communicator's point-to-point
// calls only.
//
// Names: N = comm.size() ranks, r = comm.rank(), S = data.size() elements. The ring
// algorithms cut the buffer into N chunks, chunk c = shard_range(S, N, c) (uneven when
// N does not divide S; empty chunks when S < N). Neighbours: right = (r + 1) % N,
// left = (r - 1 + N) % N.
//
// Bytes each rank sends (and receives), f = sizeof(float):
//   naive               rank 0: (N-1) S f; the others: S f
//   ring                (2S - |c_{r+1}| - |c_{r+2}|) f = 2(N-1)/N S f when N divides S
//   recursive doubling  log2(N) S f (N a power of two; see the README otherwise)
//
// The learner writes ring_reduce_scatter and ring_allgather in
// exercises/03_ring_allreduce/ring.cpp; the reference is solutions/03_ring_allreduce/.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/tensor.hpp"

namespace ch03 {

using shardlab::Communicator;

/// a mod n in 0..n-1, also for negative a: the ring index of rank or chunk a.
inline int wrap(int a, int n) { return ((a % n) + n) % n; }

/// Chunk c (0 <= c < ranks) of `data`: shard_range(S, ranks, c), uneven chunks included.
inline std::span<float> chunk(std::span<float> data, int ranks, int c) {
  const shardlab::ShardRange range =
      shardlab::shard_range(static_cast<std::int64_t>(data.size()), ranks, c);
  return data.subspan(static_cast<std::size_t>(range.offset),
                      static_cast<std::size_t>(range.length));
}

/// The chunk rank r holds fully reduced after ring_reduce_scatter: (r + 1) % N.
int owned_chunk(int rank, int ranks);

/// Scratch memory an algorithm reuses from call to call, owned by the caller. (A fresh
/// buffer per call would be zero-filled — and, past 32 MiB, page-faulted in — every time:
/// a whole extra pass over memory that the benchmark would count against the algorithm.)
class Workspace {
 public:
  /// n floats of scratch; their contents are whatever was there.
  std::span<float> get(std::size_t n) {
    if (buffer_.size() < n) buffer_.resize(n);
    return {buffer_.data(), n};
  }

 private:
  std::vector<float> buffer_;
};

// [exercise]
/// Ring reduce-scatter, N-1 steps. At step s = 0..N-2, rank r sends chunk (r - s) mod N
/// to the right and receives chunk (r - s - 1) mod N from the left, adding it into its
/// own copy (the incoming chunk lands in `scratch` first). Afterwards chunk
/// owned_chunk(r, N) of `data` holds the sum over all ranks; the other chunks hold
/// partial sums.
void ring_reduce_scatter(Communicator& comm, std::span<float> data, Workspace& scratch);

/// Ring all-gather, N-1 steps, after ring_reduce_scatter. At step s, rank r sends chunk
/// (r + 1 - s) mod N to the right and receives chunk (r - s) mod N from the left into
/// `data`. Afterwards every chunk holds the sum on every rank.
void ring_allgather(Communicator& comm, std::span<float> data);
// [exercise]

// [ring_allreduce]
/// The ring allreduce (sum, in place, blocking): ring_reduce_scatter, then ring_allgather.
///   ring_allreduce(comm, data, scratch)   a span, with scratch the caller keeps
///   ring_allreduce(comm, tensor)          a float32 host tensor (a view too: a bucket of
///                                         a flat gradient buffer), scratch kept per thread
/// The second is chapter 02's AllreduceFn, std::function<void(Communicator&, Tensor&)>:
///   ch02::GradSyncConfig{.mode = ch02::Sync::bucketed, .allreduce = ch03::ring_allreduce}
/// It is an object rather than two overloaded functions because a std::function cannot
/// choose between overloads; called, it reads as one.
struct RingAllreduce {
  /// Allreduces `data` in place, with `scratch` (one chunk) the caller keeps between calls.
  void operator()(Communicator& comm, std::span<float> data, Workspace& scratch) const;
  /// Allreduces a float32 host tensor in place, with scratch kept per thread; throws
  /// shardlab::Error for another dtype or device memory.
  void operator()(Communicator& comm, shardlab::Tensor& data) const;
};
/// The ring allreduce, callable as a function (see RingAllreduce).
inline constexpr RingAllreduce ring_allreduce{};
// [ring_allreduce]

/// The same ring with every chunk cut into segments of `segment` elements and
/// non-blocking sends and receives, so that adding one segment overlaps the transfer
/// of the next, and a reduced segment moves on before its chunk is finished.
void pipelined_ring_allreduce(Communicator& comm, std::span<float> data, std::size_t segment,
                              Workspace& scratch);

/// Each segment of the pipelined ring is a message: tiny segments on large chunks mean
/// millions of messages per allreduce, minutes of per-message overhead that teach nothing.
/// "" when segments of `segment_kb` KiB cut the chunks of a buffer of `bytes` over `ranks`
/// into at most 16384 segments each; else what is wrong, and the segment that would do.
std::string too_many_segments(double bytes, int ranks, double segment_kb);

/// Naive: every rank sends its buffer to rank 0, which adds them in rank order and
/// sends the sum back to each. Rank 0 is the bottleneck.
void naive_allreduce(Communicator& comm, std::span<float> data, Workspace& scratch);

/// Recursive doubling: log2(N) rounds; in round k, rank r exchanges its whole buffer
/// with rank r XOR 2^k and adds. When N is not a power of two, the first 2(N - P2)
/// ranks (P2 the largest power of two <= N) pair up first: each even one hands its
/// buffer to the odd one above it and gets the result back at the end.
void recursive_doubling_allreduce(Communicator& comm, std::span<float> data, Workspace& scratch);

// ---------------------------------------------------------------------------
// The algorithms by name, as the chapter program and its benchmark compare them

/// "naive", "ring", "pipelined", "recursive_doubling", and "native": the communicator's
/// own allreduce, the peer every from-scratch algorithm is measured against.
inline constexpr std::string_view algorithms[] = {"naive", "ring", "pipelined",
                                                  "recursive_doubling", "native"};

/// Runs algorithm `name` (one of `algorithms`) on `data`; the pipelined ring cuts its
/// chunks into segments of `segment` elements. The from-scratch algorithms add float32 on
/// the host; "native" takes any tensor the communicator does (device memory too).
void allreduce(std::string_view name, Communicator& comm, shardlab::Tensor& data,
               std::size_t segment, Workspace& scratch);

/// Bytes `rank` sends in each algorithm, from the formulas above; for "native", what the
/// communicator's allreduce sends (shardlab::collective_traffic).
std::size_t formula_bytes_sent(std::string_view algorithm, std::size_t count, int rank, int ranks);

}  // namespace ch03
