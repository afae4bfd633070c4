// Communicator: what every backend shares — argument checks, counters, the blocking
// calls built on the non-blocking ones, and the host reduction loops.
#include "shardlab/comm.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>

#include "shardlab/check.hpp"
#include "shardlab/flight.hpp"
#include "shardlab/half.hpp"
#include "shardlab/results.hpp"
#include "shardlab/tensor.hpp"
#include "vector_math.hpp"

namespace shardlab {

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

bool CommStats::any_modeled() const {
  for (std::size_t i = 0; i < op_count; ++i)
    if (modeled[i] && (ops[i].bytes_sent || ops[i].bytes_received)) return true;
  return false;
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

CommStats& CommStats::operator+=(const CommStats& o) {
  for (std::size_t i = 0; i < op_count; ++i) {
    ops[i] += o.ops[i];
    modeled[i] = modeled[i] || o.modeled[i];
  }
  return *this;
}

namespace {
std::size_t total(std::span<const std::size_t> counts) {
  return std::accumulate(counts.begin(), counts.end(), std::size_t{0});
}
std::string list(std::span<const std::size_t> counts) {
  std::string s = "[";
  for (std::size_t i = 0; i < counts.size(); ++i) s += (i ? " " : "") + std::to_string(counts[i]);
  return s + "]";
}
}  // namespace

std::string Communicator::Collective::describe() const {
  std::string s = std::string(op_name(op)) + (vector ? "v(" : "(");
  if (op == Op::barrier) return s + ")";
  if (op == Op::alltoall && vector)
    s += "send " + list(counts) + ", recv " + list(recv_counts) + " x ";
  else if (!counts.empty() && (op == Op::allgather || op == Op::gather))
    s += "counts " + list(counts) + " x ";
  else
    s += std::to_string(count) + " x ";
  s += dtype_name(type);
  if (memory == Memory::device) s += " on device";
  if (op == Op::allreduce || op == Op::reduce || op == Op::reduce_scatter)
    s += ", " + std::string(reduce_op_name(reduce));
  if (op == Op::reduce || op == Op::broadcast || op == Op::gather)
    s += ", root " + std::to_string(root);
  return s + ")";
}

// ---------------------------------------------------------------------------
// Argument checks: a wrong peer or count is an Error naming the call.

void Communicator::check_peer(int peer, std::string_view what) const {
  if (peer < 0 || peer >= size_)
    throw Error("rank " + std::to_string(rank_) + ": " + std::string(what) + " with rank " +
                std::to_string(peer) + ", but ranks are 0.." + std::to_string(size_ - 1));
}

void Communicator::check_root(int root, std::string_view what) const {
  if (root < 0 || root >= size_)
    throw Error("rank " + std::to_string(rank_) + ": " + std::string(what) + " with root " +
                std::to_string(root) + ", but ranks are 0.." + std::to_string(size_ - 1));
}

Communicator::Collective Communicator::prepare(Collective c, std::size_t in_count,
                                               std::size_t out_count, Memory in_memory,
                                               Memory out_memory, DType in_type) {
  auto me = [&] { return "rank " + std::to_string(rank_) + ": " + std::string(op_name(c.op)); };
  const auto N = static_cast<std::size_t>(size_);
  const auto r = static_cast<std::size_t>(rank_);
  if (in_type != c.type)
    throw Error(me() + ": in is " + std::string(dtype_name(in_type)) + " but out is " +
                std::string(dtype_name(c.type)));
  if (in_memory != out_memory)
    throw Error(me() + ": in and out must both be host or both be device buffers");
  c.memory = out_memory;
  // (This runs on every collective: a message is built only when a check fails.)
  auto need = [&](bool ok, auto&& what) {
    if (!ok) throw Error(me() + ": " + what());
  };
  switch (c.op) {
    case Op::reduce:
    case Op::broadcast:
    case Op::gather:
      check_root(c.root, op_name(c.op));
      break;
    default:
      break;
  }
  switch (c.op) {
    case Op::reduce_scatter: {
      const ShardRange mine = shard_range(static_cast<std::int64_t>(in_count), size_, rank_);
      need(out_count == static_cast<std::size_t>(mine.length), [&] {
        return "out has " + std::to_string(out_count) + " elements, but this rank's shard of " +
               std::to_string(in_count) + " is " + std::to_string(mine.length) +
               " (shard_range(S, N, r))";
      });
      c.count = in_count;
      break;
    }
    case Op::allgather:
    case Op::gather: {
      need(c.counts.size() == N, [&] {
        return "counts has " + std::to_string(c.counts.size()) + " entries for " +
               std::to_string(size_) + " ranks";
      });
      need(c.counts[r] == in_count, [&] {
        return "counts say " + std::to_string(c.counts[r]) +
               " elements for this rank, but its buffer has " + std::to_string(in_count);
      });
      if (c.op == Op::allgather || rank_ == c.root)
        need(total(c.counts) == out_count, [&] {
          return "counts add up to " + std::to_string(total(c.counts)) + ", but the output holds " +
                 std::to_string(out_count);
        });
      break;
    }
    case Op::alltoall:
      if (c.vector) {
        need(c.counts.size() == N && c.recv_counts.size() == N, [&] {
          return "send and receive counts need " + std::to_string(size_) + " entries each";
        });
        need(total(c.counts) == in_count, [&] {
          return "send counts add up to " + std::to_string(total(c.counts)) + ", but in holds " +
                 std::to_string(in_count);
        });
        need(total(c.recv_counts) == out_count, [&] {
          return "receive counts add up to " + std::to_string(total(c.recv_counts)) +
                 ", but out holds " + std::to_string(out_count);
        });
      } else {
        need(in_count == out_count && in_count % N == 0, [&] {
          return "needs in and out of " + std::to_string(size_) + " equal blocks, got " +
                 std::to_string(in_count) + " and " + std::to_string(out_count) + " elements";
        });
        c.count = in_count / N;
      }
      break;
    default:
      c.count = out_count;
      break;
  }
  if (counting_) ++stats_[c.op].calls;
  return c;
}

// ---------------------------------------------------------------------------
// Counters

void Communicator::count_traffic(Op op, std::uint64_t bytes_sent, std::uint64_t bytes_received) {
  if (!counting_) return;
  stats_[op].bytes_sent += bytes_sent;
  stats_[op].bytes_received += bytes_received;
}

void Communicator::count_modeled(const Collective& c) {
  const std::size_t elem = dtype_size(c.type);
  Traffic t;
  if (c.op == Op::allgather || c.op == Op::gather)
    t = collective_traffic(c.op, c.counts, elem, rank_, c.root);
  else if (c.op == Op::alltoall && c.vector) {
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      t.sent += c.counts[static_cast<std::size_t>(q)] * elem;
      t.received += c.recv_counts[static_cast<std::size_t>(q)] * elem;
    }
  } else
    t = collective_traffic(c.op, c.count, elem, rank_, size_, c.root);
  count_traffic(c.op, t);
  if (counting_) stats_.modeled[static_cast<std::size_t>(c.op)] = true;
}

// ---------------------------------------------------------------------------
// Point to point. A message to oneself is allowed and moves no bytes between ranks.

Request Communicator::isend(ConstBuffer buf, int peer, int tag) {
  check_peer(peer, "send");
  if (counting_) ++stats_[Op::send].calls;
  count_traffic(Op::send, peer == rank_ ? 0 : buf.bytes(), 0);
  if (trace_) trace_({Op::send, peer, tag, buf.data, buf.bytes()});
  const std::uint64_t flight = fly(Op::send, peer, buf.bytes(), DType::u8);
  const auto at = now();  // before the backend, which may move the message at once
  Request r = posted(isend_impl(buf.data, buf.bytes(), buf.memory, peer, tag), Op::send, at);
  if (r.pending()) r.impl()->flight = flight;
  return r;
}

Request Communicator::irecv(MutableBuffer buf, int peer, int tag) {
  check_peer(peer, "recv");
  if (counting_) ++stats_[Op::recv].calls;
  count_traffic(Op::recv, 0, peer == rank_ ? 0 : buf.bytes());
  if (trace_) trace_({Op::recv, peer, tag, buf.data, buf.bytes()});
  const std::uint64_t flight = fly(Op::recv, peer, buf.bytes(), DType::u8);
  const auto at = now();  // before the backend, which may move the message at once
  Request r = posted(irecv_impl(buf.data, buf.bytes(), buf.memory, peer, tag), Op::recv, at);
  if (r.pending()) r.impl()->flight = flight;
  return r;
}

void Communicator::send(ConstBuffer buf, int peer, int tag) {
  Request r = isend(buf, peer, tag);
  wait(r);
}

void Communicator::recv(MutableBuffer buf, int peer, int tag) {
  Request r = irecv(buf, peer, tag);
  wait(r);
}

void Communicator::sendrecv(ConstBuffer out, int dest, MutableBuffer in, int source, int tag) {
  check_peer(dest, "sendrecv");
  check_peer(source, "sendrecv");
  if (out.type != in.type)
    throw Error("rank " + std::to_string(rank_) + ": sendrecv sends " +
                std::string(dtype_name(out.type)) + " but receives " +
                std::string(dtype_name(in.type)));
  if (counting_) ++stats_[Op::sendrecv].calls;
  count_traffic(Op::sendrecv, dest == rank_ ? 0 : out.bytes(), source == rank_ ? 0 : in.bytes());
  if (trace_) {
    trace_({Op::send, dest, tag, out.data, out.bytes()});
    trace_({Op::recv, source, tag, in.data, in.bytes()});
  }
  // Post the receive first, so a ring of sendrecvs never waits on itself.
  const std::uint64_t flights[2] = {fly(Op::recv, source, in.bytes(), DType::u8),
                                    fly(Op::send, dest, out.bytes(), DType::u8)};
  Request requests[2] = {irecv_impl(in.data, in.bytes(), in.memory, source, tag),
                         isend_impl(out.data, out.bytes(), out.memory, dest, tag)};
  for (int i = 0; i < 2; ++i)
    if (requests[i].pending()) requests[i].impl()->flight = flights[i];
  wait_all(requests);
}

void Communicator::wait(Request& request) {
  if (!request.pending()) return;
  const auto start = std::chrono::steady_clock::now();
  Request::Impl& impl = *request.impl();
  wait_impl(impl);
  landed(impl.flight, start);
  if (call_hook_) {
    CallTimes t;
    t.op = impl.op;
    t.blocking = false;
    t.posted = impl.posted;
    t.waited = start;
    t.returned = std::chrono::steady_clock::now();
    const auto [began, done] = impl.ran();
    using D = std::chrono::steady_clock::duration;
    t.began = began
                  ? CallTimes::Time(std::chrono::duration_cast<D>(std::chrono::nanoseconds(began)))
                  : t.waited;
    t.done = done ? CallTimes::Time(std::chrono::duration_cast<D>(std::chrono::nanoseconds(done)))
                  : t.returned;
    request.reset();
    call_hook_(t);
    return;
  }
  request.reset();
}

std::size_t Communicator::flight_count(const Collective& c) const {
  if (c.counts.empty()) return c.count;  // allgather(v) and gather(v): this rank's share
  if (!c.vector) return c.counts[static_cast<std::size_t>(rank_)];
  std::size_t sent = 0;  // alltoallv: all it sends
  for (std::size_t k : c.counts) sent += k;
  return sent;
}

void Communicator::collective(const Collective& c) {
  const std::uint64_t flight = fly(c.op, -1, flight_count(c), c.type);
  if (start_hook_ && *start_hook_) (*start_hook_)(*this, c.op);
  const auto start = std::chrono::steady_clock::now();
  run_collective(c);
  landed(flight, start);
  if (call_hook_) {
    const auto end = std::chrono::steady_clock::now();
    call_hook_({c.op, true, start, start, end, start, end});
  }
}

Request Communicator::start(Collective c) {
  const std::uint64_t flight = fly(c.op, -1, flight_count(c), c.type);
  if (start_hook_ && *start_hook_) (*start_hook_)(*this, c.op);
  const auto at = now();
  const Op op = c.op;
  Request r = posted(start_collective(std::move(c)), op, at);
  if (r.pending()) r.impl()->flight = flight;
  return r;
}

// ---------------------------------------------------------------------------
// The flight record

void Communicator::record_flights(std::shared_ptr<FlightRecorder> recorder) {
  recorder_ = std::move(recorder);
  if (!recorder_) return;
  if (flight_members_.empty()) {  // the world: its own numbers
    for (int q = 0; q < size_; ++q) flight_members_.push_back(q);
  }
  name_flights(flight_name_);
}

void Communicator::name_flights(std::string name) {
  flight_name_ = std::move(name);
  flight_group_ = flight_name_ + "[";
  for (std::size_t i = 0; i < flight_members_.size(); ++i)
    flight_group_ += (i ? "," : "") + std::to_string(flight_members_[i]);
  flight_group_ += "]";
}

std::uint64_t Communicator::fly(Op op, int peer, std::size_t count, DType type) {
  if (!recorder_) return 0;
  Flight f;
  f.group = flight_group_;
  f.op = op;
  f.peer = peer < 0 ? -1 : flight_members_[static_cast<std::size_t>(peer)];
  f.count = count;
  f.type = type;
  f.start = std::chrono::duration<double>(now().time_since_epoch()).count();
  return recorder_->started(std::move(f), flight_members_);
}

void Communicator::landed(std::uint64_t id, std::chrono::steady_clock::time_point since) {
  if (!recorder_) return;
  if (id) recorder_->finished(id);
  recorder_->waited(std::chrono::duration<double>(now() - since).count());
}

Request Communicator::posted(Request request, Op op, std::chrono::steady_clock::time_point at) {
  if (Request::Impl* impl = request.impl()) {
    impl->op = op;
    impl->posted = at;
  }
  return request;
}

void Communicator::wait_all(std::span<Request> requests) {
  const auto outer = wait_all_deadline_;  // a wait_all inside another keeps the outer one
  if (!outer) wait_all_deadline_ = std::chrono::steady_clock::now() + timeout_;
  try {
    for (Request& r : requests) wait(r);
  } catch (...) {
    wait_all_deadline_ = outer;
    throw;
  }
  wait_all_deadline_ = outer;
}

// ---------------------------------------------------------------------------
// Collectives: check, count the call, hand to the backend.

namespace {
/// One collective call's description, before the checks fill in its counts.
Communicator::Collective call(Op op, const void* in, void* out, DType type,
                              ReduceOp reduce = ReduceOp::sum, int root = 0) {
  Communicator::Collective c;
  c.op = op;
  c.in = in;
  c.out = out;
  c.type = type;
  c.reduce = reduce;
  c.root = root;
  return c;
}
}  // namespace

void Communicator::allreduce(MutableBuffer buf, ReduceOp op) {
  collective(prepare(call(Op::allreduce, buf.data, buf.data, buf.type, op), buf.count, buf.count,
                     buf.memory, buf.memory, buf.type));
}

Request Communicator::iallreduce(MutableBuffer buf, ReduceOp op) {
  return start(prepare(call(Op::allreduce, buf.data, buf.data, buf.type, op), buf.count, buf.count,
                       buf.memory, buf.memory, buf.type));
}

void Communicator::reduce(MutableBuffer buf, ReduceOp op, int root) {
  collective(prepare(call(Op::reduce, buf.data, buf.data, buf.type, op, root), buf.count, buf.count,
                     buf.memory, buf.memory, buf.type));
}

void Communicator::broadcast(MutableBuffer buf, int root) {
  collective(prepare(call(Op::broadcast, buf.data, buf.data, buf.type, ReduceOp::sum, root),
                     buf.count, buf.count, buf.memory, buf.memory, buf.type));
}

void Communicator::reduce_scatter(ConstBuffer in, MutableBuffer out, ReduceOp op) {
  collective(prepare(call(Op::reduce_scatter, in.data, out.data, out.type, op), in.count, out.count,
                     in.memory, out.memory, in.type));
}

Request Communicator::ireduce_scatter(ConstBuffer in, MutableBuffer out, ReduceOp op) {
  return start(prepare(call(Op::reduce_scatter, in.data, out.data, out.type, op), in.count,
                       out.count, in.memory, out.memory, in.type));
}

void Communicator::allgather(ConstBuffer in, MutableBuffer out) {
  const std::vector<std::size_t> counts(static_cast<std::size_t>(size_), in.count);
  allgatherv(in, out, counts);
}

Request Communicator::iallgather(ConstBuffer in, MutableBuffer out) {
  const std::vector<std::size_t> counts(static_cast<std::size_t>(size_), in.count);
  return iallgatherv(in, out, counts);
}

void Communicator::allgatherv(ConstBuffer in, MutableBuffer out,
                              std::span<const std::size_t> counts) {
  Collective c = call(Op::allgather, in.data, out.data, out.type);
  c.counts.assign(counts.begin(), counts.end());
  collective(prepare(std::move(c), in.count, out.count, in.memory, out.memory, in.type));
}

Request Communicator::iallgatherv(ConstBuffer in, MutableBuffer out,
                                  std::span<const std::size_t> counts) {
  Collective c = call(Op::allgather, in.data, out.data, out.type);
  c.counts.assign(counts.begin(), counts.end());
  return start(prepare(std::move(c), in.count, out.count, in.memory, out.memory, in.type));
}

void Communicator::gatherv(ConstBuffer in, MutableBuffer out, std::span<const std::size_t> counts,
                           int root) {
  Collective c = call(Op::gather, in.data, out.data, out.type, ReduceOp::sum, root);
  c.counts.assign(counts.begin(), counts.end());
  collective(prepare(std::move(c), in.count, out.count, in.memory, out.memory, in.type));
}

void Communicator::alltoall(ConstBuffer in, MutableBuffer out) {
  collective(prepare(call(Op::alltoall, in.data, out.data, out.type), in.count, out.count,
                     in.memory, out.memory, in.type));
}

Communicator::Collective Communicator::alltoallv_call(ConstBuffer in,
                                                      std::span<const std::size_t> send_counts,
                                                      MutableBuffer out,
                                                      std::span<const std::size_t> recv_counts) {
  Collective c = call(Op::alltoall, in.data, out.data, out.type);
  c.counts.assign(send_counts.begin(), send_counts.end());
  c.recv_counts.assign(recv_counts.begin(), recv_counts.end());
  c.vector = true;
  return prepare(std::move(c), in.count, out.count, in.memory, out.memory, in.type);
}

void Communicator::alltoallv(ConstBuffer in, std::span<const std::size_t> send_counts,
                             MutableBuffer out, std::span<const std::size_t> recv_counts) {
  collective(alltoallv_call(in, send_counts, out, recv_counts));
}

Request Communicator::ialltoallv(ConstBuffer in, std::span<const std::size_t> send_counts,
                                 MutableBuffer out, std::span<const std::size_t> recv_counts) {
  return start(alltoallv_call(in, send_counts, out, recv_counts));
}

void Communicator::barrier() {
  if (counting_) ++stats_[Op::barrier].calls;
  collective(call(Op::barrier, nullptr, nullptr, DType::u8));
}

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  if (color < 0)
    throw Error("rank " + std::to_string(rank_) + ": split: color must be non-negative");
  if (!recorder_) return split_impl(color, key);
  // The new group's members in the world's numbers: the ranks of this one with the same
  // colour, ordered by key, then by rank (as split orders them).
  const std::vector<int> colors = gather_values(color), keys = gather_values(key);
  std::vector<int> mine;
  for (int q = 0; q < size_; ++q)
    if (colors[static_cast<std::size_t>(q)] == color) mine.push_back(q);
  std::stable_sort(mine.begin(), mine.end(), [&](int a, int b) {
    return keys[static_cast<std::size_t>(a)] < keys[static_cast<std::size_t>(b)];
  });
  std::unique_ptr<Communicator> child = split_impl(color, key);
  for (int q : mine) child->flight_members_.push_back(flight_members_[static_cast<std::size_t>(q)]);
  child->flight_name_ = flight_name_ + "/" + std::to_string(color);
  child->record_flights(recorder_);
  child->start_hook_ = start_hook_;
  return child;
}

