// The threads backend (see comm_threads.hpp).
//
// Waiting: every rank has one Waiter (a mutex and a condition variable). Whoever
// completes something a rank waits for (a message copied, the last arrival at a
// barrier) wakes that rank's Waiter; ThreadWorld::abort wakes them all. A wait spins
// briefly first (most waits are short), then sleeps until its deadline.
#include "shardlab/comm_threads.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <numeric>
#include <thread>

#include "shardlab/check.hpp"
#include "shardlab/cuda.hpp"
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
  if (bytes == 0) return;
  if (mem == Memory::device)
    cuda::copy(dst, src, bytes);
  else
    std::memcpy(dst, src, bytes);
}

std::string seconds(std::chrono::milliseconds t) {
  return format_number(static_cast<double>(t.count()) / 1000.0, 3) + " s";
}
}  // namespace

struct ThreadWorld::State {
  int size;
  std::chrono::milliseconds timeout;
  std::vector<std::unique_ptr<Waiter>> waiters;  // one per world rank
  std::atomic<bool> aborted{false};
  std::mutex reason_mutex;
  std::string reason;

  // Spinning only pays when every rank has a core of its own; otherwise a spinning rank
  // takes the core from the rank it waits for.
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
  std::string error;  // set before `done` when sizes disagree

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
};

/// What a rank posts when it enters a collective, for the others to read.
struct Slot {
  Op op = Op::barrier;
  std::size_t count = 0;
  DType type = DType::f32;
  ReduceOp reduce = ReduceOp::sum;
  int root = 0;
  const void* in = nullptr;
  void* out = nullptr;
  std::vector<std::size_t> counts;  // allgatherv / gatherv
  Memory mem = Memory::host;
  int color = 0, key = 0;       // split
  std::shared_ptr<Group> made;  // split: the group its color's leader created

  bool is_split = false;

  std::string describe() const {
    if (is_split)
      return "split(color " + std::to_string(color) + ", key " + std::to_string(key) + ")";
    std::string s = std::string(op_name(op)) + "(";
    if (op == Op::barrier) return s + ")";
    if (!counts.empty()) {
      s += "counts [";
      for (std::size_t i = 0; i < counts.size(); ++i)
        s += (i ? " " : "") + std::to_string(counts[i]);
      s += "] x ";
    } else {
      s += std::to_string(count) + " x ";
    }
    s += dtype_name(type);
    if (mem == Memory::device) s += " on device";
    if (op == Op::allreduce || op == Op::reduce || op == Op::reduce_scatter)
      s += ", " + std::string(reduce_op_name(reduce));
    if (op == Op::reduce || op == Op::broadcast || op == Op::gather)
      s += ", root " + std::to_string(root);
    return s + ")";
  }
  bool agrees_with(const Slot& o) const {
    return op == o.op && is_split == o.is_split && count == o.count && type == o.type &&
           reduce == o.reduce && root == o.root && counts == o.counts && mem == o.mem;
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

  Group(std::shared_ptr<WorldState> w, std::vector<int> world_ranks)
      : world(std::move(w)),
        members(std::move(world_ranks)),
        boxes(new Mailbox[members.size()]),
        slots(members.size()),
        arrivals(members.size(), 0) {}
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
      return;
    }
  }
  while (state.load() != done) cpu_relax();  // matched: the copy is short and cannot block
}

void complete(Message& send, Message& recv) {
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
  }
  const std::shared_ptr<WorldState> world = send.group->world;
  const int send_owner = send.group->world_rank(send.me);
  const int recv_owner = recv.group->world_rank(recv.me);
  send.state.store(Message::done);
  recv.state.store(Message::done);
  world->wake(send_owner);
  world->wake(recv_owner);
}

