// Communicator: one interface for the ways ranks talk to each other.
//
//   threads  ranks are threads of one process (the default: nothing to install)
//   mpi      ranks are OpenMPI processes (`mpirun -np N program`)
//   nccl     one GPU per rank, NCCL's collectives and point-to-point (comm_nccl.hpp)
//
// Point-to-point calls (send/recv/sendrecv, and isend/irecv/wait) are what the
// from-scratch algorithms of the chapters are built on; the native collectives are what
// a real job calls, blocking or non-blocking (iallreduce, ... return a Request).
//
// Buffers: a Tensor (host or device memory, any element type), or any contiguous range of
// elements on the host (std::vector, std::span, std::array) of f32, f64, f16, bf16, i32,
// i64 or u8. Reductions of f16 and bf16: the threads backend adds every rank's values in
// f32 and rounds once; MPI (an operation of ours) and NCCL round to the 16-bit type after
// each pairwise add, so their sums can differ from the threads backend's in the last bit.
//
// One message-matching rule on every backend: messages from rank a to rank b are matched
// in the order they are posted — b's k-th receive from a gets a's k-th send to b. Tags do
// not reorder anything; they are checked, and a receive whose tag differs from the
// matched send's is an error naming both (NCCL has no tags, so a program that relied on
// tags to pick a message out of order would work on one backend and fail on another).
//
// Counters: every call is counted — calls, bytes sent and bytes received per operation —
// and the counts are measured: what each message carried, and on the threads backend what
// each rank actually read from or wrote into another rank's memory during a collective.
// Only where a library hides its algorithm (MPI's and NCCL's collectives) is the count the
// traffic of the bandwidth-optimal algorithm for the call, and the operation is marked
// `modeled`.
//
// Safety is part of the interface:
//   - a blocking call that waits longer than the timeout fails with a message naming
//     the rank, the peer, the tag and the operation (a deadlock becomes a message);
//   - ranks that enter one collective with different operations, counts, types or roots
//     get a mismatch error naming both calls, and a collective a rank never joins names
//     that rank when it times out (threads and MPI);
//   - a wrong peer, root or count is an Error (exit 1) naming the call;
//   - an error on any rank ends the whole job (launch.hpp), never leaving others waiting.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "shardlab/check.hpp"
#include "shardlab/dtype.hpp"
#include "shardlab/tensor.hpp"

namespace shardlab {

class FlightRecorder;  // flight.hpp

// ---------------------------------------------------------------------------
// Reductions

// ReduceOp (sum, avg, max, min) is in dtype.hpp, beside the types it reduces.
/// The name of `op`: "sum", "avg", "max" or "min" (what parse_reduce_op reads).
std::string_view reduce_op_name(ReduceOp op);
/// "sum" -> ReduceOp::sum; throws UsageError for an unknown name.
ReduceOp parse_reduce_op(std::string_view name);

// ---------------------------------------------------------------------------
// Buffers

/// A contiguous range of elements on the host: std::vector<float>, std::span<int>, ...
template <class R>
concept HostRange = std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
    Element<std::ranges::range_value_t<R>> && !std::is_same_v<std::remove_cvref_t<R>, Tensor>;

/// What a call reads: a tensor, a host range, or raw memory (pointer, count, type, memory).
struct ConstBuffer {
  const void* data = nullptr;    ///< The first element, in host or device memory.
  std::size_t count = 0;         ///< Elements, not bytes.
  DType type = DType::f32;       ///< The type of every element.
  Memory memory = Memory::host;  ///< Where `data` lives: host or device memory.

  /// Raw memory: `n` elements of type `t` at `p`, in memory `m`.
  ConstBuffer(const void* p, std::size_t n, DType t, Memory m)
      : data(p), count(n), type(t), memory(m) {}
  /// All the elements of a tensor (or of a view of one), in its type and memory.
  ConstBuffer(const Tensor& t)  // NOLINT(google-explicit-constructor): tensors pass as buffers
      : ConstBuffer(t.raw(), static_cast<std::size_t>(t.size()), t.dtype(), t.memory()) {}
  /// All the elements of a host range; the type is its element type's.
  template <HostRange R>
  ConstBuffer(const R& r)  // NOLINT(google-explicit-constructor)
      : ConstBuffer(std::ranges::data(r), static_cast<std::size_t>(std::ranges::size(r)),
                    dtype_of<std::ranges::range_value_t<R>>(), Memory::host) {}
  /// The buffer's size in bytes: count times the element size.
  std::size_t bytes() const { return count * dtype_size(type); }
};

/// What a call writes: a tensor (or a view of one), a host range of non-const elements,
/// or raw memory.
struct MutableBuffer {
  void* data = nullptr;          ///< The first element, in host or device memory.
  std::size_t count = 0;         ///< Elements, not bytes.
  DType type = DType::f32;       ///< The type of every element.
  Memory memory = Memory::host;  ///< Where `data` lives: host or device memory.

