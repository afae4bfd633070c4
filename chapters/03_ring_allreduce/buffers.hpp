// Chapter 03's program: its buffers, and the values it checks every algorithm with
// (main.cpp).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "ring_allreduce.hpp"
#include "shardlab/tensor.hpp"

namespace ch03 {

// The reference: rank q holds (q + 1)(i mod 13 + 1) at element i. Small integers, so
// every summation order gives the exact sum, N(N+1)/2 (i mod 13 + 1), on every rank.

/// Rank `rank`'s values: (rank + 1)(i mod 13 + 1) at element i.
inline void fill(std::span<float> data, int rank) {
  for (std::size_t i = 0; i < data.size(); ++i)
    data[i] = static_cast<float>((rank + 1) * static_cast<int>(i % 13 + 1));
}
/// The exact sum at element i over `ranks` ranks: N(N+1)/2 (i mod 13 + 1).
inline float expected(std::size_t i, int ranks) {
  return static_cast<float>(ranks * (ranks + 1) / 2 * static_cast<int>(i % 13 + 1));
}

/// One rank's buffers: host memory, or under --device cuda this rank's GPU (there only
/// the native allreduce and memcpy run: the from-scratch algorithms add on the host).
struct Buffers {
  shardlab::Memory memory;     ///< Where data and copy live.
  std::size_t segment;         ///< The pipelined ring's segment, in floats.
  HostGroups* groups;          ///< The hierarchical allreduce's (or nullptr).
  shardlab::Tensor data = {};  ///< The buffer the algorithms allreduce.
  shardlab::Tensor copy = {};  ///< Where memcpy writes.
  Workspace scratch = {};      ///< The algorithms' scratch.

  /// Buffers of `count` floats (kept where they already are).
  void resize(std::int64_t count) {
    if (data.size() == count && data.memory() == memory) return;
    data = shardlab::empty(shardlab::Shape{count}, shardlab::DType::f32, memory);
    copy = shardlab::empty(shardlab::Shape{count}, shardlab::DType::f32, memory);
  }
  /// Runs `name` (an algorithm, or "memcpy": data copied to copy) once on data as it is.
  void run(const std::string& name, Communicator& comm) {
    if (name == "memcpy")
      copy.copy_from(data);
    else
      allreduce(name, comm, data, segment, scratch, groups);
  }
  /// Runs `name` once on fresh data; returns the number of wrong elements on this rank.
  std::int64_t wrong_after_run(const std::string& name, Communicator& comm) {
    // On the host, data itself.
    shardlab::Tensor host = memory == shardlab::Memory::host ? data : shardlab::Tensor(data.size());
    fill(host.span(), comm.rank());
    data.copy_from(host);  // nothing to copy on the host
    run(name, comm);
    host.copy_from(data);
    std::int64_t wrong = 0;
    for (std::int64_t i = 0; i < host.size(); ++i)
      wrong += host[i] != expected(static_cast<std::size_t>(i), comm.size());
    return wrong;
  }
};

}  // namespace ch03
