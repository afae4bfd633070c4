// Communicator: what every backend shares — argument checks, counters, the blocking
// point-to-point calls built on the non-blocking ones, and the reduction loops.
#include "shardlab/comm.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "shardlab/check.hpp"
#include "shardlab/tensor.hpp"

namespace shardlab {

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::f64:
      return 8;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "float";
    case DType::f64:
      return "double";
    case DType::i32:
      return "int32";
    case DType::i64:
      return "int64";
    case DType::u8:
      return "uint8";
  }
  return "?";
}

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
  }
  return "?";
}

ReduceOp parse_reduce_op(std::string_view name) {
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min})
    if (reduce_op_name(op) == name) return op;
  throw UsageError("unknown reduction '" + std::string(name) + "' (sum, avg, max, min)");
}

std::string_view op_name(Op op) {
  static constexpr std::string_view names[] = {"send",   "recv",      "sendrecv",       "allreduce",
                                               "reduce", "broadcast", "reduce_scatter", "allgather",
                                               "gather", "alltoall",  "barrier"};
  static_assert(std::size(names) == op_count);
  return names[static_cast<std::size_t>(op)];
}

OpStats& OpStats::operator+=(const OpStats& o) {
  calls += o.calls;
  bytes_sent += o.bytes_sent;
  bytes_received += o.bytes_received;
  return *this;
}

OpStats OpStats::operator-(const OpStats& o) const {
  return {calls - o.calls, bytes_sent - o.bytes_sent, bytes_received - o.bytes_received};
}

OpStats CommStats::total() const {
  OpStats sum;
  for (const OpStats& s : ops) sum += s;
  return sum;
}

CommStats CommStats::since(const CommStats& earlier) const {
  CommStats delta = *this;
  for (std::size_t i = 0; i < op_count; ++i) delta.ops[i] = ops[i] - earlier.ops[i];
  return delta;
}

// ---------------------------------------------------------------------------
// Argument checks: a wrong peer or count is a usage error naming the call.

void Communicator::throw_usage(const std::string& message) { throw UsageError(message); }

void Communicator::check_peer(int peer, std::string_view what) const {
  if (peer < 0 || peer >= size_)
    throw_usage("rank " + std::to_string(rank_) + ": " + std::string(what) + " with rank " +
                std::to_string(peer) + ", but ranks are 0.." + std::to_string(size_ - 1));
}

void Communicator::check_root(int root, std::string_view what) const {
  if (root < 0 || root >= size_)
    throw_usage("rank " + std::to_string(rank_) + ": " + std::string(what) + " with root " +
                std::to_string(root) + ", but ranks are 0.." + std::to_string(size_ - 1));
}

std::size_t Communicator::total(std::span<const std::size_t> counts) {
  return std::accumulate(counts.begin(), counts.end(), std::size_t{0});
}
namespace {
std::uint64_t total(std::span<const std::size_t> counts) {
  return std::accumulate(counts.begin(), counts.end(), std::uint64_t{0});
}
}  // namespace

void Communicator::check_blocks(std::string_view what, std::size_t whole, std::size_t block) const {
  if (whole != block * static_cast<std::size_t>(size_))
    throw_usage("rank " + std::to_string(rank_) + ": " + std::string(what) + " needs " +
                std::to_string(size_) + " blocks of " + std::to_string(block) +
                " elements, got a buffer of " + std::to_string(whole));
}

void Communicator::check_counts(std::string_view what, std::span<const std::size_t> counts,
                                std::size_t mine, std::size_t whole) const {
  if (counts.size() != static_cast<std::size_t>(size_))
    throw_usage(std::string(what) + ": counts has " + std::to_string(counts.size()) +
                " entries for " + std::to_string(size_) + " ranks");
  if (counts[static_cast<std::size_t>(rank_)] != mine)
    throw_usage("rank " + std::to_string(rank_) + ": " + std::string(what) + " counts say " +
                std::to_string(counts[static_cast<std::size_t>(rank_)]) +
                " elements for this rank, but its buffer has " + std::to_string(mine));
  if (total(counts) != whole)
    throw_usage("rank " + std::to_string(rank_) + ": " + std::string(what) + " counts add up to " +
                std::to_string(total(counts)) + ", but the output holds " + std::to_string(whole));
}