  /// Raw memory: `n` elements of type `t` at `p`, in memory `m`.
  MutableBuffer(void* p, std::size_t n, DType t, Memory m)
      : data(p), count(n), type(t), memory(m) {}
  /// All the elements of a tensor, in its type and memory.
  MutableBuffer(Tensor& t)  // NOLINT(google-explicit-constructor)
      : MutableBuffer(t.raw(), static_cast<std::size_t>(t.size()), t.dtype(), t.memory()) {}
  /// A temporary view, like `t.slice(...)`: the call writes into the memory it views.
  MutableBuffer(Tensor&& t)  // NOLINT(google-explicit-constructor): a view, like t.slice(...)
      : MutableBuffer(t.raw(), static_cast<std::size_t>(t.size()), t.dtype(), t.memory()) {}
  /// All the elements of a host range of non-const elements; the type is its element type's.
  template <HostRange R>
  requires(!std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<R>>>)
      MutableBuffer(R&& r)  // NOLINT(google-explicit-constructor)
      : MutableBuffer(std::ranges::data(r), static_cast<std::size_t>(std::ranges::size(r)),
                      dtype_of<std::ranges::range_value_t<R>>(), Memory::host) {}
  /// The same memory, to be read.
  operator ConstBuffer() const { return {data, count, type, memory}; }  // NOLINT
  /// The buffer's size in bytes: count times the element size.
  std::size_t bytes() const { return count * dtype_size(type); }
};

// ---------------------------------------------------------------------------
// Counters

/// The operations a communicator counts, one row each (allgatherv counts as allgather,
/// gatherv as gather, alltoallv as alltoall).
enum class Op : std::uint8_t {
  send,            ///< send and isend.
  recv,            ///< recv and irecv.
  sendrecv,        ///< sendrecv.
  allreduce,       ///< allreduce and iallreduce.
  reduce,          ///< reduce.
  broadcast,       ///< broadcast.
  reduce_scatter,  ///< reduce_scatter and ireduce_scatter.
  allgather,       ///< allgather, allgatherv, iallgather and iallgatherv.
  gather,          ///< gatherv.
  alltoall,        ///< alltoall and alltoallv.
  barrier,         ///< barrier.
  count_           ///< Not an operation: their number (and, to time_calls, a wait for a request).
};
/// The number of operations in Op: the rows of CommStats.
inline constexpr std::size_t op_count = static_cast<std::size_t>(Op::count_);
/// The name of `op` as reports print it: "send", "reduce_scatter", ...
std::string_view op_name(Op op);

/// The counters of one operation on one rank.
struct OpStats {
  std::uint64_t calls = 0;           ///< Calls made (a non-blocking one counts when it starts).
  std::uint64_t bytes_sent = 0;      ///< Bytes of this rank's data that went to other ranks.
  std::uint64_t bytes_received = 0;  ///< Bytes this rank took in from other ranks.
  /// Adds `o`'s counters to these, field by field.
  OpStats& operator+=(const OpStats& o);
  /// These counters minus `o`'s, field by field (`o` an earlier snapshot of them).
  OpStats operator-(const OpStats& o) const;
};

/// Per-operation counters of one rank (see the top: measured, or `modeled`).
struct CommStats {
  std::array<OpStats, op_count> ops{};   ///< One row per operation, indexed by Op.
  std::array<bool, op_count> modeled{};  ///< Per operation: its bytes are modeled, not measured.
  /// The counters of `op`.
  const OpStats& operator[](Op op) const { return ops[static_cast<std::size_t>(op)]; }
  /// The counters of `op`, to update.
  OpStats& operator[](Op op) { return ops[static_cast<std::size_t>(op)]; }
  /// True when `op`'s bytes are the traffic model's (collective_traffic), not measured.
  bool is_modeled(Op op) const { return modeled[static_cast<std::size_t>(op)]; }
  /// True when any operation with traffic in these counters was modeled.
  bool any_modeled() const;
  /// The sum of every operation's counters.
  OpStats total() const;
  /// Counters accumulated since `earlier` (a snapshot taken with Communicator::stats()).
  CommStats since(const CommStats& earlier) const;
  /// Adds another communicator's counters (a sub-communicator's, another rank's).
  CommStats& operator+=(const CommStats& o);
};

/// Bytes a rank sends to and receives from other ranks in one call.
struct Traffic {
  std::uint64_t sent = 0;      ///< Bytes this rank sends to other ranks.
  std::uint64_t received = 0;  ///< Bytes this rank receives from other ranks.
};

// ---------------------------------------------------------------------------
// Errors

/// A communication call failed: timed out, mismatched, or the job was ended by another
/// rank's error. what() names rank, peer, tag and operation. Exit code 1.
struct CommError : Error {
  using Error::Error;
  /// An error with message `what` and report_order `order`.
  CommError(const std::string& what, int order) : Error(what), report_order(order) {}
  /// When several processes fail at once (ranks timing out on one stopped rank), the MPI
  /// backend lets one speak for the job (mpi::fail), the lowest order first: 0 at once
  /// (most errors); n >= 1 for a timeout that blames n ranks that do not respond (the
  /// fewer, the nearer the cause); 10 for one whose ranks all wait in other calls (the
  /// program's calls deadlock), 11 for such a point-to-point wait.
  int report_order = 0;
};
/// Thrown in every other rank when one rank fails, so they stop waiting; the launcher
/// reports the first rank's error, not these.
struct CommAborted : CommError {
  using CommError::CommError;
};

/// One point-to-point transfer as a trace hook sees it (Communicator::trace_messages).
struct MessageEvent {
  Op op;               ///< Op::send or Op::recv (a sendrecv gives one of each).
  int peer;            ///< The destination (send) or the source (recv) rank.
  int tag;             ///< The tag the call was posted with.
  const void* buffer;  ///< The caller's buffer: where in its data the message starts.
  std::size_t bytes;   ///< The message's size in bytes.
};

// ---------------------------------------------------------------------------
// Non-blocking requests

/// A pending isend, irecv or non-blocking collective; complete it with
/// Communicator::wait (its buffers must live, untouched, until then). A request destroyed
/// unwaited — a rank unwinding after an error — is withdrawn where the backend can (an
/// unmatched message leaves the threads backend's mailbox; MPI cancels a receive), or
/// waited for where it cannot (a collective other ranks may be reading).
class Request {
 public:
  /// A backend's state of one pending request; each backend derives its own.
  struct Impl {
    virtual ~Impl() = default;
    Op op = Op::count_;  ///< the operation (Communicator sets it when it posts the request)
    std::chrono::steady_clock::time_point posted;  ///< when it was posted
    std::uint64_t flight = 0;  ///< its call in the flight record (0: none; flight.hpp)
    /// When the backend began and finished the operation's work, steady-clock nanoseconds
    /// since its epoch, where the backend knows (threads: the progress thread's run of a
    /// collective, the copy of a message); {0, 0} where it does not (MPI, NCCL).
    virtual std::pair<std::int64_t, std::int64_t> ran() const { return {0, 0}; }
  };
  Request() = default;
  /// A pending request with a backend's state (what a backend's isend_impl, ... return).
  explicit Request(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
  /// True until the request is waited for or reset; a default-constructed one is not.
  bool pending() const { return impl_ != nullptr; }
  /// The backend's state; null when not pending.
  Impl* impl() { return impl_.get(); }
  /// Destroys the backend's state (withdrawn or waited for, as when the request is
  /// destroyed unwaited); the request is then no longer pending.
  void reset() { impl_.reset(); }

 private:
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------
// The interface

/// One rank's end of a group of ranks that talk to each other: point-to-point calls,
/// collectives and their counters. A backend (threads, mpi, nccl) derives from it.
class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  /// This rank's number in the communicator, 0..size()-1.
  int rank() const { return rank_; }
  /// The number of ranks in the communicator.
  int size() const { return size_; }
  /// "threads", "mpi" or "nccl".
  virtual std::string_view backend() const = 0;
  /// How long a blocking call may wait before it fails.
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// Throws CommAborted once the job has been ended by another rank's failure. This
  /// communicator's own waits notice that by themselves; a backend that waits elsewhere
  /// (NCCL, polling the GPU) asks here while it waits.
  virtual void check_not_aborted() const {}

  // -- point to point --------------------------------------------------------
  // Blocking send may wait until the receiver posts its recv (as MPI allows for large
  // messages), so two ranks that both send first deadlock: use sendrecv or isend.

  /// Sends `buf` to rank `peer` and waits until the send completes (which may be when
  /// `peer` posts the matching recv).
  void send(ConstBuffer buf, int peer, int tag = 0);
  /// Receives rank `peer`'s next message to this rank into `buf`, which must be the
  /// message's size; the message's tag must be `tag`.
  void recv(MutableBuffer buf, int peer, int tag = 0);
  /// Sends `out` to `dest` and receives `in` from `source` at once (no deadlock in a ring).
  void sendrecv(ConstBuffer out, int dest, MutableBuffer in, int source, int tag = 0);
  /// Starts send(buf, peer, tag) and returns at once; wait() completes it.
  [[nodiscard]] Request isend(ConstBuffer buf, int peer, int tag = 0);
  /// Starts recv(buf, peer, tag) and returns at once; wait() completes it.
  [[nodiscard]] Request irecv(MutableBuffer buf, int peer, int tag = 0);
  /// Blocks until `request` completes (with the timeout); it is then no longer pending.
  void wait(Request& request);
  /// Blocks until every request completes, all within one timeout.
  void wait_all(std::span<Request> requests);

  // -- collectives (every rank of the communicator calls them, in the same order) ---

  /// In place: every rank ends with op over all ranks' buffers, element by element.
  void allreduce(MutableBuffer buf, ReduceOp op = ReduceOp::sum);
  /// In place: `root` ends with op over all ranks' buffers; the others' are unchanged.
  void reduce(MutableBuffer buf, ReduceOp op, int root);
  /// In place: every rank ends with root's buffer.
  void broadcast(MutableBuffer buf, int root);
  /// `in` holds S elements on every rank; rank r gets op over all ranks' shard r of them,
  /// shard_range(S, N, r) (uneven when N does not divide S), in `out`.
  void reduce_scatter(ConstBuffer in, MutableBuffer out, ReduceOp op = ReduceOp::sum);
  /// Every rank's `in` (the same length on all), concatenated in rank order into `out`.
  void allgather(ConstBuffer in, MutableBuffer out);
  /// Like allgather, but rank r contributes counts[r] elements (uneven shards).
  void allgatherv(ConstBuffer in, MutableBuffer out, std::span<const std::size_t> counts);
  /// Every rank's `in` concatenated in rank order into `out` on `root` only (`out` is
  /// ignored elsewhere); rank r contributes counts[r] elements.
  void gatherv(ConstBuffer in, MutableBuffer out, std::span<const std::size_t> counts, int root);
  /// `in` holds size() equal blocks; block j goes to rank j, and rank r's block j arrives
  /// in block r of rank j's `out`.
  void alltoall(ConstBuffer in, MutableBuffer out);
  /// Like alltoall with blocks of any length: this rank sends send_counts[j] elements
  /// (the blocks of `in`, back to back) to rank j, and receives recv_counts[j] from rank j
  /// into `out`, back to back in rank order. recv_counts[j] must equal what rank j sends
  /// here (exchange the counts first: an alltoall of one count per rank).
  void alltoallv(ConstBuffer in, std::span<const std::size_t> send_counts, MutableBuffer out,
                 std::span<const std::size_t> recv_counts);
  /// Non-blocking alltoallv: started now, done when the request is waited for; `in`,
  /// `out` and the counts' values must stay as they are until then (the counts are
  /// copied).
  [[nodiscard]] Request ialltoallv(ConstBuffer in, std::span<const std::size_t> send_counts,
                                   MutableBuffer out, std::span<const std::size_t> recv_counts);
  /// Returns when every rank has called it.
  void barrier();

  // -- non-blocking collectives: start now, complete at wait() ----------------------
  // They take their place in the order of collective calls when started. The buffers
  // belong to the collective until wait() returns. A blocking collective started while
  // some are pending runs after them.

  /// Starts allreduce(buf, op); wait() completes it.
  [[nodiscard]] Request iallreduce(MutableBuffer buf, ReduceOp op = ReduceOp::sum);
  /// Starts reduce_scatter(in, out, op); wait() completes it.
  [[nodiscard]] Request ireduce_scatter(ConstBuffer in, MutableBuffer out,
                                        ReduceOp op = ReduceOp::sum);
  /// Starts allgather(in, out); wait() completes it.
  [[nodiscard]] Request iallgather(ConstBuffer in, MutableBuffer out);
  /// Starts allgatherv(in, out, counts); wait() completes it.
  [[nodiscard]] Request iallgatherv(ConstBuffer in, MutableBuffer out,
                                    std::span<const std::size_t> counts);

  /// Splits into sub-communicators: ranks with the same `color` form one, ordered by
  /// `key` (then by rank). Every rank calls it. Counters of the new one start at zero.
  std::unique_ptr<Communicator> split(int color, int key);

  // -- counters ------------------------------------------------------------------
  /// A snapshot of this rank's counters; subtract snapshots with CommStats::since.
  const CommStats& stats() const { return stats_; }
  /// Sets this rank's counters back to zero, and marks no operation modeled.
  void reset_stats() { stats_ = CommStats{}; }
  /// While alive, a blocking call on `comm` may wait up to `timeout` (when that is longer
  /// than its own) before it fails: for ranks that wait while one of them computes alone
  /// for a known while (chapter 09's one-device reference on rank 0).
  class Patience {
   public:
    /// Raises `comm`'s timeout to `timeout`, if longer, until this object is destroyed.
    Patience(Communicator& comm, std::chrono::milliseconds timeout)
        : comm_(comm), was_(comm.timeout_) {
      comm.timeout_ = std::max(timeout, was_);
    }
    ~Patience() { comm_.timeout_ = was_; }
    Patience(const Patience&) = delete;
    Patience& operator=(const Patience&) = delete;

   private:
    Communicator& comm_;
    std::chrono::milliseconds was_;
  };

  /// While alive, calls on `comm` are not counted (the program's own bookkeeping:
  /// printing per-rank lines, agreeing on the exit code).
  class Uncounted {
   public:
    /// Stops counting calls on `comm` until this object is destroyed.
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

  /// While alive, collectives on `comm` skip the check that every rank called the same one
  /// (which costs the MPI backend a few small messages per call): for benchmark timing
  /// loops, whose calls were checked once before.
  class Unchecked {
   public:
    /// Stops the same-call check on `comm` until this object is destroyed.
    explicit Unchecked(Communicator& comm) : comm_(comm), was_(comm.checking_) {
      comm.checking_ = false;
    }
    ~Unchecked() { comm_.checking_ = was_; }
    Unchecked(const Unchecked&) = delete;
    Unchecked& operator=(const Unchecked&) = delete;

   private:
    Communicator& comm_;
    bool was_;
  };

  /// Calls `hook` for every send and receive this rank posts, before it starts: to print
  /// every message while learning, or to check in a test which chunk each step moved.
  /// An empty function stops tracing.
  void trace_messages(std::function<void(const MessageEvent&)> hook) { trace_ = std::move(hook); }

  /// Keeps this rank's calls on this communicator, and on every communicator split from it
  /// afterwards, in `recorder` (flight.hpp), `recorder->rank()` being this rank's number in
  /// the world; null stops. A split then costs an allgather of the colours and keys on
  /// this communicator (uncounted), to learn the new group's members.
  void record_flights(std::shared_ptr<FlightRecorder> recorder);
  /// The recorder record_flights gave (null: none).
  const std::shared_ptr<FlightRecorder>& flight_recorder() const { return recorder_; }
  /// The name this communicator's calls get in the flight record, before its members' world
  /// ranks: "tp" gives "tp[4,5]" (the world is "world"; a split, its parent's name and the
  /// colour, "world/3").
  void name_flights(std::string name);

  /// One call as time_calls reports it, in the steady clock's times. A blocking call
  /// (a collective, or send and recv: a post and a wait) is communication the rank waited
  /// for whole: posted = began = waited, done = returned. A wait for a non-blocking
  /// request: posted when the request was made, its work from `began` to `done` (where the
  /// backend knows; otherwise the wait's own), the rank waiting from `waited` to
  /// `returned`. The work's part before `waited` ran under the rank's computation (hidden);
  /// the wait is the exposed part.
  struct CallTimes {
    using Time = std::chrono::steady_clock::time_point;  ///< the steady clock's time
    Op op = Op::count_;    ///< the operation (a wait names its request's)
    bool blocking = true;  ///< a blocking call; false: a wait for a non-blocking request
    Time posted;           ///< when the call was made, or the request posted
    Time began;            ///< when the operation's work began
    Time done;             ///< when it was done
    Time waited;           ///< when the rank began to wait for it
    Time returned;         ///< when the wait returned
    /// Seconds of the operation's work (done - began).
    double seconds() const { return std::chrono::duration<double>(done - began).count(); }
    /// Seconds the rank waited (returned - waited): the exposed part.
    double exposed() const { return std::chrono::duration<double>(returned - waited).count(); }
    /// Seconds of the work that ran before the rank began to wait: the hidden part.
    double hidden() const {
      const Time end = std::min(done, waited);
      return end > began ? std::chrono::duration<double>(end - began).count() : 0.0;
    }
  };
  /// What time_calls calls, once per blocking call and per wait for a request.
  using CallHook = std::function<void(const CallTimes&)>;
  /// Calls `hook` when each blocking call on this communicator returns and when each wait
  /// for a request does: where a rank spent its time communicating, and how much of a
  /// non-blocking operation ran while it computed (chapter 09's profile). An empty function
  /// stops it.
  void time_calls(CallHook hook) { call_hook_ = std::move(hook); }

  /// What a drill may run as each collective of a rank starts (chapter 11's stall): called
  /// once the call is flight-recorded, so that a hook that does not return leaves the rank
  /// inside the call, as the other members see it (it should wait for CommAborted:
  /// check_not_aborted). Empty: nothing.
  using StartHook = std::function<void(const Communicator&, Op)>;
  /// Calls `*hook` (when it holds a function) as each collective on this communicator, and
  /// on every one split from it from now on, starts; the function may be set later, for
  /// all of them at once. Null stops.
  void on_collective_start(std::shared_ptr<StartHook> hook) { start_hook_ = std::move(hook); }

  // -- bookkeeping (uncounted) ---------------------------------------------------
  /// Gathers one string from every rank to `root`; the result has size() entries on root
  /// and is empty elsewhere.
  std::vector<std::string> gather_strings(const std::string& mine, int root = 0);
  /// Every rank's `mine`, in rank order, on every rank.
  template <Element T>
  std::vector<T> gather_values(T mine) {
    Uncounted not_counted(*this);
    std::vector<T> all(static_cast<std::size_t>(size_));
    allgather(std::span<const T>(&mine, 1), all);
    return all;
  }
  /// op over every rank's `mine`, on every rank, combined on each rank in rank order (so
  /// every backend gives the same bits); max and min propagate NaN, so a NaN anywhere
  /// reaches every rank's verdict.
  template <Element T>
  T agree(T mine, ReduceOp op) {
    const std::vector<T> all = gather_values(mine);
    T acc = all[0];
    for (std::size_t q = 1; q < all.size(); ++q) acc = combine(acc, all[q], op);
    if constexpr (std::is_floating_point_v<T>)
      if (op == ReduceOp::avg) acc /= static_cast<T>(size_);
    return acc;
  }
  /// True on every rank when `mine` is true on every rank.
  bool all_true(bool mine);

  /// One collective call, as every backend sees it. Counts are in elements.
  struct Collective {
    Op op = Op::barrier;              ///< Which collective (allgatherv as allgather, ...).
    ReduceOp reduce = ReduceOp::sum;  ///< The reduction: allreduce, reduce, reduce_scatter.
    int root = 0;                     ///< The root rank: reduce, broadcast, gather.
    const void* in = nullptr;         ///< What this rank contributes (== out when in place).
    void* out = nullptr;              ///< Where this rank's result goes.
    /// allreduce, reduce, broadcast: the buffer's length; reduce_scatter: the input's
    /// length S; alltoall: the block.
    std::size_t count = 0;
    DType type = DType::f32;       ///< The element type of `in` and `out`.
    Memory memory = Memory::host;  ///< Where `in` and `out` live: host or device memory.
    /// allgather(v), gather(v): every rank's count; alltoallv: what this rank sends to each.
    std::vector<std::size_t> counts;
    /// alltoallv: what this rank receives from each.
    std::vector<std::size_t> recv_counts;
    bool vector = false;  ///< alltoallv (counts given) rather than alltoall.
    /// "allreduce(8 x f32, sum)": what error messages show.
    std::string describe() const;
  };

 protected:
  /// For backends: this rank's number, the number of ranks, and how long a blocking call
  /// may wait.
  Communicator(int rank, int size, std::chrono::milliseconds timeout)
      : rank_(rank), size_(size), timeout_(timeout) {}

  // What a backend implements.
  /// Starts sending `bytes` bytes at `buf` (in memory `mem`) to `peer`; wait_impl completes
  /// it. The arguments are checked and the call counted already.
  virtual Request isend_impl(const void* buf, std::size_t bytes, Memory mem, int peer, int tag) = 0;
  /// Starts receiving `bytes` bytes from `peer` into `buf` (in memory `mem`); wait_impl
  /// completes it. The arguments are checked and the call counted already.
  virtual Request irecv_impl(void* buf, std::size_t bytes, Memory mem, int peer, int tag) = 0;
  /// Completes a request of this backend (point-to-point or collective).
  virtual void wait_impl(Request::Impl& request) = 0;
  /// Runs one collective (barrier included) to completion.
  virtual void run_collective(const Collective& c) = 0;
  /// Starts one collective; wait() completes it.
  virtual Request start_collective(Collective c) = 0;
  /// What split does, once it has checked that `color` is non-negative.
  virtual std::unique_ptr<Communicator> split_impl(int color, int key) = 0;

  /// Adds bytes to the counters of `op` (nothing while Uncounted is alive). Backends call
  /// it from their collectives; the point-to-point calls count for themselves.
  void count_traffic(Op op, std::uint64_t bytes_sent, std::uint64_t bytes_received);
  /// count_traffic(op, t.sent, t.received).
  void count_traffic(Op op, Traffic t) { count_traffic(op, t.sent, t.received); }
  /// Adds bytes whatever Uncounted says: for a non-blocking collective that was counted
  /// when it started and whose traffic is known when it ends.
  void record_traffic(Op op, Traffic t) {
    stats_[op].bytes_sent += t.sent;
    stats_[op].bytes_received += t.received;
  }
  /// Counts the modeled traffic of `c` (collective_traffic) and marks its op modeled.
  void count_modeled(const Collective& c);
  /// Marks `op`'s counters modeled (nothing while Uncounted is alive).
  void mark_modeled(Op op) {
    if (counting_) stats_.modeled[static_cast<std::size_t>(op)] = true;
  }
  /// False while an Uncounted is alive on this communicator.
  bool counting() const { return counting_; }
  /// False while an Unchecked is alive: the backend then skips the same-call check.
  bool checking() const { return checking_; }
  /// When the wait in progress gives up: now + timeout for one wait, and one deadline for
  /// all the requests of a wait_all (so it cannot wait a multiple of the timeout).
  std::chrono::steady_clock::time_point wait_deadline() const {
    return wait_all_deadline_ ? *wait_all_deadline_ : std::chrono::steady_clock::now() + timeout_;
  }
  /// Throws Error naming the call `what` unless `peer` is a rank, 0..size()-1.
  void check_peer(int peer, std::string_view what) const;
  /// Throws Error naming the call `what` unless `root` is a rank, 0..size()-1.
  void check_root(int root, std::string_view what) const;

 private:
  template <class T>
  static T combine(T a, T b, ReduceOp op) {
    switch (op) {
      case ReduceOp::max:
        if constexpr (std::is_floating_point_v<T>)
          if (std::isnan(a) || std::isnan(b)) return a + b;
        return a < b ? b : a;
      case ReduceOp::min:
        if constexpr (std::is_floating_point_v<T>)
          if (std::isnan(a) || std::isnan(b)) return a + b;
        return b < a ? b : a;
      case ReduceOp::sum:
      case ReduceOp::avg:
        break;
    }
    return static_cast<T>(a + b);
  }
  /// Checks a collective's arguments on this rank (counts against buffers, roots), counts
  /// the call, and fills in what the backend needs.
  Collective prepare(Collective c, std::size_t in_count, std::size_t out_count, Memory in_memory,
                     Memory out_memory, DType in_type);

  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  CommStats stats_{};
  bool counting_ = true;
  bool checking_ = true;
  std::optional<std::chrono::steady_clock::time_point> wait_all_deadline_;
  std::function<void(const MessageEvent&)> trace_;
  CallHook call_hook_;
  std::shared_ptr<StartHook> start_hook_;  // on_collective_start
  // The flight record (record_flights): the recorder, this group's name and members.
  std::shared_ptr<FlightRecorder> recorder_;
  std::string flight_name_ = "world";
  std::string flight_group_;
  std::vector<int> flight_members_;
  /// Notes a call starting on this communicator in the flight record (0 when none).
  std::uint64_t fly(Op op, int peer, std::size_t count, DType type);
  /// The call `id` of the flight record returned, after the rank waited `since` start.
  void landed(std::uint64_t id, std::chrono::steady_clock::time_point since);
  /// A collective's count as its flight record shows it (allgather: this rank's share).
  std::size_t flight_count(const Collective& c) const;
  /// run_collective, timed for call_hook_ when one is set.
  void collective(const Collective& c);
  /// start_collective, the request marked with its operation and the time it was posted.
  Request start(Collective c);
  /// alltoallv's and ialltoallv's call, checked and counted.
  Collective alltoallv_call(ConstBuffer in, std::span<const std::size_t> send_counts,
                            MutableBuffer out, std::span<const std::size_t> recv_counts);
  /// `request` marked with `op` and the time `at` it was posted (for call_hook_).
  static Request posted(Request request, Op op, std::chrono::steady_clock::time_point at);
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
};

// ---------------------------------------------------------------------------
// Reductions, written once for every backend that reduces on the host.

/// acc[i] = op(acc[i], x[i]) for i < count, for f32, f64, i32, i64 and u8 (avg
/// accumulates a sum; finish_reduce divides). Floating max and min propagate NaN.
void reduce_into(void* acc, const void* x, std::size_t count, DType type, ReduceOp op);
/// For avg: divides the accumulated sums by `ranks`; nothing for the other ops.
void finish_reduce(void* acc, std::size_t count, DType type, ReduceOp op, int ranks);
/// dst = op over the ranks' blocks sources[0], sources[1], ... (`count` elements each), in
/// rank order, finished (avg divides by their number); f16 and bf16 added in f32 and
/// rounded once at the end. dst may be one of the sources (each block is read before it is
/// written). The threads and MPI backends both reduce this way, so their bits agree.
void reduce_in_rank_order(void* dst, std::span<const void* const> sources, std::size_t count,
                          DType type, ReduceOp op);

/// The traffic model of one collective over `ranks` ranks, for `rank`, with `count`
/// elements of `elem` bytes — what the threads backend's algorithms move, and what the
/// counters report for MPI's and NCCL's collectives (marked modeled):
///   allreduce       reduce-scatter + all-gather over chunks c_r (shard_range):
///                   S + (N-2)|c_r| each way, = 2(N-1)/N * S when N divides S
///   reduce          the reduce-scatter half, then each chunk to root
///   broadcast       root hands S to each of the N-1 others
///   reduce_scatter  `count` is the whole input S: S - |c_r| out, (N-1)|c_r| in
///   alltoall        `count` is the block: (N-1) * block each way
///   barrier         nothing
Traffic collective_traffic(Op op, std::size_t count, std::size_t elem, int rank, int ranks,
                           int root = 0);
/// allgather / gather with per-rank counts: rank r hands its counts[r] elements to every
/// other rank (allgather) or to root (gather), and takes in the others'.
Traffic collective_traffic(Op op, std::span<const std::size_t> counts, std::size_t elem, int rank,
                           int root = 0);

/// How far replicas that must be identical have drifted: the largest |mine - rank 0's|
/// over every element and every rank (NaN when any is NaN), on every rank. Every rank
/// calls it; rank 0's copy is broadcast uncounted (bookkeeping, not training traffic).
double replica_divergence(Communicator& comm, const Tensor& mine);

/// True on every rank when all the ranks of `comm` run in one boot of one machine
/// (threads; MPI processes on one node), so that their std::chrono::steady_clock readings
/// can be compared: a timeline of several ranks can then put their times on one axis.
/// Every rank calls it (uncounted).
bool one_machine(Communicator& comm);

/// The host each rank runs on, in rank order, on every rank: its host name (the same for
/// every rank of the threads backend; under mpirun, each process's own). Every rank calls
/// it (uncounted).
std::vector<std::string> host_names(Communicator& comm);

/// Hosts by number (number_hosts).
struct HostNumbers {
  std::vector<int> number;            ///< Each name's host number.
  std::vector<std::string> distinct;  ///< The hosts' names, by number.
};
/// Hosts numbered 0, 1, ... in order of first appearance: number[i] is names[i]'s
/// ({"b", "a", "b"} gives number {0, 1, 0} and distinct {"b", "a"}).
HostNumbers number_hosts(const std::vector<std::string>& names);

/// Bytes this host has sent on its network interfaces since they came up, loopback left
/// out: what left it for other hosts (TCP/IP headers and acknowledgements included). Read
/// from /proc/net/dev, which shows the interfaces of the caller's network namespace (each
/// host of scripts/cluster.sh is one); 0 where there is no such file.
std::uint64_t network_bytes_sent();

}  // namespace shardlab
