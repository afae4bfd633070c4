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
#include <memory>
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
// Hosts. A cluster's ranks sit on several hosts, joined by links much slower than the
// memory inside one (scripts/cluster.sh makes two hosts on one machine). Which bytes cross
// between hosts depends on where each rank sits: its placement.

/// Where the ranks sit: host[r] is rank r's host, numbered 0, 1, ... in order of first
/// appearance.
struct Placement {
  std::vector<int> host;  ///< Rank r's host.
  /// The number of ranks.
  int ranks() const { return static_cast<int>(host.size()); }
  /// The number of hosts.
  int hosts() const;
  /// The ranks on host h, in rank order.
  std::vector<int> ranks_on(int h) const;
  /// "" when every host holds the same number of ranks (as the hierarchical allreduce
  /// needs); else what is wrong.
  std::string uneven() const;
};
/// The placement of ranks on the hosts named (shardlab::host_names): one host per name.
Placement placement_of(const std::vector<std::string>& host_names);
/// `ranks` ranks, `per_host` to a host in rank order (ranks 0..per_host-1 on host 0, ...):
/// the hosts of a cluster, simulated on one machine. `per_host` must divide `ranks`.
Placement blocks(int ranks, int per_host);

/// The groups the hierarchical allreduce runs in: `local`, the ranks on this rank's host
/// (in rank order), and `across`, this rank and the ranks with the same local number on the
/// other hosts (in host order).
struct HostGroups {
  std::unique_ptr<Communicator> local;   ///< The ranks on this rank's host.
  std::unique_ptr<Communicator> across;  ///< This rank's counterparts on the other hosts.
  std::vector<int> local_ranks;          ///< local's members, as ranks of the whole.
  std::vector<int> across_ranks;         ///< across's members, as ranks of the whole.
};
/// Splits `comm` by `placement`; every rank calls it. Throws shardlab::UsageError when
/// the hosts do not hold the same number of ranks.
HostGroups group_by_host(Communicator& comm, const Placement& placement);

/// Hierarchical (what NCCL's trees and Megatron-LM's groups exploit): a ring reduce-scatter
/// inside each host, after which each local rank holds one chunk summed over its host; a
/// ring allreduce of that chunk across the hosts, among the ranks with the same local
/// number (the only bytes between hosts); a ring all-gather inside each host. With n hosts
/// of g ranks each rank sends 2(g-1)/g S inside its host and 2(n-1)/n S/g to other hosts:
/// 2(n-1) S between hosts in all, where the flat ring over n hosts sends 2n (N-1)/N S.
void hierarchical_allreduce(HostGroups& groups, std::span<float> data, Workspace& scratch);

// ---------------------------------------------------------------------------
// The algorithms by name, as the chapter program and its benchmark compare them

/// "naive", "ring", "pipelined", "recursive_doubling", "hierarchical", and "native": the
/// communicator's own allreduce, the peer every from-scratch algorithm is measured against.
inline constexpr std::string_view algorithms[] = {
    "naive", "ring", "pipelined", "recursive_doubling", "hierarchical", "native"};

/// Runs algorithm `name` (one of `algorithms`) on `data`; the pipelined ring cuts its
/// chunks into segments of `segment` elements; the hierarchical one runs in `groups`
/// (required for it). The from-scratch algorithms add float32 on the host; "native" takes
/// any tensor the communicator does (device memory too).
void allreduce(std::string_view name, Communicator& comm, shardlab::Tensor& data,
               std::size_t segment, Workspace& scratch, HostGroups* groups = nullptr);

/// Bytes `rank` sends in each algorithm, from the formulas above, with every rank on one
/// host; for "native", what the communicator's allreduce sends (collective_traffic).
std::size_t formula_bytes_sent(std::string_view algorithm, std::size_t count, int rank, int ranks);

/// Bytes `rank` sends to each rank (the vector's index) in one allreduce of `count` floats
/// by `algorithm`, its ranks placed by `placement` (the hierarchical algorithm's peers
/// depend on it); their sum is what the rank sends. Empty for "native": a library's
/// algorithm, and so whom it sends to, is hidden.
std::vector<std::size_t> formula_bytes_to(std::string_view algorithm, std::size_t count, int rank,
                                          const Placement& placement);

/// Bytes that leave each host (the vector's index) for other hosts in one allreduce:
/// formula_bytes_to summed over the pairs of ranks on different hosts. Empty for "native".
std::vector<std::size_t> formula_link_bytes(std::string_view algorithm, std::size_t count,
                                            const Placement& placement);

}  // namespace ch03