// ---------------------------------------------------------------------------
// Counters

void Communicator::count_traffic(Op op, std::uint64_t bytes_sent, std::uint64_t bytes_received) {
  if (!counting_) return;
  stats_[op].bytes_sent += bytes_sent;
  stats_[op].bytes_received += bytes_received;
}

// ---------------------------------------------------------------------------
// Point to point. A message to oneself is allowed and moves no bytes between ranks.

Request Communicator::isend_bytes(const void* buf, std::size_t count, DType type, Memory mem,
                                  int peer, int tag) {
  check_peer(peer, "send");
  const std::size_t bytes = count * dtype_size(type);
  if (counting_) ++stats_[Op::send].calls;
  count_traffic(Op::send, peer == rank_ ? 0 : bytes, 0);
  if (trace_) trace_({Op::send, peer, tag, buf, bytes});
  return isend_impl(buf, bytes, mem, peer, tag);
}

Request Communicator::irecv_bytes(void* buf, std::size_t count, DType type, Memory mem, int peer,
                                  int tag) {
  check_peer(peer, "recv");
  const std::size_t bytes = count * dtype_size(type);
  if (counting_) ++stats_[Op::recv].calls;
  count_traffic(Op::recv, 0, peer == rank_ ? 0 : bytes);
  if (trace_) trace_({Op::recv, peer, tag, buf, bytes});
  return irecv_impl(buf, bytes, mem, peer, tag);
}

void Communicator::send_bytes(const void* buf, std::size_t count, DType type, Memory mem, int peer,
                              int tag) {
  Request r = isend_bytes(buf, count, type, mem, peer, tag);
  wait(r);
}

void Communicator::recv_bytes(void* buf, std::size_t count, DType type, Memory mem, int peer,
                              int tag) {
  Request r = irecv_bytes(buf, count, type, mem, peer, tag);
  wait(r);
}

void Communicator::sendrecv_bytes(const void* out, std::size_t out_count, void* in,
                                  std::size_t in_count, DType type, Memory out_mem, Memory in_mem,
                                  int dest, int source, int tag) {
  check_peer(dest, "sendrecv");
  check_peer(source, "sendrecv");
  const std::size_t elem = dtype_size(type);
  if (counting_) ++stats_[Op::sendrecv].calls;
  count_traffic(Op::sendrecv, dest == rank_ ? 0 : out_count * elem,
                source == rank_ ? 0 : in_count * elem);
  if (trace_) {
    trace_({Op::send, dest, tag, out, out_count * elem});
    trace_({Op::recv, source, tag, in, in_count * elem});
  }
  // Post the receive first, so a ring of sendrecvs never waits on itself.
  Request requests[2] = {irecv_impl(in, in_count * elem, in_mem, source, tag),
                         isend_impl(out, out_count * elem, out_mem, dest, tag)};
  wait_all(requests);
}

void Communicator::wait(Request& request) {
  if (!request.pending()) return;
  wait_impl(*request.impl());
  request.reset();
}

void Communicator::wait_all(std::span<Request> requests) {
  for (Request& r : requests) wait(r);
}

void Communicator::barrier() {
  if (counting_) ++stats_[Op::barrier].calls;
  barrier_impl();
}

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  if (color < 0) throw_usage("split: color must be non-negative");
  return split_impl(color, key);
}

// ---------------------------------------------------------------------------
// Bookkeeping helpers (uncounted).

