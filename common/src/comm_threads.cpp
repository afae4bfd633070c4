// The threads backend (see comm_threads.hpp).
//
// Waiting: every rank has one Waiter (a mutex and a condition variable). Whoever
// completes something a rank waits for (a message copied, the last arrival at a
// barrier, a non-blocking collective finished) wakes that rank's Waiter;
// ThreadWorld::abort wakes them all. A wait spins briefly first (most waits are short),
// then sleeps until its deadline.
#include "shardlab/comm_threads.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <numeric>
#include <system_error>
#include <thread>

#include "kernels.hpp"
#include "shardlab/check.hpp"
#include "shardlab/cuda.hpp"
#include "shardlab/half.hpp"
#include "shardlab/results.hpp"
#include "shardlab/tensor.hpp"

namespace shardlab {

namespace {
using Clock = std::chrono::steady_clock;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

struct Waiter {
  std::mutex m;
  std::condition_variable cv;
};

/// memcpy for host buffers; cudaMemcpy (any direction, any device) when one is on a GPU.
void copy_bytes(void* dst, const void* src, std::size_t bytes, Memory mem) {
  if (bytes == 0 || dst == src) return;
  if (mem == Memory::device)
    kernels::copy(dst, src, bytes);
  else
    std::memcpy(dst, src, bytes);
}

}  // namespace

struct ThreadWorld::State {
  int size;
  std::chrono::milliseconds timeout;
  std::vector<std::unique_ptr<Waiter>> waiters;  // one per world rank
  std::atomic<bool> aborted{false};
  std::mutex reason_mutex;
  std::string reason;

  // Spinning only pays when every thread has a core of its own; otherwise a spinning
  // rank takes the core from the rank it waits for.
  int spins;

  State(int n, std::chrono::milliseconds t)
      : size(n),
        timeout(t),
        spins(n <= static_cast<int>(std::thread::hardware_concurrency()) ? 4000 : 0) {
    for (int r = 0; r < n; ++r) waiters.push_back(std::make_unique<Waiter>());
  }

  void wake(int world_rank) {
    Waiter& w = *waiters[static_cast<std::size_t>(world_rank)];
    { std::lock_guard<std::mutex> lock(w.m); }  // no wake-up is lost between check and sleep
    w.cv.notify_all();
  }

  void abort(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(reason_mutex);
      if (aborted.load()) return;
      reason = why;
      aborted.store(true);
    }
    for (int r = 0; r < size; ++r) wake(r);
  }

  [[noreturn]] void throw_aborted(int world_rank) {
    std::lock_guard<std::mutex> lock(reason_mutex);
    throw CommAborted("rank " + std::to_string(world_rank) + ": stopped because " + reason);
  }

  /// Waits on `world_rank`'s Waiter until done() holds (true) or the deadline passes
  /// (false); throws CommAborted if the job is ended meanwhile.
  template <class Done>
  bool wait_until(int world_rank, Done&& done, Clock::time_point deadline) {
    for (int spin = 0; spin < spins; ++spin) {
      if (done()) return true;
      if (aborted.load(std::memory_order_relaxed)) throw_aborted(world_rank);
      cpu_relax();
    }
    Waiter& w = *waiters[static_cast<std::size_t>(world_rank)];
    std::unique_lock<std::mutex> lock(w.m);
    for (;;) {
      if (done()) return true;
      if (aborted.load()) {
        lock.unlock();
        throw_aborted(world_rank);
      }
      if (w.cv.wait_until(lock, deadline) == std::cv_status::timeout) return done();
    }
  }
};

namespace {

using WorldState = ThreadWorld::State;

// ---------------------------------------------------------------------------
// Point to point

struct Group;

/// A posted send or recv. States: queued in a mailbox -> matched (being copied) -> done.
struct Message final : Request::Impl {
  enum State { queued, matched, done };
  std::shared_ptr<Group> group;
  bool is_send = false;
  int me = 0;    // group rank that posted it
  int peer = 0;  // destination (send) or source (recv)
  int tag = 0;
  const void* src = nullptr;  // send
  void* dst = nullptr;        // recv
  std::size_t bytes = 0;
  Memory mem = Memory::host;
  std::atomic<int> state{queued};
  std::string error;  // set before `done` when sizes or tags disagree
  std::atomic<std::int64_t> copied_from{0}, copied_to{0};  // the copy's steady-clock ns

  std::pair<std::int64_t, std::int64_t> ran() const override {
    return {copied_from.load(std::memory_order_acquire), copied_to.load(std::memory_order_acquire)};
  }