// ---------------------------------------------------------------------------
// Bookkeeping helpers (uncounted).

std::vector<std::string> Communicator::gather_strings(const std::string& mine, int root) {
  Uncounted not_counted(*this);
  check_root(root, "gather_strings");
  // First the lengths, then the characters.
  const std::vector<std::int64_t> lengths = gather_values(static_cast<std::int64_t>(mine.size()));
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

double replica_divergence(Communicator& comm, const Tensor& mine) {
  Communicator::Uncounted not_counted(comm);
  const Tensor host = mine.to(Memory::host);
  Tensor rank0 = host.clone();
  comm.broadcast(rank0, 0);
  return comm.agree(max_abs_diff(host, rank0), ReduceOp::max);
}

bool one_machine(Communicator& comm) {
  // This boot of this machine: its boot id (one per kernel boot; containers on one host
  // share it) and its host name, hashed (FNV-1a).
  std::string id;
  if (std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {};
    if (std::fgets(buf, sizeof buf, f) != nullptr) id = buf;
    std::fclose(f);
  }
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) == 0) id += host;
  const std::uint64_t hash = fnv1a64(id.data(), id.size());
  const std::vector<std::int64_t> all = comm.gather_values(static_cast<std::int64_t>(hash));
  return std::all_of(all.begin(), all.end(), [&](std::int64_t h) { return h == all[0]; });
}