/// Matches `msg` against the opposite queue of its mailbox, or queues it.
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
      const bool match = msg.is_send ? (o->peer == msg.me && o->tag == msg.tag)
                                     : (o->me == msg.peer && o->tag == msg.tag);
      if (match) {
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
// The communicator

class ThreadComm final : public Communicator {
 public:
  ThreadComm(std::shared_ptr<Group> group, int rank, std::chrono::milliseconds timeout)
      : Communicator(rank, group->size(), timeout), g_(std::move(group)) {}

  std::string_view backend() const override { return "threads"; }

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
    auto& msg = static_cast<Message&>(request);
    const bool finished = g_->world->wait_until(
        me_world(), [&] { return msg.state.load(std::memory_order_acquire) == Message::done; },
        deadline());
    if (!finished) {
      const std::string hint =
          msg.is_send
              ? "rank " + std::to_string(msg.peer) +
                    " never posted a matching recv (a blocking send waits for its "
                    "receiver: when both sides send first, use sendrecv or isend)"
              : "no matching send came; is rank " + std::to_string(msg.peer) + " sending to rank " +
                    std::to_string(rank()) + " with tag " + std::to_string(msg.tag) + "?";
      throw CommError("rank " + std::to_string(rank()) + ": " + msg.describe() + " waited " +
                      seconds(timeout()) + " (--timeout): " + hint);
    }
    if (!msg.error.empty()) throw CommError("rank " + std::to_string(rank()) + ": " + msg.error);
  }

  void allreduce_impl(void* buf, std::size_t count, DType type, Memory mem, ReduceOp op) override {
    const std::size_t elem = dtype_size(type);
    count_collective_traffic(Op::allreduce, count, elem);
    if (size() == 1) return;  // avg over one rank: nothing to divide
    run(make_slot(Op::allreduce, count, type, op, 0, buf, buf, mem), [&] {
      // 1. reduce-scatter: this rank reduces chunk `rank` of every rank's buffer, in rank
      //    order (so the result does not depend on who reduces), into its own buffer.
      const Bytes mine = chunk(count, elem, rank());
      reduce_chunk(
          mine, type, op, mem, [&](int q) { return slot(q).in; },
          static_cast<char*>(buf) + mine.offset);
      sync("allreduce");
      // 2. all-gather: copy every other rank's reduced chunk out of its buffer.
      for (int q = 0; q < size(); ++q) {
        if (q == rank()) continue;
        const Bytes c = chunk(count, elem, q);
        copy_bytes(static_cast<char*>(buf) + c.offset,
                   static_cast<const char*>(slot(q).out) + c.offset, c.length, mem);
      }
    });
  }

  void reduce_impl(void* buf, std::size_t count, DType type, Memory mem, ReduceOp op,
                   int root) override {
    check_root(root, "reduce");
    const std::size_t elem = dtype_size(type);
    count_collective_traffic(Op::reduce, count, elem, root);
    if (size() == 1) return;
    run(make_slot(Op::reduce, count, type, op, root, buf, buf, mem), [&] {
      // Reduce-scatter as in allreduce, each rank writing its reduced chunk into root's
      // buffer (only this rank touches that chunk there, so no one reads it after).
      const Bytes mine = chunk(count, elem, rank());
      reduce_chunk(
          mine, type, op, mem, [&](int q) { return slot(q).in; },
          static_cast<char*>(slot(root).out) + mine.offset);
    });
  }

  void broadcast_impl(void* buf, std::size_t count, DType type, Memory mem, int root) override {
    check_root(root, "broadcast");
    count_collective_traffic(Op::broadcast, count, dtype_size(type), root);
    if (size() == 1) return;
    run(make_slot(Op::broadcast, count, type, ReduceOp::sum, root, buf, buf, mem), [&] {
      if (rank() != root) copy_bytes(buf, slot(root).in, count * dtype_size(type), mem);
    });
  }

  void reduce_scatter_impl(const void* in, void* out, std::size_t count, DType type, Memory mem,
                           ReduceOp op) override {
    const std::size_t elem = dtype_size(type);
    count_collective_traffic(Op::reduce_scatter, count, elem);
    run(make_slot(Op::reduce_scatter, count, type, op, 0, in, out, mem), [&] {
      const Bytes block{static_cast<std::size_t>(rank()) * count * elem, count * elem};
      reduce_chunk(
          block, type, op, mem, [&](int q) { return slot(q).in; }, static_cast<char*>(out));
    });
  }

  void allgatherv_impl(const void* in, void* out, std::span<const std::size_t> counts, DType type,
                       Memory mem) override {
    const std::size_t elem = dtype_size(type);
    count_traffic(Op::allgather, collective_traffic(Op::allgather, counts, elem, rank(), 0));
    Slot s = make_slot(Op::allgather, 0, type, ReduceOp::sum, 0, in, out, mem);
    s.counts.assign(counts.begin(), counts.end());
    run(std::move(s), [&] {
      std::size_t offset = 0;
      for (int q = 0; q < size(); ++q) {
        const std::size_t n = counts[static_cast<std::size_t>(q)] * elem;
        copy_bytes(static_cast<char*>(out) + offset, slot(q).in, n, mem);
        offset += n;
      }
    });
  }

  void gatherv_impl(const void* in, void* out, std::span<const std::size_t> counts, DType type,
                    Memory mem, int root) override {
    check_root(root, "gatherv");
    const std::size_t elem = dtype_size(type);
    count_traffic(Op::gather, collective_traffic(Op::gather, counts, elem, rank(), root));
    Slot s = make_slot(Op::gather, 0, type, ReduceOp::sum, root, in, out, mem);
    s.counts.assign(counts.begin(), counts.end());
    run(std::move(s), [&] {
      if (rank() != root) return;
      std::size_t offset = 0;
      for (int q = 0; q < size(); ++q) {
        const std::size_t n = counts[static_cast<std::size_t>(q)] * elem;
        copy_bytes(static_cast<char*>(out) + offset, slot(q).in, n, mem);
        offset += n;
      }
    });
  }

  void alltoall_impl(const void* in, void* out, std::size_t block, DType type,
                     Memory mem) override {
    const std::size_t elem = dtype_size(type);
    count_collective_traffic(Op::alltoall, block, elem);
    run(make_slot(Op::alltoall, block, type, ReduceOp::sum, 0, in, out, mem), [&] {
      const std::size_t b = block * elem;
      for (int q = 0; q < size(); ++q)
        copy_bytes(static_cast<char*>(out) + q * b,
                   static_cast<const char*>(slot(q).in) + rank() * b, b, mem);
    });
  }

  void barrier_impl() override {
    if (size() == 1) return;
    run(make_slot(Op::barrier, 0, DType::u8, ReduceOp::sum, 0, nullptr, nullptr), [] {});
  }

  std::unique_ptr<Communicator> split_impl(int color, int key) override {
    Slot s = make_slot(Op::barrier, 0, DType::u8, ReduceOp::sum, 0, nullptr, nullptr);
    s.is_split = true;
    s.color = color;
    s.key = key;
    std::shared_ptr<Group> group;
    int new_rank = 0;
    run(std::move(s), [&] {
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
      sync("split");
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
  Clock::time_point deadline() const { return Clock::now() + timeout(); }
  const Slot& slot(int q) const { return g_->slots[static_cast<std::size_t>(q)]; }

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

  Slot make_slot(Op op, std::size_t count, DType type, ReduceOp reduce, int root, const void* in,
                 void* out, Memory mem = Memory::host) const {
    Slot s;
    s.mem = mem;
    s.op = op;
    s.count = count;
    s.type = type;
    s.reduce = reduce;
    s.root = root;
    s.in = in;
    s.out = out;
    return s;
  }

  Bytes chunk(std::size_t count, std::size_t elem, int q) const {
    const ShardRange r = shard_range(static_cast<std::int64_t>(count), size(), q);
    return {static_cast<std::size_t>(r.offset) * elem, static_cast<std::size_t>(r.length) * elem};
  }

  void count_collective_traffic(Op op, std::size_t count, std::size_t elem, int root = 0) {
    count_traffic(op, collective_traffic(op, count, elem, rank(), size(), root));
  }

  /// dst = op over q = 0..N-1 of (source(q) + c.offset), c.length bytes, in rank order.
  /// Host: one pass over memory — each block is gathered into a small accumulator that
  /// stays in L1, then written out once. Device: the same with a device accumulator and
  /// reduction kernels. dst may be one of the sources (every source block is read before
  /// the block is written).
  template <class Source>
  void reduce_chunk(Bytes c, DType type, ReduceOp op, Memory mem, Source&& source, void* dst) {
    const std::size_t elem = dtype_size(type);
    if (mem == Memory::device) {
      if (c.length == 0) return;
      cuda::DeviceTensor acc(
          1, static_cast<std::int64_t>((c.length + sizeof(float) - 1) / sizeof(float)));
      cuda::copy(acc.data(), static_cast<const char*>(source(0)) + c.offset, c.length);
      for (int q = 1; q < size(); ++q)
        cuda::reduce_into(acc.data(), static_cast<const char*>(source(q)) + c.offset,
                          c.length / elem, type, op);
      cuda::finish_reduce(acc.data(), c.length / elem, type, op, size());
      cuda::copy(dst, acc.data(), c.length);
      return;
    }
    constexpr std::size_t block = 8192;  // bytes; a multiple of every element size
    alignas(64) char acc[block];
    for (std::size_t done = 0; done < c.length; done += block) {
      const std::size_t len = std::min(block, c.length - done);
      std::memcpy(acc, static_cast<const char*>(source(0)) + c.offset + done, len);
      for (int q = 1; q < size(); ++q)
        reduce_into(acc, static_cast<const char*>(source(q)) + c.offset + done, len / elem, type,
                    op);
      finish_reduce(acc, len / elem, type, op, size());
      std::memcpy(static_cast<char*>(dst) + done, acc, len);
    }
  }

  /// Posts `mine`, meets the others, checks that everyone called the same collective,
  /// runs `work`, and meets again (so no one returns while its buffers are being read).
  /// Another rank's thread will read or write this rank's device buffer on its own
  /// stream: let this rank's queued GPU work on it (a matmul writing it, a kernel reading
  /// it) finish first.
  static void settle(Memory mem) {
    if (mem == Memory::device) cuda::synchronize();
  }

  template <class Work>
  void run(Slot mine, Work&& work) {
    settle(mine.mem);
    const std::string what = mine.describe();
    g_->slots[static_cast<std::size_t>(rank())] = std::move(mine);
    sync(what);
    for (int q = 1; q < size(); ++q) {
      if (!slot(q).agrees_with(slot(0))) {
        throw CommError("rank " + std::to_string(rank()) + ": collective mismatch: rank 0 called " +
                        slot(0).describe() + " but rank " + std::to_string(q) + " called " +
                        slot(q).describe() +
                        " (every rank must make the same collective calls, "
                        "in the same order, with the same counts)");
      }
    }
    work();
    sync(what);
  }

  /// A barrier over the group, with the timeout and a diagnostic naming who is missing.
  void sync(const std::string& what) {
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
        deadline());
    if (met) return;
    std::string missing;
    {
      std::lock_guard<std::mutex> lock(g.m);
      for (int q = 0; q < size(); ++q)
        if (g.arrivals[static_cast<std::size_t>(q)] != gen + 1)
          missing += (missing.empty() ? "" : ", ") + std::to_string(q);
    }
    throw CommError("rank " + std::to_string(rank()) + ": " + what + " waited " +
                    seconds(timeout()) + " (--timeout) for rank(s) " + missing +
                    " to join; did they skip the call, or are they blocked elsewhere?");
  }

  std::shared_ptr<Group> g_;
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
  require(rank >= 0 && rank < state_->size, "ThreadWorld: no rank " + std::to_string(rank));
  return std::make_unique<ThreadComm>(std::static_pointer_cast<Group>(world_group_), rank,
                                      state_->timeout);
}

void ThreadWorld::abort(const std::string& reason) { state_->abort(reason); }

}  // namespace shardlab