  ~Message() override;
  std::string describe() const {
    return std::string(is_send ? "send to" : "recv from") + " rank " + std::to_string(peer) +
           " (tag " + std::to_string(tag) + ", " + std::to_string(bytes) + " bytes)";
  }
};

struct Mailbox {
  std::mutex m;
  std::deque<Message*> sends;  // sends addressed to this rank, not yet received
  std::deque<Message*> recvs;  // recvs this rank posted, not yet matched
  // Sends to this rank withdrawn unmatched because their Request was dropped unwaited
  // (sender, tag): what a receive that times out is told about.
  std::deque<std::pair<int, int>> withdrawn;
};

/// What a rank posts when it enters a collective, for the others to read.
struct Slot {
  using Call = Communicator::Collective;
  Call call;
  bool is_split = false;
  int color = 0, key = 0;       // split
  std::shared_ptr<Group> made;  // split: the group its color's leader created

  std::string describe() const {
    if (is_split)
      return "split(color " + std::to_string(color) + ", key " + std::to_string(key) + ")";
    return call.describe();
  }
  /// Same collective with the same arguments. alltoallv's counts differ by rank and are
  /// checked pair by pair instead.
  bool agrees_with(const Slot& o) const {
    const Call& a = call;
    const Call& b = o.call;
    if (is_split || o.is_split) return is_split == o.is_split;
    return a.op == b.op && a.vector == b.vector && a.count == b.count && a.type == b.type &&
           a.reduce == b.reduce && a.root == b.root && a.memory == b.memory &&
           (a.vector || a.counts == b.counts);
  }
};

/// The ranks of one communicator: their mailboxes and their collective slots.
struct Group {
  std::shared_ptr<WorldState> world;
  std::vector<int> members;  // group rank -> world rank
  std::unique_ptr<Mailbox[]> boxes;
  std::vector<Slot> slots;
  std::mutex m;
  int arrived = 0;
  std::atomic<std::uint64_t> generation{0};  // barriers completed
  std::vector<std::uint64_t> arrivals;       // per rank: the barrier it last arrived at
  // Bytes other ranks read from (sent) or wrote into (received) each rank's memory during
  // the collective in progress; each rank collects its own at the collective's end.
  std::unique_ptr<std::atomic<std::uint64_t>[]> remote_sent, remote_received;

