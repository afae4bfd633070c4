// Chapter 03 test helpers: data that tell, element by element, which ranks'
// contributions and which chunk's data ended up where, so a failing ring names the
// rank, the step and the chunk that went wrong.
//
// Rank q puts 2^q + 1024 * c into every element of chunk c. A sum over a set of ranks Q
// then reads back as mask = sum of 2^q (which ranks arrived) and c (which chunk it was):
//   value = mask + |Q| * 1024 * c,   mask < 1024 for N <= 8.
// A message is identified by what it carries, not by where it was sent from: a ring that
// sends from a copy of its chunk is as right as one that sends the chunk itself.
#pragma once

#include <bit>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "ring_allreduce.hpp"
#include "shardlab/comm.hpp"
#include "shardlab/tensor.hpp"

namespace ch03::check {

using ch03::wrap;

/// Chunk c of a buffer of `count` elements over `ranks`: shard_range(count, ranks, c).
inline shardlab::ShardRange chunk_range(std::size_t count, int ranks, int c) {
  return shardlab::shard_range(static_cast<std::int64_t>(count), ranks, c);
}

/// The chunk that element i of a buffer of `count` elements over `ranks` falls in.
inline int chunk_of(std::size_t i, std::size_t count, int ranks) {
  for (int c = 0; c < ranks; ++c) {
    const auto r = chunk_range(count, ranks, c);
    if (static_cast<std::int64_t>(i) < r.offset + r.length) return c;
  }
  return ranks - 1;
}

/// Rank `rank`'s test input: 2^rank + 1024 * c in every element of chunk c (see the top).
inline std::vector<float> tagged_input(std::size_t count, int rank, int ranks) {
  std::vector<float> v(count);
  for (std::size_t i = 0; i < count; ++i)
    v[i] = static_cast<float>((1 << rank) + 1024 * chunk_of(i, count, ranks));
  return v;
}

/// A tagged value read back: the ranks summed into it and the chunk it belongs to.
struct Decoded {
  unsigned mask = 0;  ///< which ranks' contributions the value holds: bit q for rank q
  int chunk = -1;     ///< which chunk the data came from; -1 when mask is 0
};
/// Reads a tagged value (a sum of tagged_input values) back into its ranks and chunk.
inline Decoded decode(float value) {
  const auto v = static_cast<long>(value);
  Decoded d;
  d.mask = static_cast<unsigned>(v % 1024);
  const int n = std::popcount(d.mask);
  d.chunk = n ? static_cast<int>((v - d.mask) / (1024L * n)) : -1;
  return d;
}

/// Whether `value` is none of the tagged values any chunk can hold: an element never
/// filled in (the tests start such elements at -1), or garbage.
inline bool holds_no_chunk(float value, int ranks) {
  const Decoded d = decode(value);
  return value < 0 || d.chunk < 0 || d.chunk >= ranks || d.mask >= (1u << ranks);
}

/// "3 3 2 2": the chunk lengths of `count` elements over `ranks`.
inline std::string chunk_lengths(std::size_t count, int ranks) {
  std::string s;
  for (int c = 0; c < ranks; ++c)
    s += (c ? " " : "") + std::to_string(chunk_range(count, ranks, c).length);
  return s;
}

/// One message as a rank posted it, with what a send carried at that moment.
struct Posted {
  int peer = 0;                   ///< the rank sent to, or received from
  int tag = 0;                    ///< the message's tag
  const float* buffer = nullptr;  ///< where in the rank's memory the message starts
  std::size_t elements = 0;       ///< the message's length, in floats
  std::vector<float> contents;    ///< what a send carried when posted; empty for receives
};

/// Records the sends and receives of one rank, step by step (the k-th send is step k).
struct StepLog {
  std::vector<Posted> sends;  ///< the rank's sends, in the order posted
  std::vector<Posted> recvs;  ///< the rank's receives, in the order posted
  /// Starts logging every message `comm` posts (replacing any trace hook it had).
  void attach(shardlab::Communicator& comm) {
    comm.trace_messages([this](const shardlab::MessageEvent& e) {
      Posted p{e.peer, e.tag, static_cast<const float*>(e.buffer), e.bytes / sizeof(float), {}};
      if (e.op == shardlab::Op::send) {
        p.contents.assign(p.buffer, p.buffer + p.elements);
        sends.push_back(std::move(p));
      } else {
        recvs.push_back(std::move(p));
      }
    });
  }
};

/// "" when message `m` is chunk `want` of `count` elements over `ranks` (its elements all
/// hold chunk `want`'s data, and there are as many as the chunk has), else what it is.
inline std::string not_chunk(const Posted& m, int want, std::size_t count, int ranks) {
  const auto range = chunk_range(count, ranks, want);
  std::set<int> chunks;
  for (float v : m.contents) {
    const Decoded d = decode(v);
    if (holds_no_chunk(v, ranks))
      return "sent " + std::to_string(m.elements) +
             " elements that hold no chunk's data (never filled in on this rank yet), but this "
             "step sends chunk " +
             std::to_string(want) + ", which this rank must have received or reduced by now";
    chunks.insert(d.chunk);
  }
  const std::string sizes = " (chunk c is shard_range(S, N, c): for S = " + std::to_string(count) +
                            " and N = " + std::to_string(ranks) + " the chunks have " +
                            chunk_lengths(count, ranks) +
                            " elements, the first S % N one more than the rest)";
  if (chunks.size() > 1) {
    std::string list;
    for (int c : chunks) list += (list.empty() ? "" : " and ") + std::to_string(c);
    return "sent " + std::to_string(m.elements) + " elements holding data of chunks " + list +
           ": the chunk boundaries are off" + sizes;
  }
  if (chunks.size() == 1 && *chunks.begin() != want) {
    const int got = *chunks.begin();
    const auto got_range = chunk_range(count, ranks, got);
    if (m.elements == static_cast<std::size_t>(got_range.length))
      return "sent chunk " + std::to_string(got) + ", but this step sends chunk " +
             std::to_string(want);
    return "sent " + std::to_string(m.elements) + " elements of chunk " + std::to_string(got) +
           " (which has " + std::to_string(got_range.length) + "), but this step sends chunk " +
           std::to_string(want) + ": the chunk boundaries are off" + sizes;
  }
  if (m.elements != static_cast<std::size_t>(range.length))
    return "sent " + std::to_string(m.elements) + " elements of chunk " + std::to_string(want) +
           ", but chunk " + std::to_string(want) + " has " + std::to_string(range.length) + sizes;
  return "";
}

/// "" if every step in the log sent chunk want_send(s) to the right (and received into
/// chunk want_recv(s) where the receive lands in `data`), else which rank, step and chunk.
/// The log may end early (a ring that failed part way): the steps it has are checked.
template <class SendChunk, class RecvChunk>
std::string steps_error(const StepLog& log, std::span<const float> data, int rank, int ranks,
                        const char* phase, SendChunk want_send, RecvChunk want_recv,
                        const char* rule, bool complete = true) {
  if (ranks == 1) return "";
  if (complete && log.sends.size() != static_cast<std::size_t>(ranks - 1))
    return "rank " + std::to_string(rank) + ", " + phase + ": " + std::to_string(log.sends.size()) +
           " sends, but the ring takes N - 1 = " + std::to_string(ranks - 1) + " steps";
  const std::size_t steps = std::min(log.sends.size(), static_cast<std::size_t>(ranks - 1));
  for (std::size_t k = 0; k < steps; ++k) {
    const int s = static_cast<int>(k);
    const Posted& send = log.sends[k];
    const std::string where =
        "rank " + std::to_string(rank) + ", " + phase + " step " + std::to_string(s) + ": ";
    if (send.peer != wrap(rank + 1, ranks))
      return where + "sent to rank " + std::to_string(send.peer) +
             ", but the ring sends to the right neighbour " + std::to_string(wrap(rank + 1, ranks));
    const std::string wrong = not_chunk(send, want_send(s), data.size(), ranks);
    if (!wrong.empty()) return where + wrong + " (" + rule + ")";
    if (k < log.recvs.size()) {
      // A receive into scratch (outside the data) cannot be placed; one into the data must
      // land exactly on the chunk this step receives.
      const Posted& recv = log.recvs[k];
      const auto range = chunk_range(data.size(), ranks, want_recv(s));
      const bool in_data =
          !data.empty() && recv.buffer >= data.data() && recv.buffer < data.data() + data.size();
      if (in_data && (recv.buffer != data.data() + range.offset ||
                      recv.elements != static_cast<std::size_t>(range.length))) {
        const auto at = static_cast<std::size_t>(recv.buffer - data.data());
        return where + "received into elements " + std::to_string(at) + ".." +
               std::to_string(at + recv.elements) + ", but this step receives chunk " +
               std::to_string(want_recv(s)) + ", elements " + std::to_string(range.offset) + ".." +
               std::to_string(range.offset + range.length) + " (" + rule + ")";
      }
    }
  }
  return "";
}

/// The reduce-scatter's step rule, in words, for error messages.
inline constexpr const char* reduce_scatter_rule =
    "step s sends chunk (r - s) mod N and receives chunk (r - s - 1) mod N";
/// The all-gather's step rule, in words, for error messages.
inline constexpr const char* allgather_rule =
    "step s sends chunk (r + 1 - s) mod N and receives chunk (r - s) mod N";

/// steps_error for ring_reduce_scatter: step s sends chunk (r - s) mod N and receives
/// chunk (r - s - 1) mod N.
inline std::string reduce_scatter_steps_error(const StepLog& log, std::span<const float> data,
                                              int rank, int ranks, bool complete = true) {
  return steps_error(
      log, data, rank, ranks, "reduce-scatter", [&](int s) { return wrap(rank - s, ranks); },
      [&](int s) { return wrap(rank - s - 1, ranks); }, reduce_scatter_rule, complete);
}

/// steps_error for ring_allgather: step s sends chunk (r + 1 - s) mod N and receives chunk
/// (r - s) mod N.
inline std::string allgather_steps_error(const StepLog& log, std::span<const float> data, int rank,
                                         int ranks, bool complete = true) {
  return steps_error(
      log, data, rank, ranks, "all-gather", [&](int s) { return wrap(rank + 1 - s, ranks); },
      [&](int s) { return wrap(rank - s, ranks); }, allgather_rule, complete);
}

/// Runs `phase` (a reduce-scatter or an all-gather of the learner's) with its messages
/// logged. When a message fails part way (one side sent a chunk of another size than the
/// other expected), the error is said in the ring's terms: the first step whose send was
/// not the chunk it should be — on this rank, or the rank it was receiving from.
template <class Phase, class StepsError>
void run_logged(shardlab::Communicator& comm, std::span<float> data, StepLog& log, Phase&& phase,
                StepsError&& steps_error_of) {
  struct Detach {  // the log stops listening however the phase ends
    shardlab::Communicator& comm;
    ~Detach() { comm.trace_messages({}); }
  } detach{comm};
  log.attach(comm);
  try {
    phase();
  } catch (const shardlab::CommAborted&) {
    throw;
  } catch (const shardlab::CommError& e) {
    const std::string mine = steps_error_of(log, data, false);
    const std::string seen = std::string(" (what the communicator saw: ") + e.what() + ")";
    if (!mine.empty()) throw shardlab::CommError(mine + seen);
    if (std::string(e.what()).find("posted a recv of") == std::string::npos) throw;
    const std::string step = std::to_string(log.recvs.empty() ? 0 : log.recvs.size() - 1);
    throw shardlab::CommError("rank " + std::to_string(comm.rank()) + ", step " + step +
                              ": this rank's sends were right, but the message it received is "
                              "not the size of the chunk it expected: the left neighbour's step " +
                              step + " sent another chunk" + seen);
  }
}

/// "{0, 2, 3}": the ranks whose bits are set in `mask`.
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
  const auto range = chunk_range(data.size(), ranks, owned);
  const unsigned all = (1u << ranks) - 1;
  for (auto i = static_cast<std::size_t>(range.offset);
       i < static_cast<std::size_t>(range.offset + range.length); ++i) {
    const Decoded d = decode(data[i]);
    std::string where = "rank " + std::to_string(rank) + ", after reduce-scatter, chunk " +
                        std::to_string(owned) + " (element " + std::to_string(i) + ")";
    if (d.mask == all && d.chunk == owned) continue;
    if (holds_no_chunk(data[i], ranks))
      return where + " holds no chunk's data: nothing was ever added into it";
    if (d.chunk != owned)
      return where + " holds data of chunk " + std::to_string(d.chunk) +
             ": a chunk index is wrong (send chunk (r - s) mod N, add into chunk (r - s - 1) mod "
             "N)";
    // Contributions join chunk c in ring order: rank c starts it at step 0, and rank c + j
    // adds its own at step j - 1. The pattern of what is there says where it went wrong.
    std::vector<bool> present(static_cast<std::size_t>(ranks));
    for (int j = 0; j < ranks; ++j)
      present[static_cast<std::size_t>(j)] = d.mask & (1u << wrap(owned + j, ranks));
    int first = 0;
    while (first < ranks && !present[static_cast<std::size_t>(first)]) ++first;
    bool suffix = first > 0;  // everything from `first` on is there, nothing before it
    for (int j = first; j < ranks; ++j) suffix = suffix && present[static_cast<std::size_t>(j)];
    if (suffix)
      return where + " holds the sum over ranks " + ranks_in(d.mask) + " only: the sum of ranks " +
             ranks_in(d.mask ^ ((1u << ranks) - 1)) + " was lost at step " +
             std::to_string(first - 1) + ", when rank " +
             std::to_string(wrap(owned + first, ranks)) +
             " should have added what arrived from the left into its own copy and passed that on";
    for (int j = first + 1; j < ranks; ++j)
      if (!present[static_cast<std::size_t>(j)]) {
        const int q = wrap(owned + j, ranks);
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
    const std::string holds =
        holds_no_chunk(data[i], ranks)
            ? "holds no chunk's data (nothing arrived there)"
            : "holds ranks " + ranks_in(d.mask) + " of chunk " + std::to_string(d.chunk);
    return "rank " + std::to_string(rank) + ", after all-gather, chunk " + std::to_string(c) +
           " (element " + std::to_string(i) + ") " + holds +
           "; it should have arrived complete from the left at step " +
           std::to_string(wrap(rank - c, ranks)) + " (" + allgather_rule + ")";
  }
  return "";
}

}  // namespace ch03::check
