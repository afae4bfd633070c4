// Chapter 03: the allreduce algorithms that are not the exercise — the ring put
// together, its pipelined form, the naive one, recursive doubling and the hierarchical
// one across hosts — and the formulas for what each sends, and to whom. All of them on the
// communicator's point-to-point calls only.
#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "ring_allreduce.hpp"
#include "shardlab/check.hpp"
#include "shardlab/format.hpp"
#include "shardlab/tensor.hpp"

namespace ch03 {

using shardlab::Request;
using shardlab::shard_range;

namespace {
void add(std::span<float> into, std::span<const float> x) {
  for (std::size_t i = 0; i < into.size(); ++i) into[i] += x[i];
}
}  // namespace

int owned_chunk(int rank, int ranks) { return wrap(rank + 1, ranks); }

void RingAllreduce::operator()(Communicator& comm, std::span<float> data,
                               Workspace& scratch) const {
  ring_reduce_scatter(comm, data, scratch);
  ring_allgather(comm, data);
}

void RingAllreduce::operator()(Communicator& comm, shardlab::Tensor& data) const {
  shardlab::require(data.dtype() == shardlab::DType::f32 && !data.on_device(), [&] {
    return "ch03::ring_allreduce: the ring adds float32 on the host, got a " +
           std::string(shardlab::dtype_name(data.dtype())) + " tensor in " +
           (data.on_device() ? "device" : "host") + " memory";
  });
  // Each rank (a thread, or a process) keeps its scratch between calls: one chunk.
  thread_local Workspace scratch;
  (*this)(comm, data.span(), scratch);
}

// ---------------------------------------------------------------------------
// Pipelined ring

void pipelined_ring_allreduce(Communicator& comm, std::span<float> data, std::size_t segment,
                              Workspace& scratch) {
  const int N = comm.size(), r = comm.rank();
  if (N == 1) return;
  if (segment == 0) throw shardlab::Error("pipelined ring: the segment must be at least 1 element");
  const int right = wrap(r + 1, N), left = wrap(r - 1, N);
  // A segment never needs to be longer than the longest chunk (chunk 0).
  segment = std::min(segment, std::max<std::size_t>(1, chunk(data, N, 0).size()));
  // Segment k of a chunk: [k * segment, min((k + 1) * segment, chunk size)).
  auto segments = [&](std::span<float> c) { return (c.size() + segment - 1) / segment; };
  auto piece = [&](std::span<float> c, std::size_t k) {
    return c.subspan(k * segment, std::min(segment, c.size() - k * segment));
  };
  // Incoming segments land in a few slots that are reused in turn, so the data being
  // added stays in cache instead of streaming a whole chunk through memory.
  constexpr std::size_t slots = 4;
  const std::span<float> landing = scratch.get(slots * segment);
  auto slot = [&](std::size_t k, std::size_t n) {
    return landing.subspan((k % slots) * segment, n);
  };

  std::vector<Request> sends, recvs;
  for (std::size_t k = 0; k < segments(chunk(data, N, r)); ++k)
    sends.push_back(comm.isend(piece(chunk(data, N, r), k), right, 0));

  // Reduce-scatter. Step s receives chunk (r - s - 1) segment by segment; each segment is
  // added as it lands and passed straight on (it is step s + 1's send).
  for (int s = 0; s < N - 1; ++s) {
    const std::span<float> mine = chunk(data, N, wrap(r - s - 1, N));
    const std::size_t count = segments(mine);
    recvs.clear();
    recvs.resize(count);
    for (std::size_t k = 0; k < std::min(count, slots); ++k)
      recvs[k] = comm.irecv(slot(k, piece(mine, k).size()), left, 0);
    for (std::size_t k = 0; k < count; ++k) {
      comm.wait(recvs[k]);
      const std::span<float> part = piece(mine, k);
      add(part, slot(k, part.size()));
      if (k + slots < count)
        recvs[k + slots] = comm.irecv(slot(k, piece(mine, k + slots).size()), left, 0);
      if (s < N - 2) sends.push_back(comm.isend(part, right, 0));
    }
  }
  // The chunks sent above are received into below: let those sends finish first.
  comm.wait_all(sends);
  sends.clear();

  // All-gather: chunks arrive complete, straight into place, and move on at once.
  const std::span<float> owned = chunk(data, N, owned_chunk(r, N));
  for (std::size_t k = 0; k < segments(owned); ++k)
    sends.push_back(comm.isend(piece(owned, k), right, 1));
  for (int s = 0; s < N - 1; ++s) {
    const std::span<float> in = chunk(data, N, wrap(r - s, N));
    recvs.clear();
    for (std::size_t k = 0; k < segments(in); ++k)
      recvs.push_back(comm.irecv(piece(in, k), left, 1));
    for (std::size_t k = 0; k < recvs.size(); ++k) {
      comm.wait(recvs[k]);
      if (s < N - 2) sends.push_back(comm.isend(piece(in, k), right, 1));
    }
  }
  comm.wait_all(sends);
  sends.clear();
}

std::string too_many_segments(double bytes, int ranks, double segment_kb) {
  constexpr double kMaxSegments = 16384;
  const double chunk = std::ceil(bytes / std::max(1, ranks));
  const double segment = std::max(4.0, std::floor(segment_kb * 1024 / 4) * 4);
  if (chunk / segment <= kMaxSegments) return "";
  return "--segment-kb " + shardlab::format_number(segment_kb) + " cuts a " +
         std::to_string(static_cast<long long>(std::ceil(chunk / 1024))) + " KiB chunk into " +
         std::to_string(static_cast<long long>(std::ceil(chunk / segment))) +
         " segments, each a message: use --segment-kb " +
         shardlab::format_number(std::ceil(chunk / kMaxSegments / 1024 * 1000) / 1000) +
         " or more for these sizes";
}

// ---------------------------------------------------------------------------
// Naive: everything to rank 0, and back.

void naive_allreduce(Communicator& comm, std::span<float> data, Workspace& scratch) {
  const int N = comm.size();
  if (comm.rank() != 0) {
    comm.send(data, 0, 0);
    comm.recv(data, 0, 1);
    return;
  }
  const std::span<float> in = scratch.get(data.size());
  for (int q = 1; q < N; ++q) {  // in rank order: the same sum as the threads backend's
    comm.recv(in, q, 0);
    add(data, in);
  }
  for (int q = 1; q < N; ++q) comm.send(data, q, 1);
}

// ---------------------------------------------------------------------------
// Recursive doubling

void recursive_doubling_allreduce(Communicator& comm, std::span<float> data, Workspace& scratch) {
  const int N = comm.size(), r = comm.rank();
  const int P2 = static_cast<int>(std::bit_floor(static_cast<unsigned>(N)));
  const int extra = N - P2;  // ranks 0..2*extra-1 pair up: even ones sit the rounds out
  const std::span<float> incoming = scratch.get(data.size());
  int vrank;  // rank among the P2 that take part in the rounds, or -1
  if (r < 2 * extra) {
    if (r % 2 == 0) {
      comm.send(data, r + 1, 0);
      vrank = -1;
    } else {
      comm.recv(incoming, r - 1, 0);
      add(data, incoming);
      vrank = r / 2;
    }
  } else {
    vrank = r - extra;
  }
  if (vrank >= 0) {
    // Round k: swap whole buffers with the partner 2^k away and add.
    for (int distance = 1; distance < P2; distance *= 2) {
      const int vpartner = vrank ^ distance;
      const int partner = vpartner < extra ? 2 * vpartner + 1 : vpartner + extra;
      comm.sendrecv(data, partner, incoming, partner, 1);
      // Add in the same order on both sides (lower rank's data first), so that the two
      // partners hold the same bits.
      if (partner < r) {
        for (std::size_t i = 0; i < data.size(); ++i) data[i] = incoming[i] + data[i];
      } else {
        add(data, incoming);
      }
    }
  }
  if (r < 2 * extra) {  // hand the result back to the even rank that sat out
    if (r % 2 == 0)
      comm.recv(data, r + 1, 2);
    else
      comm.send(data, r - 1, 2);
  }
}

// ---------------------------------------------------------------------------
// Hosts, and the hierarchical allreduce

int Placement::hosts() const {
  return host.empty() ? 0 : *std::max_element(host.begin(), host.end()) + 1;
}

std::vector<int> Placement::ranks_on(int h) const {
  std::vector<int> out;
  for (int r = 0; r < ranks(); ++r)
    if (host[static_cast<std::size_t>(r)] == h) out.push_back(r);
  return out;
}

std::string Placement::uneven() const {
  for (int h = 1; h < hosts(); ++h)
    if (ranks_on(h).size() != ranks_on(0).size())
      return "the hierarchical allreduce needs the same number of ranks on every host; host " +
             std::to_string(h) + " has " + std::to_string(ranks_on(h).size()) + ", host 0 has " +
             std::to_string(ranks_on(0).size());
  return "";
}

Placement placement_of(const std::vector<std::string>& host_names) {
  return Placement{shardlab::number_hosts(host_names).number};
}

Placement blocks(int ranks, int per_host) {
  shardlab::require(per_host >= 1 && ranks % per_host == 0, [&] {
    return std::to_string(per_host) + " ranks per host do not divide " + std::to_string(ranks) +
           " ranks";
  });
  Placement p;
  for (int r = 0; r < ranks; ++r) p.host.push_back(r / per_host);
  return p;
}

namespace {
/// Rank r's number among the ranks of its host (0 for the lowest).
int local_number(const Placement& p, int r) {
  const std::vector<int> mine = p.ranks_on(p.host[static_cast<std::size_t>(r)]);
  return static_cast<int>(std::find(mine.begin(), mine.end(), r) - mine.begin());
}
}  // namespace

HostGroups group_by_host(Communicator& comm, const Placement& placement) {
  shardlab::require(placement.ranks() == comm.size(), [&] {
    return "a placement of " + std::to_string(placement.ranks()) + " ranks for a communicator of " +
           std::to_string(comm.size());
  });
  const std::string uneven = placement.uneven();
  if (!uneven.empty()) throw shardlab::UsageError(uneven);
  const int r = comm.rank(), host = placement.host[static_cast<std::size_t>(r)];
  const int local = local_number(placement, r);
  HostGroups g;
  g.local = comm.split(host, r);
  g.across = comm.split(local, host);
  g.local_ranks = placement.ranks_on(host);
  for (int h = 0; h < placement.hosts(); ++h)
    g.across_ranks.push_back(placement.ranks_on(h)[static_cast<std::size_t>(local)]);
  return g;
}

void hierarchical_allreduce(HostGroups& groups, std::span<float> data, Workspace& scratch) {
  Communicator& local = *groups.local;
  ring_reduce_scatter(local, data, scratch);
  // This rank's chunk now holds its host's sum; the hosts add theirs.
  ring_allreduce(*groups.across, chunk(data, local.size(), owned_chunk(local.rank(), local.size())),
                 scratch);
  ring_allgather(local, data);
}

// ---------------------------------------------------------------------------
// By name, and the formulas

void allreduce(std::string_view name, Communicator& comm, shardlab::Tensor& data,
               std::size_t segment, Workspace& scratch, HostGroups* groups) {
  if (name == "native") return comm.allreduce(data, shardlab::ReduceOp::sum);
  if (name == "hierarchical") {
    if (groups == nullptr)
      throw shardlab::Error("the hierarchical allreduce needs the ranks' groups by host");
    return hierarchical_allreduce(*groups, data.span(), scratch);
  }
  const std::span<float> x = data.span();
  if (name == "ring")
    ring_allreduce(comm, x, scratch);
  else if (name == "naive")
    naive_allreduce(comm, x, scratch);
  else if (name == "pipelined")
    pipelined_ring_allreduce(comm, x, segment, scratch);
  else if (name == "recursive_doubling")
    recursive_doubling_allreduce(comm, x, scratch);
  else
    throw shardlab::Error("no allreduce algorithm '" + std::string(name) + "'");
}

namespace {
/// Elements in chunk c of `count` over `ranks` (shard_range).
std::size_t chunk_size(std::size_t count, int ranks, int c) {
  return static_cast<std::size_t>(
      shard_range(static_cast<std::int64_t>(count), ranks, wrap(c, ranks)).length);
}
/// Bytes rank r sends (all of it to the right) in a ring allreduce of `count` floats: every
/// chunk but (r+1) in reduce-scatter, every chunk but (r+2) in all-gather.
std::size_t ring_bytes(std::size_t count, int rank, int ranks) {
  if (ranks == 1) return 0;
  return (2 * count - chunk_size(count, ranks, rank + 1) - chunk_size(count, ranks, rank + 2)) *
         sizeof(float);
}
}  // namespace

std::size_t formula_bytes_sent(std::string_view algorithm, std::size_t count, int rank, int ranks) {
  if (algorithm == "native")
    return shardlab::collective_traffic(shardlab::Op::allreduce, count, sizeof(float), rank, ranks)
        .sent;
  const std::vector<std::size_t> to =
      formula_bytes_to(algorithm, count, rank, blocks(ranks, ranks));
  return std::accumulate(to.begin(), to.end(), std::size_t{0});
}

std::vector<std::size_t> formula_bytes_to(std::string_view algorithm, std::size_t count, int rank,
                                          const Placement& placement) {
  const int N = placement.ranks();
  const std::size_t S = count * sizeof(float);
  std::vector<std::size_t> to(static_cast<std::size_t>(N), 0);
  auto add_to = [&](int peer, std::size_t bytes) { to[static_cast<std::size_t>(peer)] += bytes; };
  if (algorithm == "native") return {};
  if (N == 1) return to;
  if (algorithm == "naive") {
    if (rank == 0) {
      for (int q = 1; q < N; ++q) add_to(q, S);
    } else {
      add_to(0, S);
    }
  } else if (algorithm == "ring" || algorithm == "pipelined") {
    add_to(wrap(rank + 1, N), ring_bytes(count, rank, N));
  } else if (algorithm == "recursive_doubling") {
    const int P2 = static_cast<int>(std::bit_floor(static_cast<unsigned>(N)));
    const int extra = N - P2;
    if (rank < 2 * extra && rank % 2 == 0) {
      add_to(rank + 1, S);  // hands its buffer up, and sits the rounds out
    } else {
      const int vrank = rank < 2 * extra ? rank / 2 : rank - extra;
      for (int distance = 1; distance < P2; distance *= 2) {
        const int vpartner = vrank ^ distance;
        add_to(vpartner < extra ? 2 * vpartner + 1 : vpartner + extra, S);
      }
      if (rank < 2 * extra) add_to(rank - 1, S);  // the result back to the even rank
    }
  } else if (algorithm == "hierarchical") {
    const std::string uneven = placement.uneven();
    if (!uneven.empty()) throw shardlab::Error(uneven);
    const int host = placement.host[static_cast<std::size_t>(rank)];
    const int l = local_number(placement, rank), n = placement.hosts();
    const std::vector<int> local = placement.ranks_on(host);
    const int g = static_cast<int>(local.size());
    // Inside the host: a ring over its g ranks. Across: a ring over the n hosts, of the
    // chunk this rank owns after the reduce-scatter.
    add_to(local[static_cast<std::size_t>(wrap(l + 1, g))], ring_bytes(count, l, g));
    const std::size_t mine = chunk_size(count, g, owned_chunk(l, g));
    add_to(placement.ranks_on(wrap(host + 1, n))[static_cast<std::size_t>(l)],
           ring_bytes(mine, host, n));
  } else {
    throw shardlab::Error("no formula for algorithm '" + std::string(algorithm) + "'");
  }
  return to;
}

std::vector<std::size_t> formula_link_bytes(std::string_view algorithm, std::size_t count,
                                            const Placement& placement) {
  if (algorithm == "native") return {};
  std::vector<std::size_t> from(static_cast<std::size_t>(placement.hosts()), 0);
  for (int r = 0; r < placement.ranks(); ++r) {
    const std::vector<std::size_t> to = formula_bytes_to(algorithm, count, r, placement);
    const int h = placement.host[static_cast<std::size_t>(r)];
    for (int q = 0; q < placement.ranks(); ++q)
      if (placement.host[static_cast<std::size_t>(q)] != h)
        from[static_cast<std::size_t>(h)] += to[static_cast<std::size_t>(q)];
  }
  return from;
}

}  // namespace ch03