  Group(std::shared_ptr<WorldState> w, std::vector<int> world_ranks)
      : world(std::move(w)),
        members(std::move(world_ranks)),
        boxes(new Mailbox[members.size()]),
        slots(members.size()),
        arrivals(members.size(), 0),
        remote_sent(new std::atomic<std::uint64_t>[members.size()]),
        remote_received(new std::atomic<std::uint64_t>[members.size()]) {
    for (std::size_t i = 0; i < members.size(); ++i) remote_sent[i] = remote_received[i] = 0;
  }
  int size() const { return static_cast<int>(members.size()); }
  int world_rank(int group_rank) const { return members[static_cast<std::size_t>(group_rank)]; }
};

Message::~Message() {
  // A message dropped before completion (its rank is unwinding after an error) must
  // leave no pointer to its buffer behind, and must not free it under a copy.
  if (state.load() == done) return;
  Mailbox& box = group->boxes[static_cast<std::size_t>(is_send ? peer : me)];
  {
    std::lock_guard<std::mutex> lock(box.m);
    if (state.load() == queued) {
      auto& queue = is_send ? box.sends : box.recvs;
      queue.erase(std::remove(queue.begin(), queue.end(), this), queue.end());
      if (is_send) {
        box.withdrawn.emplace_back(me, tag);
        if (box.withdrawn.size() > 8) box.withdrawn.pop_front();
      }
      return;
    }
  }
  // Matched: the other side is copying, which is short and cannot block; let it run.
  for (int spins = 0; state.load() != done; ++spins) {
    if (spins < 1000)
      cpu_relax();
    else
      std::this_thread::yield();
  }
}

std::int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void complete(Message& send, Message& recv) {
  const std::int64_t from = steady_ns();
  if (send.bytes != recv.bytes) {
    const std::string why =
        "rank " + std::to_string(recv.me) + " posted a recv of " + std::to_string(recv.bytes) +
        " bytes from rank " + std::to_string(send.me) + " (tag " + std::to_string(send.tag) +
        "), but rank " + std::to_string(send.me) + " sent " + std::to_string(send.bytes) + " bytes";
    send.error = why;
    recv.error = why;
  } else {
    const bool device = send.mem == Memory::device || recv.mem == Memory::device;
    copy_bytes(recv.dst, send.src, send.bytes, device ? Memory::device : Memory::host);
    // A tag mismatch is the receiver's error (as under MPI): the send went through.
    if (send.tag != recv.tag)
      recv.error = "rank " + std::to_string(recv.me) + "'s recv from rank " +
                   std::to_string(send.me) + " (tag " + std::to_string(recv.tag) + ") met rank " +
                   std::to_string(send.me) + "'s send with tag " + std::to_string(send.tag) +
                   ": messages between two ranks are matched in the order they are posted, and "
                   "the tags must agree (NCCL has no tags to match on)";
  }
  const std::shared_ptr<WorldState> world = send.group->world;
  const int send_owner = send.group->world_rank(send.me);
  const int recv_owner = recv.group->world_rank(recv.me);
  const std::int64_t to = steady_ns();
  for (Message* m : {&send, &recv}) {
    m->copied_from.store(from, std::memory_order_release);
    m->copied_to.store(to, std::memory_order_release);
  }
  send.state.store(Message::done);
  recv.state.store(Message::done);
  world->wake(send_owner);
  world->wake(recv_owner);
}

/// Matches `msg` against the opposite queue of its mailbox — the oldest message from or to
/// the same peer, whatever its tag — or queues it.
void post(Message& msg) {
  Group& g = *msg.group;
  Mailbox& box = g.boxes[static_cast<std::size_t>(msg.is_send ? msg.peer : msg.me)];
  Message* partner = nullptr;
  {
    std::lock_guard<std::mutex> lock(box.m);
    auto& others = msg.is_send ? box.recvs : box.sends;
    for (auto it = others.begin(); it != others.end(); ++it) {
      Message* o = *it;
      // A queued recv o waits for a send from o->peer; a queued send o came from o->me.
      if (msg.is_send ? o->peer == msg.me : o->me == msg.peer) {
        partner = o;
        others.erase(it);
        break;
      }
    }
    if (partner) {
      partner->state.store(Message::matched);
      msg.state.store(Message::matched);
    } else {
      (msg.is_send ? box.sends : box.recvs).push_back(&msg);
    }
  }
  if (partner) msg.is_send ? complete(msg, *partner) : complete(*partner, msg);
}

// ---------------------------------------------------------------------------
// Non-blocking collectives: a task for the rank's progress thread.

struct Task {
  Slot::Call call;
  bool counted = true;  // counted when started (not under Uncounted)
  int device = -1;      // the rank's CUDA device, for the progress thread
  std::atomic<bool> done{false};
  std::exception_ptr error;
  Traffic traffic;
  std::int64_t began = 0,
               ended = 0;  // the progress thread's run, steady-clock ns (read after done)
};

struct AsyncCollective final : Request::Impl {
  std::shared_ptr<Task> task;
  std::shared_ptr<WorldState> world;
  int world_rank = 0;
  std::pair<std::int64_t, std::int64_t> ran() const override {
    if (!task || !task->done.load(std::memory_order_acquire)) return {0, 0};
    return {task->began, task->ended};
  }
  ~AsyncCollective() override {
    // Other ranks may be reading this rank's buffers: wait until the collective is over
    // (it ends by itself: every wait inside it has the timeout, and an abort stops it).
    if (task && !task->done.load())
      while (!task->done.load()) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
};

// ---------------------------------------------------------------------------
// The communicator

class ThreadComm final : public Communicator {
 public:
  ThreadComm(std::shared_ptr<Group> group, int rank, std::chrono::milliseconds timeout)
      : Communicator(rank, group->size(), timeout), g_(std::move(group)) {}

  ~ThreadComm() override {
    if (!progress_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(queue_m_);
      stopping_ = true;
    }
    queue_cv_.notify_all();
    progress_.join();  // the queued collectives run first (they end by timeout or abort)
  }

  std::string_view backend() const override { return "threads"; }
  void check_not_aborted() const override {
    if (g_->world->aborted.load()) g_->world->throw_aborted(g_->world_rank(rank()));
  }

 protected:
  Request isend_impl(const void* buf, std::size_t bytes, Memory mem, int peer, int tag) override {
    settle(mem);
    auto msg = make_message(true, peer, tag, bytes);
    msg->src = buf;
    msg->mem = mem;
    post(*msg);
    return Request(std::move(msg));
  }

  Request irecv_impl(void* buf, std::size_t bytes, Memory mem, int peer, int tag) override {
    settle(mem);
    auto msg = make_message(false, peer, tag, bytes);
    msg->dst = buf;
    msg->mem = mem;
    post(*msg);
    return Request(std::move(msg));
  }