std::vector<std::string> host_names(Communicator& comm) {
  Communicator::Uncounted not_counted(comm);
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) std::snprintf(host, sizeof host, "?");
  // Rank 0 gathers the names and hands them all back, one per line.
  std::string lines;
  for (const std::string& name : comm.gather_strings(host, 0)) lines += name + "\n";
  std::int64_t length =
      comm.agree<std::int64_t>(static_cast<std::int64_t>(lines.size()), ReduceOp::max);
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(length));
  std::copy(lines.begin(), lines.end(), bytes.begin());
  comm.broadcast(bytes, 0);
  std::vector<std::string> names;
  std::string name;
  for (std::uint8_t c : bytes) {
    if (c != '\n') {
      name += static_cast<char>(c);
    } else {
      names.push_back(name);
      name.clear();
    }
  }
  return names;
}

HostNumbers number_hosts(const std::vector<std::string>& names) {
  HostNumbers out;
  for (const std::string& name : names) {
    auto at = std::find(out.distinct.begin(), out.distinct.end(), name);
    if (at == out.distinct.end()) at = out.distinct.insert(out.distinct.end(), name);
    out.number.push_back(static_cast<int>(at - out.distinct.begin()));
  }
  return out;
}

std::uint64_t network_bytes_sent() {
  std::FILE* f = std::fopen("/proc/net/dev", "r");
  if (f == nullptr) return 0;
  // Two header lines, then "  name: rx_bytes rx_packets ... (8 fields) tx_bytes ...".
  std::uint64_t sent = 0;
  char line[512];
  for (int n = 0; std::fgets(line, sizeof line, f) != nullptr; ++n) {
    const char* colon = std::strchr(line, ':');
    if (n < 2 || colon == nullptr) continue;
    std::string name(static_cast<const char*>(line), colon);
    name.erase(0, name.find_first_not_of(' '));
    if (name == "lo") continue;
    unsigned long long field[9] = {};
    if (std::sscanf(colon + 1, "%llu %llu %llu %llu %llu %llu %llu %llu %llu", &field[0], &field[1],
                    &field[2], &field[3], &field[4], &field[5], &field[6], &field[7],
                    &field[8]) == 9)
      sent += field[8];
  }
  std::fclose(f);
  return sent;
}

