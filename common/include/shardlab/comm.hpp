// Communicator: one interface for the ways ranks talk to each other.
//
//   threads  ranks are threads of one process (the default: nothing to install)
//   mpi      ranks are OpenMPI processes (`mpirun -np N program`)
//
// Point-to-point calls (send/recv/sendrecv, and isend/irecv/wait) are what the
// from-scratch algorithms of later chapters are built on; the native collectives are
// what a real job calls. Every call is counted (calls, bytes sent, bytes received, per
// operation), so a chapter can print the traffic it measured next to a formula.
//
// Safety is part of the interface:
//   - a blocking call that waits longer than the timeout fails with a message naming
//     the rank, the peer, the tag and the operation (a deadlock becomes a message);
//   - ranks that enter one collective with different operations, counts, types or roots
//     get a mismatch error (threads backend);
//   - an error on any rank ends the whole job (launch.hpp), never leaving others waiting.
//
// Buffers are any contiguous range of float, double, int32, int64 or uint8 elements:
// std::vector, std::span, std::array, Tensor.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <ranges>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace shardlab {

// ---------------------------------------------------------------------------
// Element types and reduction operations

enum class DType : std::uint8_t { f32, f64, i32, i64, u8 };
std::size_t dtype_size(DType t);
std::string_view dtype_name(DType t);

template <class T>
constexpr DType dtype_of() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>)
    return DType::f32;
  else if constexpr (std::is_same_v<U, double>)
    return DType::f64;
  else if constexpr (std::is_same_v<U, std::int32_t>)
    return DType::i32;
  else if constexpr (std::is_same_v<U, std::int64_t>)
    return DType::i64;
  else {
    static_assert(std::is_same_v<U, std::uint8_t>, "unsupported element type");
    return DType::u8;
  }
}

/// Calls f(T{}) with T the element type of `type`: one switch for every typed loop.
template <class F>
void visit_dtype(DType type, F&& f) {
  switch (type) {
    case DType::f32:
      f(float{});
      break;
    case DType::f64:
      f(double{});
      break;
    case DType::i32:
      f(std::int32_t{});
      break;
    case DType::i64:
      f(std::int64_t{});
      break;
    case DType::u8:
      f(std::uint8_t{});
      break;
  }
}

template <class T>
concept Element = std::is_same_v < std::remove_cv_t<T>,
float > || std::is_same_v<std::remove_cv_t<T>, double> ||
    std::is_same_v<std::remove_cv_t<T>, std::int32_t> ||
    std::is_same_v<std::remove_cv_t<T>, std::int64_t> ||
    std::is_same_v<std::remove_cv_t<T>, std::uint8_t>;

/// A contiguous buffer of elements a communicator can move.
template <class R>
concept Buffer = std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
    Element<std::ranges::range_value_t<R>>;

/// Where a buffer lives. Host buffers work on every backend. Device (CUDA) buffers work
/// on the threads backend (copies through cudaMemcpy, reductions as kernels), so N ranks
/// can share one GPU; the MPI backend refuses them (Open MPI here is not CUDA-aware).
enum class Memory : std::uint8_t { host, device };

/// A buffer type says it lives on the device with `static constexpr Memory memory =
/// Memory::device;` (DeviceTensor, DeviceSpan); every other buffer is host memory.
template <class R>
constexpr Memory memory_of() {
  using B = std::remove_cvref_t<R>;
  if constexpr (requires { B::memory; })
    return B::memory;
  else
    return Memory::host;
}

/// A view of `count` elements of device memory, for passing raw device pointers.
template <class T>
struct DeviceSpan {
  static constexpr Memory memory = Memory::device;
  T* ptr = nullptr;
  std::size_t count = 0;
  T* data() const { return ptr; }
  std::size_t size() const { return count; }
  T* begin() const { return ptr; }
  T* end() const { return ptr + count; }
};

/// sum, avg (sum / N), max, min: what allreduce, reduce and reduce_scatter combine with.
enum class ReduceOp : std::uint8_t { sum, avg, max, min };
std::string_view reduce_op_name(ReduceOp op);
/// "sum" -> ReduceOp::sum; throws UsageError for an unknown name.
ReduceOp parse_reduce_op(std::string_view name);

// ---------------------------------------------------------------------------
// Counters