  void wait_impl(Request::Impl& request) override {
    if (auto* async = dynamic_cast<AsyncCollective*>(&request)) return finish(*async);
    auto& msg = static_cast<Message&>(request);
    const bool finished = g_->world->wait_until(
        me_world(), [&] { return msg.state.load(std::memory_order_acquire) == Message::done; },
        deadline());
    if (!finished) {
      if (!msg.is_send) {
        Mailbox& box = g_->boxes[static_cast<std::size_t>(rank())];
        std::lock_guard<std::mutex> lock(box.m);
        for (const auto& [from, tag] : box.withdrawn)
          if (from == msg.peer)
            throw CommError("rank " + std::to_string(rank()) + ": " + msg.describe() + " waited " +
                            format_seconds(timeout()) + " (--timeout): rank " +
                            std::to_string(from) + " posted an isend to it (tag " +
                            std::to_string(tag) +
                            ") but dropped its Request without waiting for it, which withdrew "
                            "the message: keep the Request and wait() for it");
      }
      const std::string hint =
          msg.is_send
              ? "rank " + std::to_string(msg.peer) +
                    " never posted a matching recv (a blocking send waits for its "
                    "receiver: when both sides send first, use sendrecv or isend)"
              : "no matching send came; is rank " + std::to_string(msg.peer) + " sending to rank " +
                    std::to_string(rank()) + " with tag " + std::to_string(msg.tag) + "?";
      throw CommError("rank " + std::to_string(rank()) + ": " + msg.describe() + " waited " +
                      format_seconds(timeout()) + " (--timeout): " + hint);
    }
    if (!msg.error.empty()) throw CommError("rank " + std::to_string(rank()) + ": " + msg.error);
  }

  void run_collective(const Collective& c) override {
    drain();  // pending non-blocking collectives come first
    settle(c.memory);
    Traffic t;
    run(c, t);
    count_traffic(c.op, t);
  }

  Request start_collective(Collective c) override {
    settle(c.memory);  // the rank's GPU work on these buffers is done before they are read
    auto task = std::make_shared<Task>();
    task->call = std::move(c);
    task->counted = counting();
    task->device = task->call.memory == Memory::device ? cuda::current_device() : -1;
    start_progress_thread();
    {
      std::lock_guard<std::mutex> lock(queue_m_);
      queue_.push_back(task);
      ++pending_;
    }
    queue_cv_.notify_all();
    auto request = std::make_unique<AsyncCollective>();
    request->task = std::move(task);
    request->world = g_->world;
    request->world_rank = me_world();
    return Request(std::move(request));
  }

  std::unique_ptr<Communicator> split_impl(int color, int key) override {
    drain();
    Slot s;
    s.is_split = true;
    s.color = color;
    s.key = key;
    std::shared_ptr<Group> group;
    int new_rank = 0;
    Traffic unused;
    post_and_run(std::move(s), unused, [&](Traffic&) {
      // Members of my color, ordered by (key, rank); the first one creates the group.
      std::vector<int> same;
      for (int q = 0; q < size(); ++q)
        if (slot(q).color == color) same.push_back(q);
      std::stable_sort(same.begin(), same.end(),
                       [&](int a, int b) { return slot(a).key < slot(b).key; });
      new_rank = static_cast<int>(std::find(same.begin(), same.end(), rank()) - same.begin());
      if (new_rank == 0) {
        std::vector<int> world_ranks;
        for (int q : same) world_ranks.push_back(g_->world_rank(q));
        g_->slots[static_cast<std::size_t>(rank())].made =
            std::make_shared<Group>(g_->world, std::move(world_ranks));
      }
      sync(slot(rank()));
      group = slot(same.front()).made;
    });
    g_->slots[static_cast<std::size_t>(rank())].made.reset();
    return std::make_unique<ThreadComm>(std::move(group), new_rank, timeout());
  }

 private:
  struct Bytes {
    std::size_t offset = 0;
    std::size_t length = 0;
  };

  int me_world() const { return g_->world_rank(rank()); }
  /// For the waits of the rank's own thread (wait, wait_all: one shared deadline).
  Clock::time_point deadline() const { return wait_deadline(); }
  /// For the waits inside a collective, which the progress thread runs too: one
  /// timeout from now, touching nothing the rank's thread writes.
  Clock::time_point call_deadline() const { return Clock::now() + timeout(); }
  const Slot& slot(int q) const { return g_->slots[static_cast<std::size_t>(q)]; }
  const Slot::Call& call(int q) const { return slot(q).call; }

  std::unique_ptr<Message> make_message(bool is_send, int peer, int tag, std::size_t bytes) {
    auto msg = std::make_unique<Message>();
    msg->group = g_;
    msg->is_send = is_send;
    msg->me = rank();
    msg->peer = peer;
    msg->tag = tag;
    msg->bytes = bytes;
    return msg;
  }

  /// Another rank's thread will read or write this rank's device buffer on its own
  /// stream: let this rank's queued GPU work on it (a matmul writing it, a kernel reading
  /// it) finish first.
  static void settle(Memory mem) {
    if (mem == Memory::device) kernels::synchronize();
  }