bool Communicator::all_true(bool mine) {
  return agree<std::int32_t>(mine ? 1 : 0, ReduceOp::min) == 1;
}

// ---------------------------------------------------------------------------
// Reductions

namespace {
template <class T>
SHARDLAB_VECTOR_CLONES void reduce_typed(T* acc, const T* x, std::size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      for (std::size_t i = 0; i < n; ++i) acc[i] = static_cast<T>(acc[i] + x[i]);
      break;
    case ReduceOp::max:
      // x > acc, or x is NaN (x != x): NaN, once in, stays (NaN > anything is false).
      for (std::size_t i = 0; i < n; ++i)
        if (x[i] > acc[i] || x[i] != x[i]) acc[i] = x[i];
      break;
    case ReduceOp::min:
      for (std::size_t i = 0; i < n; ++i)
        if (x[i] < acc[i] || x[i] != x[i]) acc[i] = x[i];
      break;
  }
}

template <class T>
void divide_typed(T* acc, std::size_t n, int ranks) {
  // Integers divide by the int (T(ranks) would wrap for u8 at 256 ranks); floats by T.
  for (std::size_t i = 0; i < n; ++i) {
    if constexpr (std::is_integral_v<T>)
      acc[i] = static_cast<T>(acc[i] / ranks);
    else
      acc[i] = acc[i] / static_cast<T>(ranks);
  }
}