std::vector<std::string> Communicator::gather_strings(const std::string& mine, int root) {
  Uncounted quiet(*this);
  check_root(root, "gather_strings");
  // First the lengths, then the characters.
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(size_));
  const std::int64_t my_length = static_cast<std::int64_t>(mine.size());
  allgather(std::span<const std::int64_t>(&my_length, 1), lengths);
  std::vector<std::size_t> counts(lengths.begin(), lengths.end());
  std::vector<std::uint8_t> all(rank_ == root ? total(counts) : 0);
  gatherv(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(mine.data()),
                                        mine.size()),
          all, counts, root);
  std::vector<std::string> out;
  if (rank_ != root) return out;
  std::size_t offset = 0;
  for (std::size_t c : counts) {
    out.emplace_back(reinterpret_cast<const char*>(all.data()) + offset, c);
    offset += c;
  }
  return out;
}

bool Communicator::all_true(bool mine) {
  return agree<std::int32_t>(mine ? 1 : 0, ReduceOp::min) == 1;
}

// ---------------------------------------------------------------------------
// Reductions

namespace {
template <class T>
void reduce_typed(T* acc, const T* x, std::size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      for (std::size_t i = 0; i < n; ++i) acc[i] = static_cast<T>(acc[i] + x[i]);
      break;
    case ReduceOp::max:
      for (std::size_t i = 0; i < n; ++i) acc[i] = std::max(acc[i], x[i]);
      break;
    case ReduceOp::min:
      for (std::size_t i = 0; i < n; ++i) acc[i] = std::min(acc[i], x[i]);
      break;
  }
}

template <class T>
void divide_typed(T* acc, std::size_t n, int ranks) {
  for (std::size_t i = 0; i < n; ++i) acc[i] = static_cast<T>(acc[i] / static_cast<T>(ranks));
}

}  // namespace

void reduce_into(void* acc, const void* x, std::size_t count, DType type, ReduceOp op) {
  visit_dtype(type, [&](auto zero) {
    using T = decltype(zero);
    reduce_typed(static_cast<T*>(acc), static_cast<const T*>(x), count, op);
  });
}

void finish_reduce(void* acc, std::size_t count, DType type, ReduceOp op, int ranks) {
  if (op != ReduceOp::avg) return;
  visit_dtype(type, [&](auto zero) {
    using T = decltype(zero);
    divide_typed(static_cast<T*>(acc), count, ranks);
  });
}

Traffic collective_traffic(Op op, std::size_t count, std::size_t elem, int rank, int ranks,
                           int root) {
  if (ranks == 1) return {};
  const auto S = static_cast<std::uint64_t>(count);
  const auto N = static_cast<std::uint64_t>(ranks);
  const auto chunk =
      static_cast<std::uint64_t>(shard_range(static_cast<std::int64_t>(count), ranks, rank).length);
  Traffic t;
  switch (op) {
    case Op::allreduce:
      // Reduce-scatter: take in the N-1 other copies of chunk r, hand out S - |c_r|.
      // All-gather: take in the S - |c_r| reduced elements of the other chunks, hand
      // out chunk r N-1 times. Both ways: S + (N-2)|c_r|.
      t.sent = t.received = S + (N - 2) * chunk;
      break;
    case Op::reduce:
      t.received = (N - 1) * chunk + (rank == root ? S - chunk : 0);
      t.sent = (S - chunk) + (rank == root ? 0 : chunk);
      break;
    case Op::broadcast:
      if (rank == root)
        t.sent = (N - 1) * S;
      else
        t.received = S;
      break;
    case Op::reduce_scatter:
    case Op::alltoall:
      t.sent = t.received = (N - 1) * S;
      break;
    default:
      break;
  }
  t.sent *= elem;
  t.received *= elem;
  return t;
}

Traffic collective_traffic(Op op, std::span<const std::size_t> counts, std::size_t elem, int rank,
                           int root) {
  const std::uint64_t all = total(counts);
  const std::uint64_t mine = counts[static_cast<std::size_t>(rank)];
  const auto others = static_cast<std::uint64_t>(counts.size()) - 1;
  Traffic t;
  if (op == Op::allgather) {
    t.sent = others * mine;
    t.received = all - mine;
  } else if (op == Op::gather) {
    if (rank == root)
      t.received = all - mine;
    else
      t.sent = mine;
  }
  t.sent *= elem;
  t.received *= elem;
  return t;
}

}  // namespace shardlab