  // -- traffic: what this rank reads from, or writes into, rank q's memory ----------
  void read_from(int q, std::size_t bytes, Traffic& t) const {
    if (q == rank() || bytes == 0) return;
    t.received += bytes;
    g_->remote_sent[static_cast<std::size_t>(q)].fetch_add(bytes, std::memory_order_relaxed);
  }
  void write_into(int q, std::size_t bytes, Traffic& t) const {
    if (q == rank() || bytes == 0) return;
    t.sent += bytes;
    g_->remote_received[static_cast<std::size_t>(q)].fetch_add(bytes, std::memory_order_relaxed);
  }
  /// Copies `bytes` from rank `from`'s memory to rank `to`'s, counting it.
  void move(void* dst, int to, const void* src, int from, std::size_t bytes, Memory mem,
            Traffic& t) const {
    copy_bytes(dst, src, bytes, mem);
    read_from(from, bytes, t);
    write_into(to, bytes, t);
  }

  Bytes chunk(std::size_t count, std::size_t elem, int q) const {
    const ShardRange r = shard_range(static_cast<std::int64_t>(count), size(), q);
    return {static_cast<std::size_t>(r.offset) * elem, static_cast<std::size_t>(r.length) * elem};
  }

  // -- one collective ----------------------------------------------------------------

  /// Runs `k` as this rank (on its own thread, or on its progress thread).
  void run(const Slot::Call& k, Traffic& t) {
    Slot s;
    s.call = k;
    post_and_run(std::move(s), t, [&](Traffic& traffic) { work(k, traffic); });
  }

  void work(const Slot::Call& k, Traffic& t) {
    const std::size_t elem = dtype_size(k.type);
    const int N = size(), r = rank();
    auto in = [&](int q) { return static_cast<const char*>(call(q).in); };
    auto out = [&](int q) { return static_cast<char*>(call(q).out); };
    switch (k.op) {
      case Op::barrier:
        return;
      case Op::allreduce: {
        if (N == 1) return;  // avg over one rank: the buffer is the answer
        // 1. reduce-scatter: reduce chunk r of every rank's buffer, in rank order (so the
        //    result does not depend on who reduces), into this rank's own buffer.
        const Bytes mine = chunk(k.count, elem, r);
        reduce_chunk(k, mine, static_cast<char*>(k.out) + mine.offset, t);
        sync(slot(rank()));
        // 2. all-gather: copy every other rank's reduced chunk out of its buffer.
        for (int q = 0; q < N; ++q) {
          if (q == r) continue;
          const Bytes c = chunk(k.count, elem, q);
          move(static_cast<char*>(k.out) + c.offset, r, out(q) + c.offset, q, c.length, k.memory,
               t);
        }
        return;
      }
      case Op::reduce: {
        if (N == 1) return;
        // Reduce-scatter as in allreduce, each rank writing its reduced chunk into root's
        // buffer (only this rank touches that chunk there, so no one reads it after).
        const Bytes mine = chunk(k.count, elem, r);
        reduce_chunk(k, mine, out(k.root) + mine.offset, t);
        write_into(k.root, mine.length, t);
        return;
      }
      case Op::broadcast:
        if (r != k.root) move(k.out, r, in(k.root), k.root, k.count * elem, k.memory, t);
        return;
      case Op::reduce_scatter: {
        const Bytes mine = chunk(k.count, elem, r);
        if (N == 1) return copy_bytes(k.out, k.in, mine.length, k.memory);
        reduce_chunk(k, mine, static_cast<char*>(k.out), t);
        return;
      }
      case Op::allgather:
      case Op::gather: {
        if (k.op == Op::gather && r != k.root) return;
        std::size_t offset = 0;
        for (int q = 0; q < N; ++q) {
          const std::size_t n = k.counts[static_cast<std::size_t>(q)] * elem;
          move(static_cast<char*>(k.out) + offset, r, in(q), q, n, k.memory, t);
          offset += n;
        }
        return;
      }
      case Op::alltoall: {
        // Block r of every rank's `in` lands in block q of mine, in rank order.
        std::size_t at = 0;
        for (int q = 0; q < N; ++q) {
          std::size_t from = 0, n = k.count;  // where rank q keeps its block for me
          if (k.vector) {
            const auto& sent = call(q).counts;
            from = std::accumulate(sent.begin(), sent.begin() + r, std::size_t{0});
            n = sent[static_cast<std::size_t>(r)];
          } else {
            from = static_cast<std::size_t>(r) * k.count;
          }
          move(static_cast<char*>(k.out) + at * elem, r, in(q) + from * elem, q, n * elem, k.memory,
               t);
          at += n;
        }
        return;
      }
      default:
        throw Error("threads backend: no collective " + std::string(op_name(k.op)));
    }
  }