/// visit_dtype for the types reduced as they are; f16 and bf16 go through f32.
template <class F>
void visit_reducible(DType type, const char* what, F&& f) {
  visit_dtype(type, [&](auto zero) {
    using T = decltype(zero);
    if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
      throw Error(std::string(what) + ": " + std::string(dtype_name(type)) +
                  " is reduced through f32 (convert first)");
    else
      f(zero);
  });
}
}  // namespace

void reduce_into(void* acc, const void* x, std::size_t count, DType type, ReduceOp op) {
  visit_reducible(type, "reduce_into", [&](auto zero) {
    using T = decltype(zero);
    reduce_typed(static_cast<T*>(acc), static_cast<const T*>(x), count, op);
  });
}

void finish_reduce(void* acc, std::size_t count, DType type, ReduceOp op, int ranks) {
  if (op != ReduceOp::avg) return;
  visit_reducible(type, "finish_reduce", [&](auto zero) {
    using T = decltype(zero);
    divide_typed(static_cast<T*>(acc), count, ranks);
  });
}

void reduce_in_rank_order(void* dst, std::span<const void* const> sources, std::size_t count,
                          DType type, ReduceOp op) {
  const int ranks = static_cast<int>(sources.size());
  if (ranks == 0 || count == 0) return;
  const bool half = is_half(type);
  const std::size_t elem = dtype_size(type);
  // One pass over memory: each block is gathered into a small accumulator that stays in
  // L1, then written out once.
  constexpr std::size_t block = 2048;  // elements
  alignas(64) unsigned char acc[block * 8];
  alignas(64) float incoming[block];
  const DType acc_type = half ? DType::f32 : type;
  const std::size_t acc_elem = dtype_size(acc_type);
  for (std::size_t done = 0; done < count; done += block) {
    const std::size_t len = std::min(block, count - done);
    for (int q = 0; q < ranks; ++q) {
      const char* x = static_cast<const char*>(sources[static_cast<std::size_t>(q)]) + done * elem;
      if (!half) {
        if (q == 0)
          std::memcpy(acc, x, len * elem);
        else
          reduce_into(acc, x, len, type, op);
        continue;
      }
      float* into = q == 0 ? reinterpret_cast<float*>(acc) : incoming;
      for (std::size_t i = 0; i < len; ++i) {
        std::uint16_t bits = 0;
        std::memcpy(&bits, x + i * 2, 2);
        into[i] = type == DType::f16 ? half_bits_to_float(bits) : bf16_bits_to_float(bits);
      }
      if (q > 0) reduce_into(acc, incoming, len, DType::f32, op);
    }
    finish_reduce(acc, len, acc_type, op, ranks);
    char* d = static_cast<char*>(dst) + done * elem;
    if (!half) {
      std::memcpy(d, acc, len * acc_elem);
      continue;
    }
    const float* sums = reinterpret_cast<const float*>(acc);
    for (std::size_t i = 0; i < len; ++i) {
      const std::uint16_t bits =
          type == DType::f16 ? float_to_half_bits(sums[i]) : float_to_bf16_bits(sums[i]);
      std::memcpy(d + i * 2, &bits, 2);
    }
  }
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
      // Hand out every other rank's shard of my input; take in N-1 copies of my shard.
      t.sent = S - chunk;
      t.received = (N - 1) * chunk;
      break;
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