/// The operations a communicator counts, one row each.
enum class Op : std::uint8_t {
  send,
  recv,
  sendrecv,
  allreduce,
  reduce,
  broadcast,
  reduce_scatter,
  allgather,
  gather,
  alltoall,
  barrier,
  count_
};
inline constexpr std::size_t op_count = static_cast<std::size_t>(Op::count_);
std::string_view op_name(Op op);

struct OpStats {
  std::uint64_t calls = 0;
  std::uint64_t bytes_sent = 0;      // bytes of this rank's data that went to other ranks
  std::uint64_t bytes_received = 0;  // bytes this rank took in from other ranks
  OpStats& operator+=(const OpStats& o);
  OpStats operator-(const OpStats& o) const;
};

/// Per-operation counters of one rank. What a collective counts is the traffic of the
/// algorithm the backend runs where that is known (the threads backend, and every
/// point-to-point call); for a library collective whose algorithm is hidden (MPI's), it
/// is the traffic of the bandwidth-optimal algorithm for the same call, the figure
/// nccl-tests' bus bandwidth assumes, and the operation is marked `modeled`.
struct CommStats {
  std::array<OpStats, op_count> ops{};
  std::array<bool, op_count> modeled{};
  const OpStats& operator[](Op op) const { return ops[static_cast<std::size_t>(op)]; }
  OpStats& operator[](Op op) { return ops[static_cast<std::size_t>(op)]; }
  OpStats total() const;
  /// Counters accumulated since `earlier` (a snapshot taken with Communicator::stats()).
  CommStats since(const CommStats& earlier) const;
};

/// Bytes a rank sends to and receives from other ranks in one call.
struct Traffic {
  std::uint64_t sent = 0;
  std::uint64_t received = 0;
};

// ---------------------------------------------------------------------------
// Errors

/// A communication call failed: timed out, mismatched, or the job was ended by another
/// rank's error. what() names rank, peer, tag and operation.
struct CommError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
/// Thrown in every other rank when one rank fails, so they stop waiting; the launcher
/// reports the first rank's error, not these.
struct CommAborted : CommError {
  using CommError::CommError;
};

/// One point-to-point transfer as a trace hook sees it (Communicator::trace_messages).
struct MessageEvent {
  Op op;     // Op::send or Op::recv (a sendrecv gives one of each)
  int peer;  // destination or source
  int tag;
  const void* buffer;  // the caller's buffer: where in its data the message starts
  std::size_t bytes;
};

// ---------------------------------------------------------------------------
// Non-blocking requests