  /// dst = op over q = 0..N-1 of chunk c of rank q's input, in rank order
  /// (reduce_in_rank_order, on the host). dst may be one of the inputs.
  void reduce_chunk(const Slot::Call& k, Bytes c, void* dst, Traffic& t) {
    for (int q = 0; q < size(); ++q) read_from(q, c.length, t);
    if (c.length == 0) return;
    const std::size_t elem = dtype_size(k.type);
    const std::size_t n = c.length / elem;
    auto source = [&](int q) { return static_cast<const char*>(call(q).in) + c.offset; };
    if (k.memory == Memory::device) return reduce_chunk_on_device(k, n, source, dst);
    std::vector<const void*> sources;
    for (int q = 0; q < size(); ++q) sources.push_back(source(q));
    reduce_in_rank_order(dst, sources, n, k.type, k.reduce);
  }

  /// The same on the device: stage each rank's chunk into this rank's GPU (it may live on
  /// another), add with a kernel, in rank order.
  template <class Source>
  void reduce_chunk_on_device(const Slot::Call& k, std::size_t n, Source&& source, void* dst) {
    const bool half = is_half(k.type);
    const DType acc_type = half ? DType::f32 : k.type;
    const auto count = static_cast<std::int64_t>(n);
    Tensor& acc = scratch(0, count, acc_type);
    Tensor& staged = scratch(1, count, k.type);
    Tensor& widened = scratch(2, half ? count : 0, DType::f32);
    for (int q = 0; q < size(); ++q) {
      kernels::copy(staged.raw(), source(q), n * dtype_size(k.type));
      const void* x = staged.raw();
      if (half) {
        kernels::cast(staged.raw(), k.type, q == 0 ? acc.raw() : widened.raw(), DType::f32, count);
        x = widened.raw();
      } else if (q == 0) {
        kernels::copy(acc.raw(), staged.raw(), n * dtype_size(k.type));
      }
      if (q > 0) kernels::reduce_into(acc.raw(), x, n, acc_type, k.reduce);
    }
    kernels::finish_reduce(acc.raw(), n, acc_type, k.reduce, size());
    if (half)
      kernels::cast(acc.raw(), DType::f32, dst, k.type, count);
    else
      kernels::copy(dst, acc.raw(), n * dtype_size(k.type));
  }

  /// Device buffers kept between collectives (a cudaMalloc per call would wait for the
  /// whole device): slot i holds at least n elements of `type`.
  Tensor& scratch(int i, std::int64_t n, DType type) {
    Tensor& s = scratch_[static_cast<std::size_t>(i)];
    if (s.dtype() != type || s.size() < n || !s.on_device())
      s = empty(Shape{std::max<std::int64_t>(n, 1)}, type, Memory::device);
    return s;
  }

  /// Posts `mine`, meets the others, checks that everyone called the same collective,
  /// runs `work`, and meets again (so no one returns while its buffers are being read);
  /// then collects what the others counted against this rank's memory.
  template <class Work>
  void post_and_run(Slot mine, Traffic& t, Work&& work) {
    g_->slots[static_cast<std::size_t>(rank())] = std::move(mine);
    const Slot& posted = slot(rank());
    sync(posted);
    for (int q = 1; q < size(); ++q) {
      if (!slot(q).agrees_with(slot(0))) {
        throw CommError("rank " + std::to_string(rank()) + ": collective mismatch: rank 0 called " +
                        slot(0).describe() + " but rank " + std::to_string(q) + " called " +
                        slot(q).describe() +
                        " (every rank must make the same collective calls, "
                        "in the same order, with the same counts)");
      }
    }
    check_alltoallv_counts();
    work(t);
    sync(posted);
    t.sent += g_->remote_sent[static_cast<std::size_t>(rank())].exchange(0);
    t.received += g_->remote_received[static_cast<std::size_t>(rank())].exchange(0);
  }

  /// alltoallv: what rank p sends to rank q must be what q expects from p (every rank
  /// checks every pair, so all of them report it).
  void check_alltoallv_counts() const {
    const Slot& first = slot(0);
    if (first.is_split || first.call.op != Op::alltoall || !first.call.vector) return;
    for (int p = 0; p < size(); ++p)
      for (int q = 0; q < size(); ++q) {
        const std::size_t sends = call(p).counts[static_cast<std::size_t>(q)];
        const std::size_t expects = call(q).recv_counts[static_cast<std::size_t>(p)];
        if (sends != expects)
          throw CommError("rank " + std::to_string(rank()) + ": alltoallv mismatch: rank " +
                          std::to_string(p) + " sends " + std::to_string(sends) +
                          " elements to rank " + std::to_string(q) + ", but rank " +
                          std::to_string(q) + " expects " + std::to_string(expects) +
                          " from it (exchange the counts first)");
      }
  }

