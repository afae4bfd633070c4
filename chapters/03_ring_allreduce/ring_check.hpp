// Chapter 03 test helpers: data that tell, element by element, which ranks'
// contributions and which chunk's data ended up where, so a failing ring names the
// rank, the step and the chunk that went wrong.
//
// Rank q puts 2^q + 1024 * c into every element of chunk c. A sum over a set of ranks Q
// then reads back as mask = sum of 2^q (which ranks arrived) and c (which chunk it was):
//   value = mask + |Q| * 1024 * c,   mask < 1024 for N <= 8.
#pragma once

#include <bit>
#include <span>
#include <string>
#include <vector>

#include "ring_allreduce.hpp"
#include "shardlab/comm.hpp"
#include "shardlab/tensor.hpp"

namespace ch03::check {

using ch03::wrap;

inline int chunk_of(std::size_t i, std::size_t count, int ranks) {
  for (int c = 0; c < ranks; ++c) {
    const auto r = shardlab::shard_range(static_cast<std::int64_t>(count), ranks, c);
    if (static_cast<std::int64_t>(i) < r.offset + r.length) return c;
  }
  return ranks - 1;
}

inline std::vector<float> tagged_input(std::size_t count, int rank, int ranks) {
  std::vector<float> v(count);
  for (std::size_t i = 0; i < count; ++i)
    v[i] = static_cast<float>((1 << rank) + 1024 * chunk_of(i, count, ranks));
  return v;
}

struct Decoded {
  unsigned mask = 0;  // which ranks' contributions the value holds
  int chunk = -1;     // which chunk the data came from
};
inline Decoded decode(float value) {
  const auto v = static_cast<long>(value);
  Decoded d;
  d.mask = static_cast<unsigned>(v % 1024);
  const int n = std::popcount(d.mask);
  d.chunk = n ? static_cast<int>((v - d.mask) / (1024L * n)) : -1;
  return d;
}

/// Which chunk of `data` a traced buffer is, or -1 when it points elsewhere (scratch).
inline int chunk_at(const void* buffer, std::span<const float> data, int ranks) {
  const auto* p = static_cast<const float*>(buffer);
  if (data.empty() || p < data.data() || p >= data.data() + data.size()) return -1;
  return chunk_of(static_cast<std::size_t>(p - data.data()), data.size(), ranks);
}

/// Records the sends and receives of one rank, step by step (the k-th send is step k).
struct StepLog {
  std::vector<shardlab::MessageEvent> sends, recvs;
  void attach(shardlab::Communicator& comm) {
    comm.trace_messages([this](const shardlab::MessageEvent& e) {
      (e.op == shardlab::Op::send ? sends : recvs).push_back(e);
    });
  }
};

/// "" if step s of the log sent chunk first_send(s) (and received into chunk
/// first_recv(s) where the receive lands in `data`), else which rank, step and chunk.
template <class SendChunk, class RecvChunk>
std::string steps_error(const StepLog& log, std::span<const float> data, int rank, int ranks,
                        const char* phase, SendChunk want_send, RecvChunk want_recv,
                        const char* rule) {
  if (ranks == 1) return "";
  if (log.sends.size() != static_cast<std::size_t>(ranks - 1))
    return "rank " + std::to_string(rank) + ", " + phase + ": " + std::to_string(log.sends.size()) +
           " sends, but the ring takes N - 1 = " + std::to_string(ranks - 1) + " steps";
  // A transfer moved chunk c when it starts at chunk c's offset and is chunk c long
  // (this also holds for the empty chunks of a buffer shorter than N).
  auto is_chunk = [&](const shardlab::MessageEvent& e, int c) {
    const auto range = shardlab::shard_range(static_cast<std::int64_t>(data.size()), ranks, c);
    return static_cast<const float*>(e.buffer) == data.data() + range.offset &&
           e.bytes == static_cast<std::size_t>(range.length) * sizeof(float);
  };
  for (int s = 0; s < ranks - 1; ++s) {
    const auto& send = log.sends[static_cast<std::size_t>(s)];
    const int sent = chunk_at(send.buffer, data, ranks);
    const std::string where =
        "rank " + std::to_string(rank) + ", " + phase + " step " + std::to_string(s) + ": ";
    if (send.peer != wrap(rank + 1, ranks))
      return where + "sent to rank " + std::to_string(send.peer) +
             ", but the ring sends to the right neighbour " + std::to_string(wrap(rank + 1, ranks));
    if (!is_chunk(send, want_send(s)))
      return where + "sent " +
             (sent >= 0 ? "chunk " + std::to_string(sent)
                        : "a buffer that is not a chunk of the data") +
             ", but this step sends chunk " + std::to_string(want_send(s)) + " (" + rule + ")";
    if (s < static_cast<int>(log.recvs.size())) {
      const auto& recv = log.recvs[static_cast<std::size_t>(s)];
      const int got = chunk_at(recv.buffer, data, ranks);
      // A receive into scratch (outside the data) cannot be placed; one into the data must
      // land on the right chunk.
      if (got >= 0 && !is_chunk(recv, want_recv(s)))
        return where + "received into chunk " + std::to_string(got) +
               ", but this step receives chunk " + std::to_string(want_recv(s)) + " (" + rule + ")";
    }
  }
  return "";
}

inline std::string reduce_scatter_steps_error(const StepLog& log, std::span<const float> data,
                                              int rank, int ranks) {
  return steps_error(
      log, data, rank, ranks, "reduce-scatter", [&](int s) { return wrap(rank - s, ranks); },
      [&](int s) { return wrap(rank - s - 1, ranks); },
      "step s sends chunk (r - s) mod N and receives chunk (r - s - 1) mod N");
}

inline std::string allgather_steps_error(const StepLog& log, std::span<const float> data, int rank,
                                         int ranks) {
  return steps_error(
      log, data, rank, ranks, "all-gather", [&](int s) { return wrap(rank + 1 - s, ranks); },
      [&](int s) { return wrap(rank - s, ranks); },
      "step s sends chunk (r + 1 - s) mod N and receives chunk (r - s) mod N");
}

inline std::string ranks_in(unsigned mask) {
  std::string s;
  for (int q = 0; q < 32; ++q)
    if (mask & (1u << q)) s += (s.empty() ? "" : ", ") + std::to_string(q);
  return "{" + s + "}";
}

/// "" if rank r's owned chunk holds the full sum of its own chunk, else what went wrong:
/// the rank, the chunk, and the step whose contribution is missing.
inline std::string reduce_scatter_error(std::span<const float> data, int rank, int ranks) {
  const int owned = owned_chunk(rank, ranks);
  const auto range = shardlab::shard_range(static_cast<std::int64_t>(data.size()), ranks, owned);
  const unsigned all = (1u << ranks) - 1;
  for (auto i = static_cast<std::size_t>(range.offset);
       i < static_cast<std::size_t>(range.offset + range.length); ++i) {
    const Decoded d = decode(data[i]);
    std::string where = "rank " + std::to_string(rank) + ", after reduce-scatter, chunk " +
                        std::to_string(owned) + " (element " + std::to_string(i) + ")";
    if (d.mask == all && d.chunk == owned) continue;
    if (d.chunk != owned)
      return where + " holds data of chunk " + std::to_string(d.chunk) +
             ": a chunk index is wrong (send chunk (r - s) mod N, add into chunk (r - s - 1) mod "
             "N)";
    // Contributions join chunk c in ring order: rank c starts it, rank c + j adds its own
    // at step j - 1. The first one missing names the step that went wrong.
    for (int j = 1; j < ranks; ++j) {
      const int q = wrap(owned + j, ranks);
      if (!(d.mask & (1u << q)))
        return where + " holds the sum over ranks " + ranks_in(d.mask) + " only: rank " +
               std::to_string(q) + "'s contribution should have joined at step " +
               std::to_string(j - 1) + ", when rank " + std::to_string(q) + " adds into chunk " +
               std::to_string(owned) + " and passes it on";
    }
    return where + " holds ranks " + ranks_in(d.mask) +
           ": a contribution arrived twice or from the wrong step";
  }
  return "";
}

/// "" if every chunk holds the full sum after all-gather, else the rank, the chunk, and
/// the step at which that chunk should have arrived.
inline std::string allgather_error(std::span<const float> data, int rank, int ranks) {
  const unsigned all = (1u << ranks) - 1;
  for (std::size_t i = 0; i < data.size(); ++i) {
    const int c = chunk_of(i, data.size(), ranks);
    const Decoded d = decode(data[i]);
    if (d.mask == all && d.chunk == c) continue;
    return "rank " + std::to_string(rank) + ", after all-gather, chunk " + std::to_string(c) +
           " (element " + std::to_string(i) + ") holds ranks " + ranks_in(d.mask) + " of chunk " +
           std::to_string(d.chunk) + "; it should have arrived complete from the left at step " +
           std::to_string(wrap(rank - c, ranks)) +
           " (receive chunk (r - s) mod N, send chunk (r + 1 - s) mod N)";
  }
  return "";
}

}  // namespace ch03::check