/// A pending isend or irecv; complete it with Communicator::wait (its buffer must live
/// until then). A request destroyed unwaited — a rank unwinding after an error — is
/// withdrawn where the backend can: on threads an unmatched message leaves the mailbox
/// (and one being copied is waited for); MPI cancels a receive; the job is ending anyway.
class Request {
 public:
  struct Impl {
    virtual ~Impl() = default;
  };
  Request() = default;
  explicit Request(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
  bool pending() const { return impl_ != nullptr; }
  Impl* impl() { return impl_.get(); }
  void reset() { impl_.reset(); }

 private:
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------
// The interface

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// "threads" or "mpi".
  virtual std::string_view backend() const = 0;
  /// How long a blocking call may wait before it fails.
  std::chrono::milliseconds timeout() const { return timeout_; }

  // -- point to point --------------------------------------------------------
  // Blocking send may wait until the receiver posts its recv (as MPI allows for large
  // messages), so two ranks that both send first deadlock: use sendrecv or isend.
  // Messages between one pair of ranks with one tag arrive in the order they were sent.

  template <Buffer R>
  void send(const R& buf, int peer, int tag = 0) {
    send_bytes(std::ranges::data(buf), count(buf), dtype<R>(), memory_of<R>(), peer, tag);
  }
  template <Buffer R>
  void recv(R&& buf, int peer, int tag = 0) {
    recv_bytes(std::ranges::data(buf), count(buf), dtype<R>(), memory_of<R>(), peer, tag);
  }
  /// Sends `out` to `dest` and receives `in` from `source` at once (no deadlock in a ring).
  template <Buffer S, Buffer R>
  void sendrecv(const S& out, int dest, R&& in, int source, int tag = 0) {
    static_assert(std::is_same_v<std::ranges::range_value_t<S>, std::ranges::range_value_t<R>>);
    sendrecv_bytes(std::ranges::data(out), count(out), std::ranges::data(in), count(in), dtype<R>(),
                   memory_of<S>(), memory_of<R>(), dest, source, tag);
  }
  template <Buffer R>
  [[nodiscard]] Request isend(const R& buf, int peer, int tag = 0) {
    return isend_bytes(std::ranges::data(buf), count(buf), dtype<R>(), memory_of<R>(), peer, tag);
  }
  template <Buffer R>
  [[nodiscard]] Request irecv(R&& buf, int peer, int tag = 0) {
    return irecv_bytes(std::ranges::data(buf), count(buf), dtype<R>(), memory_of<R>(), peer, tag);
  }
  /// Blocks until `request` completes (with the timeout); it is then no longer pending.
  void wait(Request& request);
  void wait_all(std::span<Request> requests);

  // -- collectives (every rank of the communicator calls them, in the same order) ---

  /// In place: every rank ends with op over all ranks' buffers, element by element.
  template <Buffer R>
  void allreduce(R&& buf, ReduceOp op = ReduceOp::sum) {
    collective(Op::allreduce, [&] {
      allreduce_impl(std::ranges::data(buf), count(buf), dtype<R>(), memory_of<R>(), op);
    });
  }
  /// In place: `root` ends with op over all ranks' buffers; the others' are unchanged.
  template <Buffer R>
  void reduce(R&& buf, ReduceOp op, int root) {
    collective(Op::reduce, [&] {
      reduce_impl(std::ranges::data(buf), count(buf), dtype<R>(), memory_of<R>(), op, root);
    });
  }
  /// In place: every rank ends with root's buffer.
  template <Buffer R>
  void broadcast(R&& buf, int root) {
    collective(Op::broadcast, [&] {
      broadcast_impl(std::ranges::data(buf), count(buf), dtype<R>(), memory_of<R>(), root);
    });
  }
  /// `in` holds size() blocks of out.size() elements; rank r gets op over all ranks'
  /// block r in `out`.
  template <Buffer S, Buffer R>
  void reduce_scatter(const S& in, R&& out, ReduceOp op = ReduceOp::sum) {
    static_assert(std::is_same_v<std::ranges::range_value_t<S>, std::ranges::range_value_t<R>>);
    check_blocks("reduce_scatter", count(in), count(out));
    collective(Op::reduce_scatter, [&] {
      reduce_scatter_impl(std::ranges::data(in), std::ranges::data(out), count(out), dtype<R>(),
                          same_memory<S, R>("reduce_scatter"), op);
    });
  }
  /// Every rank's `in` (the same length on all), concatenated in rank order into `out`.
  template <Buffer S, Buffer R>
  void allgather(const S& in, R&& out) {
    static_assert(std::is_same_v<std::ranges::range_value_t<S>, std::ranges::range_value_t<R>>);
    check_blocks("allgather", count(out), count(in));
    std::vector<std::size_t> counts(static_cast<std::size_t>(size_), count(in));
    collective(Op::allgather, [&] {
      allgatherv_impl(std::ranges::data(in), std::ranges::data(out), counts, dtype<R>(),
                      same_memory<S, R>("allgather"));
    });
  }
  /// Like allgather, but rank r contributes counts[r] elements (uneven shards).
  template <Buffer S, Buffer R>
  void allgatherv(const S& in, R&& out, std::span<const std::size_t> counts) {
    static_assert(std::is_same_v<std::ranges::range_value_t<S>, std::ranges::range_value_t<R>>);
    check_counts("allgatherv", counts, count(in), count(out));
    collective(Op::allgather, [&] {
      allgatherv_impl(std::ranges::data(in), std::ranges::data(out), counts, dtype<R>(),
                      same_memory<S, R>("allgather"));
    });
  }
  /// Every rank's `in` concatenated in rank order into `out` on `root` only (`out` is
  /// ignored elsewhere); rank r contributes counts[r] elements.
  template <Buffer S, Buffer R>
  void gatherv(const S& in, R&& out, std::span<const std::size_t> counts, int root) {
    static_assert(std::is_same_v<std::ranges::range_value_t<S>, std::ranges::range_value_t<R>>);
    check_counts("gatherv", counts, count(in), rank_ == root ? count(out) : total(counts));
    collective(Op::gather, [&] {
      gatherv_impl(std::ranges::data(in), std::ranges::data(out), counts, dtype<R>(),
                   same_memory<S, R>("gatherv"), root);
    });
  }
  /// `in` holds size() blocks; block j goes to rank j, and rank r's block j arrives in
  /// block r of rank j's `out`.
  template <Buffer S, Buffer R>
  void alltoall(const S& in, R&& out) {
    static_assert(std::is_same_v<std::ranges::range_value_t<S>, std::ranges::range_value_t<R>>);
    check_blocks("alltoall", count(in), count(out) / static_cast<std::size_t>(size_));
    if (count(in) != count(out)) throw_usage("alltoall: in and out must have the same length");
    collective(Op::alltoall, [&] {
      alltoall_impl(std::ranges::data(in), std::ranges::data(out),
                    count(in) / static_cast<std::size_t>(size_), dtype<R>(),
                    same_memory<S, R>("alltoall"));
    });
  }
  /// Returns when every rank has called it.
  void barrier();

  /// Splits into sub-communicators: ranks with the same `color` form one, ordered by
  /// `key` (then by rank). Every rank calls it. Counters of the new one start at zero.
  std::unique_ptr<Communicator> split(int color, int key);

  // -- counters ------------------------------------------------------------------
  /// A snapshot of this rank's counters; subtract snapshots with CommStats::since.
  const CommStats& stats() const { return stats_; }
  void reset_stats() { stats_ = CommStats{}; }
  /// While alive, calls on `comm` are not counted (the program's own bookkeeping:
  /// printing per-rank lines, agreeing on the exit code).
  class Uncounted {
   public:
    explicit Uncounted(Communicator& comm) : comm_(comm), was_(comm.counting_) {
      comm.counting_ = false;
    }
    ~Uncounted() { comm_.counting_ = was_; }
    Uncounted(const Uncounted&) = delete;
    Uncounted& operator=(const Uncounted&) = delete;

   private:
    Communicator& comm_;
    bool was_;
  };

  /// Calls `hook` for every send and receive this rank posts, before it starts: to print
  /// every message while learning, or to check in a test which chunk each step moved.
  /// An empty function stops tracing.
  void trace_messages(std::function<void(const MessageEvent&)> hook) { trace_ = std::move(hook); }

  /// Gathers one string from every rank to `root` (uncounted); the result has size()
  /// entries on root and is empty elsewhere.
  std::vector<std::string> gather_strings(const std::string& mine, int root = 0);
  /// True on every rank when `mine` is true on every rank (uncounted).
  bool all_true(bool mine);
  /// op over every rank's `mine`, on every rank (uncounted: the program's bookkeeping,
  /// such as the worst error or the slowest time).
  template <Element T>
  T agree(T mine, ReduceOp op) {
    Uncounted quiet(*this);
    allreduce(std::span<T>(&mine, 1), op);
    return mine;
  }
  /// Every rank's `mine`, in rank order, on every rank (uncounted).
  template <Element T>
  std::vector<T> gather_values(T mine) {
    Uncounted quiet(*this);
    std::vector<T> all(static_cast<std::size_t>(size_));
    allgather(std::span<const T>(&mine, 1), all);
    return all;
  }

 protected:
  Communicator(int rank, int size, std::chrono::milliseconds timeout)
      : rank_(rank), size_(size), timeout_(timeout) {}

  // What a backend implements. Counts are in elements of `type`.
  virtual Request isend_impl(const void* buf, std::size_t bytes, Memory mem, int peer, int tag) = 0;
  virtual Request irecv_impl(void* buf, std::size_t bytes, Memory mem, int peer, int tag) = 0;
  virtual void wait_impl(Request::Impl& request) = 0;
  virtual void allreduce_impl(void* buf, std::size_t count, DType type, Memory mem,
                              ReduceOp op) = 0;
  virtual void reduce_impl(void* buf, std::size_t count, DType type, Memory mem, ReduceOp op,
                           int root) = 0;
  virtual void broadcast_impl(void* buf, std::size_t count, DType type, Memory mem, int root) = 0;
  virtual void reduce_scatter_impl(const void* in, void* out, std::size_t count, DType type,
                                   Memory mem, ReduceOp op) = 0;
  virtual void allgatherv_impl(const void* in, void* out, std::span<const std::size_t> counts,
                               DType type, Memory mem) = 0;
  virtual void gatherv_impl(const void* in, void* out, std::span<const std::size_t> counts,
                            DType type, Memory mem, int root) = 0;
  virtual void alltoall_impl(const void* in, void* out, std::size_t block, DType type,
                             Memory mem) = 0;
  virtual void barrier_impl() = 0;
  virtual std::unique_ptr<Communicator> split_impl(int color, int key) = 0;

  // Point-to-point as the templates see it: checked, counted, then handed to the backend.
  Request isend_bytes(const void* buf, std::size_t count, DType type, Memory mem, int peer,
                      int tag);
  Request irecv_bytes(void* buf, std::size_t count, DType type, Memory mem, int peer, int tag);
  void send_bytes(const void* buf, std::size_t count, DType type, Memory mem, int peer, int tag);
  void recv_bytes(void* buf, std::size_t count, DType type, Memory mem, int peer, int tag);
  void sendrecv_bytes(const void* out, std::size_t out_count, void* in, std::size_t in_count,
                      DType type, Memory out_mem, Memory in_mem, int dest, int source, int tag);

  /// Adds bytes to the counters of `op` (nothing while Uncounted is alive). Backends call
  /// it from their collectives; the point-to-point wrappers count for themselves.
  void count_traffic(Op op, std::uint64_t bytes_sent, std::uint64_t bytes_received);
  void count_traffic(Op op, Traffic t) { count_traffic(op, t.sent, t.received); }
  void mark_modeled(Op op) { stats_.modeled[static_cast<std::size_t>(op)] = true; }
  bool counting() const { return counting_; }
  void check_peer(int peer, std::string_view what) const;
  void check_root(int root, std::string_view what) const;
  [[noreturn]] static void throw_usage(const std::string& message);

 private:
  template <class R>
  static constexpr DType dtype() {
    return dtype_of<std::ranges::range_value_t<R>>();
  }
  template <class R>
  static std::size_t count(const R& buf) {
    return static_cast<std::size_t>(std::ranges::size(buf));
  }
  static std::size_t total(std::span<const std::size_t> counts);
  template <class S, class R>
  Memory same_memory(std::string_view what) const {
    if constexpr (memory_of<S>() != memory_of<R>())
      throw_usage(std::string(what) + ": in and out must both be host or both be device buffers");
    return memory_of<R>();
  }
  template <class F>
  void collective(Op op, F&& body) {
    if (counting_) ++stats_[op].calls;
    body();
  }
  void check_blocks(std::string_view what, std::size_t whole, std::size_t block) const;
  void check_counts(std::string_view what, std::span<const std::size_t> counts, std::size_t mine,
                    std::size_t whole) const;

  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  CommStats stats_{};
  bool counting_ = true;
  std::function<void(const MessageEvent&)> trace_;
};

// ---------------------------------------------------------------------------
// Reductions, written once for every backend that reduces by hand.

/// acc[i] = op(acc[i], x[i]) for i < count (avg accumulates a sum; finish_reduce divides).
void reduce_into(void* acc, const void* x, std::size_t count, DType type, ReduceOp op);
/// For avg: divides the accumulated sums by `ranks`; nothing for the other ops.
void finish_reduce(void* acc, std::size_t count, DType type, ReduceOp op, int ranks);

/// The traffic of `rank` in one collective over `ranks` ranks, for the algorithms the
/// threads backend runs (see CommStats), with `count` elements of `elem` bytes:
///   allreduce       reduce-scatter + all-gather over chunks c_r (shard_range):
///                   S + (N-2)|c_r| each way, = 2(N-1)/N * S when N divides S
///   reduce          the reduce-scatter half, then each chunk to root
///   broadcast       root hands S to each of the N-1 others
///   reduce_scatter  `count` is the block: (N-1) * block each way
///   alltoall        `count` is the block: (N-1) * block each way
///   barrier         nothing
Traffic collective_traffic(Op op, std::size_t count, std::size_t elem, int rank, int ranks,
                           int root = 0);
/// allgather / gather with per-rank counts: rank r hands its counts[r] elements to every
/// other rank (allgather) or to root (gather), and takes in the others'.
Traffic collective_traffic(Op op, std::span<const std::size_t> counts, std::size_t elem, int rank,
                           int root = 0);

}  // namespace shardlab