  /// A barrier over the group, with the timeout and a diagnostic naming who is missing
  /// and which call (`mine`, this rank's slot) it waited in.
  void sync(const Slot& mine) {
    Group& g = *g_;
    std::uint64_t gen = 0;
    {
      std::lock_guard<std::mutex> lock(g.m);
      gen = g.generation.load();
      g.arrivals[static_cast<std::size_t>(rank())] = gen + 1;
      if (++g.arrived == size()) {
        g.arrived = 0;
        g.generation.store(gen + 1);
        for (int q = 0; q < size(); ++q)
          if (q != rank()) g.world->wake(g.world_rank(q));
        return;
      }
    }
    const bool met = g.world->wait_until(
        me_world(), [&] { return g.generation.load(std::memory_order_acquire) != gen; },
        call_deadline());
    if (met) return;
    std::string missing;
    {
      std::lock_guard<std::mutex> lock(g.m);
      if (g.generation.load() != gen) return;  // the last one arrived just now
      // Withdraw this rank from the count: it is leaving, and a late rank must not complete
      // the barrier with it. (Its arrival stays on record for the others' diagnosis.)
      --g.arrived;
      for (int q = 0; q < size(); ++q)
        if (g.arrivals[static_cast<std::size_t>(q)] != gen + 1)
          missing += (missing.empty() ? "" : ", ") + std::to_string(q);
    }
    // Every rank on record yet the call not met: one of them gave up (its own timeout) and
    // left before the last arrived.
    const std::string who = missing.empty()
                                ? "the others (each arrived, but one gave up before the last came)"
                                : "rank(s) " + missing;
    throw CommError("rank " + std::to_string(rank()) + ": " + mine.describe() + " waited " +
                    format_seconds(timeout()) + " (--timeout) for " + who +
                    " to join; did they skip the call, or are they blocked elsewhere?");
  }

  // -- the progress thread -------------------------------------------------------------

  /// SHARDLAB_COLLECTIVE_DELAY_MS, read once: how late each non-blocking collective starts.
  static std::chrono::microseconds collective_delay() {
    static const std::chrono::microseconds late = [] {
      const char* ms = std::getenv("SHARDLAB_COLLECTIVE_DELAY_MS");
      const double value = ms ? std::strtod(ms, nullptr) : 0.0;
      return std::chrono::microseconds(
          value > 0 && value < 1e6 ? static_cast<std::int64_t>(value * 1000) : 0);
    }();
    return late;
  }

  void start_progress_thread() {
    if (progress_.joinable()) return;
    progress_ = std::thread([this] { progress_loop(); });
  }

  void progress_loop() {
    for (;;) {
      std::shared_ptr<Task> task;
      {
        std::unique_lock<std::mutex> lock(queue_m_);
        queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, nothing left
        task = queue_.front();
        queue_.pop_front();
      }
      if (const std::chrono::microseconds late = collective_delay(); late.count() > 0)
        std::this_thread::sleep_for(late);  // a slow link (comm_threads.hpp)
      task->began = steady_ns();
      try {
        if (task->device >= 0) cuda::set_device(task->device);
        run(task->call, task->traffic);
      } catch (...) {
        task->error = std::current_exception();
      }
      task->ended = steady_ns();
      task->done.store(true, std::memory_order_release);
      --pending_;
      g_->world->wake(me_world());
    }
  }

  /// Waits for a non-blocking collective, counts its traffic, rethrows its error.
  void finish(AsyncCollective& request) {
    Task& task = *request.task;
    // The collective ends by itself (its waits have the timeout); wait as long as it runs.
    while (!g_->world->wait_until(
        me_world(), [&] { return task.done.load(std::memory_order_acquire); }, deadline())) {
    }
    if (task.error) std::rethrow_exception(task.error);
    if (task.counted) record_traffic(task.call.op, task.traffic);
  }

  /// Lets the pending non-blocking collectives finish (a blocking one comes after them).
  void drain() {
    while (pending_.load() > 0)
      g_->world->wait_until(
          me_world(), [&] { return pending_.load(std::memory_order_acquire) == 0; }, deadline());
  }

  std::shared_ptr<Group> g_;
  std::array<Tensor, 3> scratch_;
  std::thread progress_;
  std::mutex queue_m_;
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<Task>> queue_;
  std::atomic<int> pending_{0};
  bool stopping_ = false;
};

}  // namespace

// ---------------------------------------------------------------------------

ThreadWorld::ThreadWorld(int ranks, std::chrono::milliseconds timeout) {
  require(ranks >= 1, "the threads backend needs at least 1 rank");
  state_ = std::make_shared<State>(ranks, timeout);
  std::vector<int> world_ranks(static_cast<std::size_t>(ranks));
  std::iota(world_ranks.begin(), world_ranks.end(), 0);
  world_group_ = std::make_shared<Group>(state_, std::move(world_ranks));
}

ThreadWorld::~ThreadWorld() = default;

int ThreadWorld::size() const { return state_->size; }

std::unique_ptr<Communicator> ThreadWorld::communicator(int rank) {
  require(rank >= 0 && rank < state_->size,
          [&] { return "ThreadWorld: no rank " + std::to_string(rank); });
  return std::make_unique<ThreadComm>(std::static_pointer_cast<Group>(world_group_), rank,
                                      state_->timeout);
}

void ThreadWorld::abort(const std::string& reason) { state_->abort(reason); }

bool ThreadWorld::aborted() const { return state_->aborted.load(); }

namespace {
/// The ranks still running once the job has ended: a rank busy computing notices an
/// abort only at its next call, and one in an endless loop never does. After `grace`
/// the process ends, saying which ranks, rather than wait on them for ever.
[[noreturn]] void end_with_stuck_ranks(const std::string& prefix,
                                       const std::vector<std::exception_ptr>& errors,
                                       const std::vector<int>& stuck,
                                       std::chrono::milliseconds grace) {
  for (const std::exception_ptr& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const CommAborted&) {
    } catch (const std::exception& x) {
      std::fprintf(stderr, "%s%s\n", prefix.c_str(), x.what());
      break;
    } catch (...) {
    }
  }
  std::string list;
  for (std::size_t i = 0; i < stuck.size() && i < 8; ++i)
    list += (i ? ", " : "") + std::to_string(stuck[i]);
  if (stuck.size() > 8) list += " and " + std::to_string(stuck.size() - 8) + " more";
  std::fprintf(stderr,
               "%sthe job failed, but rank%s %s did not stop within %s (busy computing, or in "
               "an endless loop?): ending the process\n",
               prefix.c_str(), stuck.size() > 1 ? "s" : "", list.c_str(),
               format_seconds(grace).c_str());
  std::fflush(nullptr);
  std::_Exit(1);
}
}  // namespace

std::vector<std::exception_ptr> run_ranks(int ranks, std::chrono::milliseconds timeout,
                                          const std::function<void(Communicator&)>& body,
                                          const std::string& program) {
  ThreadWorld world(ranks, timeout);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < ranks; ++r) comms.push_back(world.communicator(r));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  std::mutex done_mutex;
  std::condition_variable done_cv;
  std::vector<char> done(static_cast<std::size_t>(ranks), 0);
  std::string failed_to_start;
  for (int r = 0; r < ranks; ++r) {
    try {
      threads.emplace_back([&, r] {
        try {
          body(*comms[static_cast<std::size_t>(r)]);
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
          world.abort("rank " + std::to_string(r) + " failed");
        }
        {
          std::lock_guard<std::mutex> lock(done_mutex);
          done[static_cast<std::size_t>(r)] = 1;
        }
        done_cv.notify_all();
      });
    } catch (const std::system_error& e) {
      failed_to_start = "could start only " + std::to_string(r) + " of " + std::to_string(ranks) +
                        " rank threads (" + e.what() + "): use fewer ranks";
      world.abort(failed_to_start);
      break;
    }
  }
  // Wait for every rank; once the job has ended, for at most `timeout` more.
  {
    const auto started = static_cast<std::size_t>(threads.size());
    auto all_done = [&] {
      return std::all_of(done.begin(), done.begin() + static_cast<std::ptrdiff_t>(started),
                         [](char d) { return d != 0; });
    };
    std::unique_lock<std::mutex> lock(done_mutex);
    while (!all_done()) {
      if (!world.aborted()) {
        done_cv.wait_for(lock, std::chrono::milliseconds(20));
        continue;
      }
      if (!done_cv.wait_for(lock, timeout, all_done)) {
        std::vector<int> stuck;
        std::vector<std::exception_ptr> finished_errors;  // only the finished ranks' are set
        for (std::size_t r = 0; r < started; ++r)
          if (done[r])
            finished_errors.push_back(errors[r]);
          else
            stuck.push_back(static_cast<int>(r));
        end_with_stuck_ranks(program.empty() ? program : program + ": ", finished_errors, stuck,
                             timeout);
      }
    }
  }
  for (std::thread& t : threads) t.join();
  comms.clear();  // progress threads end here, before the world goes
  if (!failed_to_start.empty()) throw Error(failed_to_start);
  return errors;
}

void run_threads(int ranks, const std::function<void(Communicator&)>& body,
                 std::chrono::milliseconds timeout) {
  const std::vector<std::exception_ptr> errors = run_ranks(ranks, timeout, body);
  // The first-hand error wins over the CommAborted of the ranks it stopped.
  std::exception_ptr aborted;
  for (const std::exception_ptr& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const CommAborted&) {
      if (!aborted) aborted = e;
    } catch (...) {
      std::rethrow_exception(e);
    }
  }
  if (aborted) std::rethrow_exception(aborted);
}

}  // namespace shardlab
