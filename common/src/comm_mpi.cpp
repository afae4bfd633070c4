// The MPI backend (see comm_mpi.hpp).
#include "shardlab/comm_mpi.hpp"

#include "shardlab/check.hpp"

#ifndef SHARDLAB_HAVE_MPI

namespace shardlab::mpi {
namespace {
[[noreturn]] void missing() {
  throw UsageError("this build has no MPI backend: install OpenMPI (libopenmpi-dev) and rebuild");
}
}  // namespace
bool available() { return false; }
void init(int*, char***, std::chrono::milliseconds, const std::string&) { missing(); }
void finalize() {}
void abort(int code) { std::exit(code); }
void end_job(int code) { std::exit(code); }
void fail(const std::string& line, int code, int) {
  std::fprintf(stderr, "%s\n", line.c_str());
  std::exit(code);
}
int world_rank() { return 0; }
int world_size() { return 1; }
std::vector<std::string> hosts() { return {}; }
std::unique_ptr<Communicator> world(std::chrono::milliseconds) { missing(); }
}  // namespace shardlab::mpi

#else

#include <dlfcn.h>
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>

#include "shardlab/half.hpp"
#include "shardlab/results.hpp"

namespace shardlab::mpi {

namespace {
using Clock = std::chrono::steady_clock;

bool initialized = false;
bool thread_multiple = false;

// The job's one report (fail): an int in rank 0's memory, 0 until a failing process claims
// it with an atomic compare-and-swap. Passive target: rank 0 need not take part.
MPI_Win report_window = MPI_WIN_NULL;

/// MPI_CHECK(call): an MPI error becomes a CommError naming the call, file and line.
void check(int code, const char* call, const char* file, int line) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw CommError(std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " +
                  std::string(text, static_cast<std::size_t>(length)));
}
#define MPI_CHECK(call) ::shardlab::mpi::check((call), #call, __FILE__, __LINE__)

// ---------------------------------------------------------------------------
// f16 and bf16: MPI has no such types, so each is a 2-byte type of our own, reduced by an
// operation of our own. Like NCCL, it rounds to the 16-bit type after every pairwise
// add (the threads backend adds everything in f32 and rounds once).

MPI_Datatype half_type = MPI_DATATYPE_NULL, bf16_type = MPI_DATATYPE_NULL;
MPI_Op half_ops[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};  // sum, max, min

template <int Which>  // 0 sum, 1 max, 2 min
void half_reduce(void* in, void* inout, int* len, MPI_Datatype* type) {
  const bool fp16 = *type == half_type;
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = fp16 ? half_bits_to_float(a[i]) : bf16_bits_to_float(a[i]);
    const float y = fp16 ? half_bits_to_float(b[i]) : bf16_bits_to_float(b[i]);
    float r = x + y;
    if constexpr (Which == 1) r = (x > y || x != x) ? x : y;
    if constexpr (Which == 2) r = (x < y || x != x) ? x : y;
    b[i] = fp16 ? float_to_half_bits(r) : float_to_bf16_bits(r);
  }
}

void create_half_types() {
  MPI_Type_contiguous(2, MPI_BYTE, &half_type);
  MPI_Type_commit(&half_type);
  MPI_Type_contiguous(2, MPI_BYTE, &bf16_type);
  MPI_Type_commit(&bf16_type);
  MPI_Op_create(&half_reduce<0>, 1, &half_ops[0]);
  MPI_Op_create(&half_reduce<1>, 1, &half_ops[1]);
  MPI_Op_create(&half_reduce<2>, 1, &half_ops[2]);
}

void free_half_types() {
  for (MPI_Op& op : half_ops)
    if (op != MPI_OP_NULL) MPI_Op_free(&op);
  if (half_type != MPI_DATATYPE_NULL) MPI_Type_free(&half_type);
  if (bf16_type != MPI_DATATYPE_NULL) MPI_Type_free(&bf16_type);
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::f16:
      return half_type;
    case DType::bf16:
      return bf16_type;
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
    case DType::u8:
      return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

MPI_Op mpi_op(ReduceOp op, DType t) {
  // avg: sum, then divide by N here.
  const int which = op == ReduceOp::max ? 1 : op == ReduceOp::min ? 2 : 0;
  if (t == DType::f16 || t == DType::bf16) return half_ops[which];
  return which == 1 ? MPI_MAX : which == 2 ? MPI_MIN : MPI_SUM;
}

/// avg's division, after MPI summed: through f32 for the 16-bit types.
void finish_avg(void* buf, std::size_t count, DType type, ReduceOp op, int ranks) {
  if (op != ReduceOp::avg) return;
  if (type != DType::f16 && type != DType::bf16) return finish_reduce(buf, count, type, op, ranks);
  auto* b = static_cast<std::uint16_t*>(buf);
  const bool fp16 = type == DType::f16;
  for (std::size_t i = 0; i < count; ++i) {
    const float v =
        (fp16 ? half_bits_to_float(b[i]) : bf16_bits_to_float(b[i])) / static_cast<float>(ranks);
    b[i] = fp16 ? float_to_half_bits(v) : float_to_bf16_bits(v);
  }
}

int as_int(std::size_t n, const char* what) {
  if (n > static_cast<std::size_t>(INT_MAX))
    throw Error(std::string(what) + ": " + std::to_string(n) +
                " elements is more than one MPI call takes (2^31 - 1)");
  return static_cast<int>(n);
}

/// Counts and displacements (in elements) for the v-collectives.
struct VCounts {
  std::vector<int> counts, displs;
};
VCounts v_counts(std::span<const std::size_t> counts, const char* what) {
  VCounts l;
  std::size_t offset = 0;
  for (std::size_t c : counts) {
    l.counts.push_back(as_int(c, what));
    l.displs.push_back(as_int(offset, what));
    offset += c;
  }
  return l;
}

// ---------------------------------------------------------------------------
// Heartbeats: who is still waiting inside the communicator?
//
// A rank that times out names the ranks it waited for. A rank can be missing because it
// is stopped or busy outside the communicator (the cause), or because it waits itself, in
// another call, for someone else (not the cause). Each process counts the polls it makes
// while it waits (the watchdog counts for it while it sits in one of MPI's blocking
// collectives) in a window of its own memory; a rank that times out reads the counters of
// the ranks it names twice, 0.15 s apart. A counter that moved belongs to a rank that is
// waiting; one that did not, to a rank that is stopped, or computing.

MPI_Win beat_window = MPI_WIN_NULL;
std::atomic<std::uint64_t*> beats{nullptr};  // this process's counter, in the window

void beat() {
  if (std::uint64_t* b = beats.load(std::memory_order_relaxed))
    std::atomic_ref<std::uint64_t>(*b).fetch_add(1, std::memory_order_relaxed);
}

/// How a wait names the ranks it waits for (diagnose).
enum class Waited { to_join, the_others, peer };
std::string diagnose(MPI_Comm comm, const std::vector<int>& named, Waited how, int& order);
std::string program_name;  // for the watchdog's message

// ---------------------------------------------------------------------------
// The watchdog: MPI's blocking collectives cannot time out, so a thread watches the
// one in progress and ends the job with a diagnostic when it outlasts the timeout.

class Watchdog {
 public:
  void start(std::chrono::milliseconds timeout, int rank) {
    timeout_ = timeout;
    rank_ = rank;
    thread_ = std::thread([this] { loop(); });
  }
  void stop() {
    stopping_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  /// `what` on `comm` (MPI_COMM_NULL: the world, before any communicator) is starting.
  /// `limit`: how long this call may wait (the communicator's timeout; the one the
  /// watchdog started with when none is given).
  void enter(std::string what, MPI_Comm comm,
             std::optional<std::chrono::milliseconds> limit = std::nullopt) {
    std::lock_guard<std::mutex> lock(m_);
    what_ = std::move(what);
    limit_ = limit.value_or(timeout_);
    comm_ = comm == MPI_COMM_NULL ? MPI_COMM_WORLD : comm;
    since_ = Clock::now();
    busy_ = true;
  }
  void leave() {
    std::lock_guard<std::mutex> lock(m_);
    busy_ = false;
  }

 private:
  void loop() {
    Clock::time_point last = Clock::now();
    while (!stopping_.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      std::lock_guard<std::mutex> lock(m_);
      // A long gap between two ticks means this process was stopped: that time is not
      // the others' fault, so it does not count against them.
      const Clock::time_point now = Clock::now();
      if (now - last > std::chrono::seconds(1)) since_ += now - last;
      last = now;
      if (busy_) beat();  // this rank waits in a blocking collective
      if (busy_ && now - since_ > limit_) {
        int me = 0, n = 1, order = 0;
        MPI_Comm_rank(comm_, &me);
        MPI_Comm_size(comm_, &n);
        std::vector<int> others;
        for (int q = 0; q < n; ++q)
          if (q != me) others.push_back(q);
        const std::string why = diagnose(comm_, others, Waited::the_others, order);
        fail(program_name + "rank " + std::to_string(me) + ": " + what_ + " waited " +
                 format_seconds(limit_) + " (--timeout) for the other ranks" +
                 (why.empty() ? "; did they skip the call, or are they blocked elsewhere?" : why) +
                 " (ending the job)",
             1, order);
      }
    }
  }
  std::chrono::milliseconds timeout_{60000}, limit_{60000};
  int rank_ = 0;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::mutex m_;
  std::string what_;
  MPI_Comm comm_ = MPI_COMM_WORLD;
  Clock::time_point since_;
  bool busy_ = false;
};

Watchdog watchdog;

struct Watched {
  Watched(std::string what, MPI_Comm comm,
          std::optional<std::chrono::milliseconds> limit = std::nullopt) {
    watchdog.enter(std::move(what), comm, limit);
  }
  ~Watched() { watchdog.leave(); }
};

/// A deadline that does not count time this process spent stopped (SIGSTOP, a debugger, a
/// swapped-out laptop): a gap of more than a second between two looks at the clock is
/// taken as such a pause and added to the deadline, so a rank that was stopped does not
/// wake up and blame the ranks that waited for it.
class Deadline {
 public:
  explicit Deadline(std::chrono::milliseconds timeout)
      : end_(Clock::now() + timeout), last_(Clock::now()) {}
  bool passed() {
    const Clock::time_point now = Clock::now();
    if (now - last_ > std::chrono::seconds(1)) end_ += now - last_;
    last_ = now;
    return now > end_;
  }

 private:
  Clock::time_point end_, last_;
};

/// Waits a little longer each time it is called: spin first, then yield, then sleep, so
/// that a waiting rank does not take the core of the rank it waits for (every laptop runs
/// more ranks than cores).
void back_off(int polls) {
  if (polls > 100000)
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  else if (polls > 1000)
    std::this_thread::yield();
}

std::int64_t steady_ns(Clock::time_point t = Clock::now()) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

/// A non-blocking request the progress thread tests, and what its tests found.
struct Tested {
  MPI_Request* request = nullptr;
  bool complete = false;  // guarded by Progress's lock
  MPI_Status status{};
  int code = MPI_SUCCESS;
  std::atomic<std::int64_t> posted_ns{0};  // when MPI was given it
  std::atomic<std::int64_t> done_ns{0};    // when a test first found it complete
  // A collective: its communicator, and the call that gives it to MPI (an error code).
  MPI_Comm comm = MPI_COMM_NULL;
  std::function<int()> post;
  bool posted = false;
  // A collective in two parts (an allreduce: a reduce-scatter, then an all-gather): run
  // once the first part's request completes, `then` does the work between them and gives
  // MPI the second part, in the same request (an error code); it is empty once it ran.
  std::function<int()> then;
  bool first_done = false;  // the first part complete, `then` not run yet
};

/// The progress thread: Open MPI moves a non-blocking operation on only inside MPI calls
/// (it has no asynchronous progress of its own: open-mpi/ompi#8436), so a rank that
/// computes between starting an allreduce and waiting for it would find it barely begun.
/// This thread tests every pending request every 100 microseconds while there are any (a
/// test drives the whole library's progress), and notes when each completed: the work a
/// rank's computation hid. A communicator's non-blocking collectives are given to MPI in
/// the order they were started (every rank's), at most kInFlight at once, the next as an
/// earlier one completes. Only with MPI_THREAD_MULTIPLE (otherwise each goes to MPI at
/// once, and moves on only while its rank waits); it sleeps while none is pending.
class Progress {
 public:
  /// A point-to-point request, given to MPI already.
  void watch(Tested& t) {
    if (!thread_multiple) return;
    std::lock_guard<std::mutex> lock(m_);
    pending_.push_back(&t);
    wake();
  }
  /// A collective: given to MPI now if its communicator has none in flight, else after
  /// the ones before it. Without MPI_THREAD_MULTIPLE, now. The error code of MPI's call.
  int start(Tested& t) {
    if (!thread_multiple) return post_now(t);
    std::lock_guard<std::mutex> lock(m_);
    lines_[t.comm].push_back(&t);
    pump(t.comm);
    wake();
    return t.posted ? t.code : MPI_SUCCESS;
  }
  void unwatch(Tested& t) {
    if (!thread_multiple) return;
    std::lock_guard<std::mutex> lock(m_);
    std::erase(pending_, &t);
    if (t.comm == MPI_COMM_NULL) return;
    const auto line = lines_.find(t.comm);
    if (line == lines_.end()) return;
    std::erase(line->second, &t);
    if (line->second.empty()) lines_.erase(line);
  }
  /// A test of `t`'s request under the thread's lock: true once it is complete, with its
  /// status and code.
  bool test(Tested& t, MPI_Status& status, int& code) {
    std::lock_guard<std::mutex> lock(m_);
    if (t.comm != MPI_COMM_NULL)
      pump(t.comm);  // in its line, in order
    else
      test_locked(t);
    status = t.status;
    code = t.code;
    return t.complete;
  }
  /// Whether `comm` has non-blocking collectives not yet complete (a blocking one must wait
  /// for them: MPI matches a communicator's collectives in the order they are given).
  bool busy(MPI_Comm comm) {
    if (!thread_multiple) return false;
    std::lock_guard<std::mutex> lock(m_);
    pump(comm);
    return lines_.count(comm) != 0;
  }
  /// Ends the thread (before MPI_Finalize).
  void stop() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    stopping_ = false;
  }

 private:
  void wake() {
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    cv_.notify_one();
  }
  static int post_now(Tested& t) {
    t.posted = true;
    t.posted_ns.store(steady_ns(), std::memory_order_release);
    t.code = t.post();
    if (t.code != MPI_SUCCESS) t.complete = true;
    return t.code;
  }
  /// Tests `t`; a first part found complete goes on to its second only `in_order` (every
  /// collective given to MPI before it on its communicator has given MPI its second part:
  /// MPI matches a communicator's collectives in the order they are posted, and a rank's
  /// first parts may complete in another order than another rank's).
  void test_locked(Tested& t, bool in_order = true) {
    if (t.complete) return;
    if (!t.first_done) {
      int done = 0;
      t.code = MPI_Test(t.request, &done, &t.status);
      if (t.code == MPI_SUCCESS && !done) return;
      if (t.code != MPI_SUCCESS || !t.then) return finished(t);
      t.first_done = true;
    }
    if (!in_order) return;
    t.first_done = false;
    t.code = std::exchange(t.then, nullptr)();
    if (t.code != MPI_SUCCESS) finished(t);
  }
  static void finished(Tested& t) {
    t.complete = true;
    t.done_ns.store(steady_ns(), std::memory_order_release);
  }
  /// At most this many of a communicator's collectives in flight at once: on the two-host
  /// cluster (scripts/cluster.sh overlap), dp 2 with 16 buckets stepped in 128 ms with one
  /// at a time, 121 ms with two, 115 ms with four, 118 ms with all 16 (131 ms without
  /// overlap).
  static constexpr std::size_t kInFlight = 4;
  /// `comm`'s line on: its first kInFlight collectives given to MPI and tested, the
  /// complete ones at its front taken off.
  void pump(MPI_Comm comm) {
    const auto line = lines_.find(comm);
    if (line == lines_.end()) return;
    std::deque<Tested*>& q = line->second;
    bool in_order = true;  // the collectives before q[i] have posted their second parts
    for (std::size_t i = 0; i < q.size() && i < kInFlight; ++i) {
      if (!q[i]->posted) post_now(*q[i]);
      test_locked(*q[i], in_order);
      in_order = in_order && !q[i]->then;
    }
    while (!q.empty() && q.front()->complete) q.pop_front();
    if (q.empty()) lines_.erase(line);
  }
  void loop() {
    std::unique_lock<std::mutex> lock(m_);
    while (!stopping_) {
      cv_.wait(lock, [&] { return stopping_ || !pending_.empty() || !lines_.empty(); });
      for (Tested* t : pending_) test_locked(*t);
      std::vector<MPI_Comm> comms;
      for (const auto& [comm, line] : lines_) comms.push_back(comm);
      for (MPI_Comm comm : comms) pump(comm);
      lock.unlock();
      std::this_thread::sleep_for(period_);
      lock.lock();
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  std::vector<Tested*> pending_;                    // point to point
  std::map<MPI_Comm, std::deque<Tested*> > lines_;  // collectives, per communicator
  std::thread thread_;
  bool stopping_ = false;
  std::chrono::microseconds period_{100};
};
Progress progress;

/// Polls `request` until it completes or `deadline` passes (false); through `tested` (the
/// progress thread's record of it) where it is watched.
bool poll(MPI_Request& request, MPI_Status& status, Deadline deadline, int& code,
          Tested* tested = nullptr) {
  for (int polls = 0;; ++polls) {
    int done = 0;
    if (tested && thread_multiple) {
      done = progress.test(*tested, status, code);
    } else {
      code = MPI_Test(&request, &done, &status);
      // Without the progress thread a collective's second part goes to MPI as the rank
      // waits for it: in the program's order, the same on every rank.
      if (code == MPI_SUCCESS && done && tested && tested->then) {
        code = std::exchange(tested->then, nullptr)();
        done = 0;
      }
    }
    if (code != MPI_SUCCESS || done) return true;
    if (deadline.passed()) return false;
    beat();
    back_off(polls);
  }
}

/// Waits for `answer` at most `limit`, beating meanwhile: a rank that is diagnosing a
/// timeout, or failing, is inside the communicator, not the cause of anyone's wait.
template <class T>
bool beating_wait(std::future<T>& answer, std::chrono::milliseconds limit) {
  const Clock::time_point end = Clock::now() + limit;
  while (answer.wait_for(std::chrono::milliseconds(10)) != std::future_status::ready) {
    beat();
    if (Clock::now() > end) return false;
  }
  return true;
}
/// Sleeps, beating.
void beating_sleep(std::chrono::milliseconds time) {
  const Clock::time_point end = Clock::now() + time;
  while (Clock::now() < end) {
    beat();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

/// For each of `world_ranks`: true when it is waiting inside its communicator (its
/// heartbeat moved in 0.15 s), false when it is not (stopped, or computing). Empty when
/// the counters could not be read within a second (no window; a node that does not
/// answer).
std::vector<bool> waiting(const std::vector<int>& world_ranks) {
  if (beat_window == MPI_WIN_NULL || !thread_multiple || world_ranks.empty()) return {};
  auto result = std::make_shared<std::promise<std::vector<bool> > >();
  std::future<std::vector<bool> > answer = result->get_future();
  std::thread([result, world_ranks] {
    auto read = [&] {
      std::vector<std::uint64_t> v(world_ranks.size());
      for (std::size_t i = 0; i < world_ranks.size(); ++i) {
        MPI_Win_lock(MPI_LOCK_SHARED, world_ranks[i], 0, beat_window);
        MPI_Get(&v[i], 1, MPI_UINT64_T, world_ranks[i], 0, 1, MPI_UINT64_T, beat_window);
        MPI_Win_unlock(world_ranks[i], beat_window);
      }
      return v;
    };
    const std::vector<std::uint64_t> before = read();
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    const std::vector<std::uint64_t> after = read();
    std::vector<bool> moved;
    for (std::size_t i = 0; i < before.size(); ++i) moved.push_back(after[i] != before[i]);
    result->set_value(moved);
  }).detach();
  // This rank waits too, meanwhile (for another rank's look at its counter).
  if (!beating_wait(answer, std::chrono::seconds(1))) return {};
  return answer.get();
}

/// Every world rank's host name (MPI_Get_processor_name), gathered at init: a rank that
/// waits for ranks on other hosts names them, for the cause may be the host or the network.
std::vector<std::string> world_hosts;

/// "; rank 2 runs on node1 (this rank on node0): ..." for the ranks of `named` (as ranks
/// of the communicator; `world_ranks` the same as world ranks) on other hosts; "" when all
/// run on this one.
std::string elsewhere(const std::vector<int>& named, const std::vector<int>& world_ranks) {
  if (world_hosts.size() < 2) return "";
  const std::string& mine = world_hosts[static_cast<std::size_t>(world_rank())];
  std::string text;
  for (std::size_t i = 0; i < named.size(); ++i) {
    const auto w = static_cast<std::size_t>(world_ranks[i]);
    if (w >= world_hosts.size() || world_hosts[w] == mine) continue;
    text += (text.empty() ? "; " : ", ") + ("rank " + std::to_string(named[i])) + " runs on " +
            world_hosts[w];
  }
  if (text.empty()) return "";
  return text + " (this rank on " + mine + "): is that host up, and the network to it?";
}

/// ", rank(s) ... do(es) not respond ...; rank(s) ... wait(s) in other calls": what the
/// heartbeats say of the ranks `named` (of `comm`, which `world` ranks translate), and
/// the report's order (CommError::report_order).
std::string diagnose(MPI_Comm comm, const std::vector<int>& named, Waited how, int& order) {
  order = static_cast<int>(named.size());
  if (named.empty()) return "";
  MPI_Group group = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
  std::vector<int> world_ranks(named.size());
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world_group);
  MPI_Group_translate_ranks(group, static_cast<int>(named.size()), named.data(), world_group,
                            world_ranks.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  const std::string hosts = elsewhere(named, world_ranks);
  const std::vector<bool> moving = waiting(world_ranks);
  if (moving.empty()) return hosts;
  std::vector<int> silent, busy_waiting;
  for (std::size_t i = 0; i < named.size(); ++i)
    (moving[i] ? busy_waiting : silent).push_back(named[i]);
  auto list = [](const std::vector<int>& ranks) {
    std::string text = ranks.size() == 1 ? "rank " : "ranks ";
    for (std::size_t i = 0; i < ranks.size(); ++i)
      text += (i ? ", " : "") + std::to_string(ranks[i]);
    return text;
  };
  std::string text;
  if (!silent.empty())
    text += "; " + list(silent) + (silent.size() == 1 ? " does" : " do") +
            " not respond (stopped, or computing outside the communicator)";
  if (!busy_waiting.empty())
    text += "; " + list(busy_waiting) + (busy_waiting.size() == 1 ? " is" : " are") +
            (how == Waited::the_others ? " waiting too"
             : how == Waited::peer     ? " waiting in another call (do the two wait for each "
                                         "other?)"
                                       : " waiting in another call (did it skip this one?)");
  order = !silent.empty() ? static_cast<int>(silent.size()) : how == Waited::peer ? 11 : 10;
  return text + hosts;
}

// ---------------------------------------------------------------------------
// The collective check: before a collective, every rank sends every other rank what it is
// about to call (a few hundred bytes, on a communicator of its own), so that ranks that
// call different collectives get the same message as on the threads backend, and a rank
// that never arrives is named when the others time out.

struct Signature {
  std::int64_t seq = 0;  // which checked collective of this communicator this is
  std::int32_t op = 0, reduce = 0, root = 0, type = 0, vector = 0, memory = 0;
  std::int64_t count = 0;
  std::uint64_t counts_hash = 0;  // allgather(v), gather(v): every rank's count
  std::int64_t to_you = -1;       // alltoallv: what the sender sends to the receiver
  char text[224] = {};            // the call, as describe() says it
};

bool agrees(const Signature& a, const Signature& b) {
  return a.seq == b.seq && a.op == b.op && a.vector == b.vector && a.count == b.count &&
         a.type == b.type && a.reduce == b.reduce && a.root == b.root && a.memory == b.memory &&
         (a.vector || a.counts_hash == b.counts_hash);
}

/// One check in flight: the signatures coming in from every other rank, and going out.
struct Check {
  std::vector<Signature> in, out;
  std::vector<MPI_Request> requests;  // the receives first (one per peer), then the sends
  Signature mine;
  std::vector<std::size_t> recv_counts;  // alltoallv: what this rank expects from each
};

// ---------------------------------------------------------------------------

/// What ran() says of a request the progress thread watched: from when MPI was given it to
/// when a test found it complete (the operation's work, waiting for the peers included).
std::pair<std::int64_t, std::int64_t> watched_run(const Request::Impl& r, const Tested& t) {
  const std::int64_t done = t.done_ns.load(std::memory_order_acquire);
  if (!done) return {0, 0};
  const std::int64_t posted = t.posted_ns.load(std::memory_order_acquire);
  return {posted ? posted : steady_ns(r.posted), done};
}

struct MpiRequest final : Request::Impl {
  MPI_Request request = MPI_REQUEST_NULL;
  bool is_send = false;
  int peer = 0, tag = 0;
  std::size_t bytes = 0;
  Tested tested;
  std::pair<std::int64_t, std::int64_t> ran() const override { return watched_run(*this, tested); }
  ~MpiRequest() override {
    progress.unwatch(tested);
    // Dropped unfinished (the rank is failing): cancel the receive; the job is ending.
    if (request != MPI_REQUEST_NULL) {
      if (!is_send) MPI_Cancel(&request);
      MPI_Request_free(&request);
    }
  }
  std::string describe() const {
    return std::string(is_send ? "send to" : "recv from") + " rank " + std::to_string(peer) +
           " (tag " + std::to_string(tag) + ", " + std::to_string(bytes) + " bytes)";
  }
};

/// A non-blocking collective: its MPI request and what to do once it completes.
struct MpiCollective final : Request::Impl {
  MPI_Request request = MPI_REQUEST_NULL;
  std::unique_ptr<Check> check;  // every rank's signature, settled first at wait()
  std::string what;
  VCounts layout;    // the v-collectives' counts must live until completion
  VCounts receives;  // alltoallv's receive side, alike
  std::vector<int> recv_counts;
  std::function<void()> finish;
  std::chrono::milliseconds timeout{60000};
  Tested tested;
  std::pair<std::int64_t, std::int64_t> ran() const override { return watched_run(*this, tested); }
  ~MpiCollective() override {
    progress.unwatch(tested);
    // Dropped unfinished (the rank is failing). Other ranks' collectives depend on this
    // one, so complete it if it can be (MPI cannot cancel it): a collective whose ranks
    // are all there finishes at once. One that does not within a tenth of a second has a
    // rank gone, stopped or failing too: leave it, the job is ending, and a longer wait
    // here would keep this rank from saying why.
    if (request == MPI_REQUEST_NULL) return;
    MPI_Status status;
    int code = MPI_SUCCESS;
    poll(request, status, Deadline(std::min(timeout, std::chrono::milliseconds(100))), code);
  }
};

class MpiComm final : public Communicator {
 public:
  MpiComm(MPI_Comm comm, bool owned, std::chrono::milliseconds timeout)
      : Communicator(rank_of(comm), size_of(comm), timeout), comm_(comm), owned_(owned) {
    MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_dup(comm_, &checks_));  // the collective checks' own messages
    MPI_CHECK(MPI_Comm_set_errhandler(checks_, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_dup(comm_, &seconds_));  // the two-part collectives' second parts
    MPI_CHECK(MPI_Comm_set_errhandler(seconds_, MPI_ERRORS_RETURN));
  }
  ~MpiComm() override {
    MPI_Comm_free(&checks_);
    MPI_Comm_free(&seconds_);
    if (owned_) MPI_Comm_free(&comm_);
  }
  std::string_view backend() const override { return "mpi"; }

 protected:
  Request isend_impl(const void* buf, std::size_t bytes, Memory mem, int peer, int tag) override {
    host_only(mem, "send");
    auto r = describe(true, peer, tag, bytes);
    MPI_CHECK(MPI_Isend(buf, as_int(bytes, "send"), MPI_BYTE, peer, tag, comm_, &r->request));
    r->tested.request = &r->request;
    progress.watch(r->tested);
    return Request(std::move(r));
  }

  Request irecv_impl(void* buf, std::size_t bytes, Memory mem, int peer, int tag) override {
    host_only(mem, "recv");
    auto r = describe(false, peer, tag, bytes);
    // Any tag: messages from one rank are matched in the order they were sent (MPI's
    // non-overtaking rule), and the tag is checked when the message is in.
    MPI_CHECK(
        MPI_Irecv(buf, as_int(bytes, "recv"), MPI_BYTE, peer, MPI_ANY_TAG, comm_, &r->request));
    r->tested.request = &r->request;
    progress.watch(r->tested);
    return Request(std::move(r));
  }

  void wait_impl(Request::Impl& request) override {
    if (auto* c = dynamic_cast<MpiCollective*>(&request)) return finish(*c);
    auto& r = static_cast<MpiRequest&>(request);
    MPI_Status status;
    int code = MPI_SUCCESS;
    if (!poll(r.request, status, Deadline(remaining()), code, &r.tested)) {
      int order = 0;
      const std::string why = diagnose(comm_, {r.peer}, Waited::peer, order);
      throw CommError(
          "rank " + std::to_string(rank()) + ": " + r.describe() + " waited " +
              format_seconds(timeout()) + " (--timeout): " +
              (r.is_send ? "rank " + std::to_string(r.peer) + " never posted a matching recv"
                         : "no matching send came; is rank " + std::to_string(r.peer) +
                               " sending to rank " + std::to_string(rank()) + " with tag " +
                               std::to_string(r.tag) + "?") +
              why,
          order);
    }
    if (code != MPI_SUCCESS && !r.is_send)
      throw CommError("rank " + std::to_string(rank()) + ": " + r.describe() +
                      " failed: the message from rank " + std::to_string(r.peer) +
                      " is longer than the receive buffer");
    MPI_CHECK(code);
    if (r.is_send) return;
    int got = 0;
    MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &got));
    if (status.MPI_TAG != r.tag)
      throw CommError("rank " + std::to_string(rank()) + "'s recv from rank " +
                      std::to_string(r.peer) + " (tag " + std::to_string(r.tag) + ") met rank " +
                      std::to_string(r.peer) + "'s send with tag " +
                      std::to_string(status.MPI_TAG) +
                      ": messages between two ranks are matched in the order they are posted, "
                      "and the tags must agree (NCCL has no tags to match on)");
    if (static_cast<std::size_t>(got) != r.bytes)
      throw CommError("rank " + std::to_string(rank()) + " posted a recv of " +
                      std::to_string(r.bytes) + " bytes from rank " + std::to_string(r.peer) +
                      " (tag " + std::to_string(r.tag) + "), but rank " + std::to_string(r.peer) +
                      " sent " + std::to_string(got) + " bytes");
  }

  void run_collective(const Collective& c) override {
    host_only(c.memory, op_name(c.op));
    settle_started();
    if (checking()) {
      Check check = start_check(c);
      finish_check(check);
    }
    if (c.op != Op::barrier) count_modeled(c);
    Watched w(c.describe(), comm_, timeout());
    const MPI_Datatype t = mpi_type(c.type);
    switch (c.op) {
      case Op::barrier:
        MPI_CHECK(MPI_Barrier(comm_));
        return;
      case Op::allreduce:  // Open MPI's own (see Exchange)
        MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, c.out, as_int(c.count, "allreduce"), t,
                                mpi_op(c.reduce, c.type), comm_));
        return finish_avg(c.out, c.count, c.type, c.reduce, size());
      case Op::reduce: {
        const int n = as_int(c.count, "reduce");
        if (rank() == c.root) {
          MPI_CHECK(MPI_Reduce(MPI_IN_PLACE, c.out, n, t, mpi_op(c.reduce, c.type), c.root, comm_));
          finish_avg(c.out, c.count, c.type, c.reduce, size());
        } else {
          MPI_CHECK(MPI_Reduce(c.in, nullptr, n, t, mpi_op(c.reduce, c.type), c.root, comm_));
        }
        return;
      }
      case Op::broadcast:
        MPI_CHECK(MPI_Bcast(c.out, as_int(c.count, "broadcast"), t, c.root, comm_));
        return;
      case Op::reduce_scatter: {
        Exchange x = exchange(c);
        MPI_CHECK(x.send(c.in, t, comm_));
        return x.reduce(c.in, c.out, c.type, c.reduce);
      }
      case Op::allgather: {
        const VCounts l = v_counts(c.counts, "allgather");
        MPI_CHECK(MPI_Allgatherv(c.in, l.counts[static_cast<std::size_t>(rank())], t, c.out,
                                 l.counts.data(), l.displs.data(), t, comm_));
        return;
      }
      case Op::gather: {
        const VCounts l = v_counts(c.counts, "gather");
        MPI_CHECK(MPI_Gatherv(c.in, l.counts[static_cast<std::size_t>(rank())], t, c.out,
                              l.counts.data(), l.displs.data(), t, c.root, comm_));
        return;
      }
      case Op::alltoall: {
        if (!c.vector) {
          const int n = as_int(c.count, "alltoall");
          MPI_CHECK(MPI_Alltoall(c.in, n, t, c.out, n, t, comm_));
          return;
        }
        const VCounts s = v_counts(c.counts, "alltoallv"), r = v_counts(c.recv_counts, "alltoallv");
        MPI_CHECK(MPI_Alltoallv(c.in, s.counts.data(), s.displs.data(), t, c.out, r.counts.data(),
                                r.displs.data(), t, comm_));
        return;
      }
      default:
        throw Error("mpi backend: no collective " + std::string(op_name(c.op)));
    }
  }

  Request start_collective(Collective c) override {
    host_only(c.memory, op_name(c.op));
    count_modeled(c);
    auto r = std::make_unique<MpiCollective>();
    r->what = c.describe();
    r->timeout = timeout();
    // The check travels with the collective and is settled first at wait().
    if (checking()) r->check = std::make_unique<Check>(start_check(c));
    const MPI_Datatype t = mpi_type(c.type);
    MpiCollective* q = r.get();  // the calls below run now, or on the progress thread
    const MPI_Comm comm = comm_, seconds = seconds_;
    switch (c.op) {
      case Op::allreduce: {  // a reduce-scatter, then an all-gather of the reduced blocks
        auto x = std::make_shared<Exchange>(exchange(c));
        r->tested.post = [=] { return x->send(c.out, t, comm, &q->request); };
        r->tested.then = [=] {
          x->reduce(c.out, x->mine_in(c.out), c.type, c.reduce);
          return MPI_Iallgatherv(MPI_IN_PLACE, 0, t, c.out, x->all.counts.data(),
                                 x->all.displs.data(), t, seconds, &q->request);
        };
        break;
      }
      case Op::reduce_scatter: {
        auto x = std::make_shared<Exchange>(exchange(c));
        r->tested.post = [=] { return x->send(c.in, t, comm, &q->request); };
        r->finish = [=] { x->reduce(c.in, c.out, c.type, c.reduce); };
        break;
      }
      case Op::allgather: {
        r->layout = v_counts(c.counts, "allgather");
        const int mine = r->layout.counts[static_cast<std::size_t>(rank())];
        r->tested.post = [=] {
          return MPI_Iallgatherv(c.in, mine, t, c.out, q->layout.counts.data(),
                                 q->layout.displs.data(), t, comm, &q->request);
        };
        break;
      }
      case Op::alltoall:
        r->layout = v_counts(c.counts, "alltoallv");
        r->receives = v_counts(c.recv_counts, "alltoallv");
        r->tested.post = [=] {
          return MPI_Ialltoallv(c.in, q->layout.counts.data(), q->layout.displs.data(), t, c.out,
                                q->receives.counts.data(), q->receives.displs.data(), t, comm,
                                &q->request);
        };
        break;
      default:
        throw Error("mpi backend: no non-blocking " + std::string(op_name(c.op)));
    }
    r->tested.request = &r->request;
    r->tested.comm = comm_;
    MPI_CHECK(progress.start(r->tested));
    return Request(std::move(r));
  }

  std::unique_ptr<Communicator> split_impl(int color, int key) override {
    settle_started();
    if (checking()) {
      Collective c;
      c.op = Op::barrier;
      c.count = static_cast<std::size_t>(-1);  // a split is no barrier: let the two differ
      Check check = start_check(
          c, "split(color " + std::to_string(color) + ", key " + std::to_string(key) + ")");
      finish_check(check);
    }
    MPI_Comm sub = MPI_COMM_NULL;
    {
      Watched w("split", comm_);
      MPI_CHECK(MPI_Comm_split(comm_, color, key, &sub));
    }
    return std::make_unique<MpiComm>(sub, true, timeout());
  }

 private:
  /// A reduce-scatter as an exchange: block q of every rank's buffer goes to rank q (an
  /// alltoallv: each rank sends (N - 1)/N of its buffer, as a ring would), and each rank
  /// then adds the N blocks of its own in rank order (reduce_in_rank_order: the threads
  /// backend's bits, blocking or not). A non-blocking allreduce is that, then an
  /// all-gather of the reduced blocks: what the threads backend does, with the same bits.
  /// Open MPI's non-blocking collectives (libnbc) do otherwise: its reduce-scatter reduces
  /// the whole buffer to rank 0 along a tree and scatters it from there, and its in-place
  /// allreduce of fewer than 4 ranks goes up a tree to rank 0 and back down (of two ranks,
  /// rank 1 sends its whole buffer, then rank 0 the whole sum: one way at a time). The
  /// blocking allreduce stays Open MPI's own (its tuned algorithms, its order of addition):
  /// across two hosts of two ranks it crosses the link with 2 S where an exchange would
  /// with 4 S (chapter 03, scripts/cluster.sh ch03).
  struct Exchange {
    VCounts sends, receives;
    VCounts all;                        // every rank's block of the whole (the all-gather)
    std::vector<unsigned char> blocks;  // rank q's block of mine at q * mine (not my own)
    std::size_t mine = 0, elem = 0;
    int rank = 0;
    /// Block q of `whole` to rank q, the others' blocks of mine into `blocks`: an alltoallv,
    /// non-blocking into `request` when given one. MPI's error code.
    int send(const void* whole, MPI_Datatype t, MPI_Comm comm, MPI_Request* request = nullptr) {
      if (request)
        return MPI_Ialltoallv(whole, sends.counts.data(), sends.displs.data(), t, blocks.data(),
                              receives.counts.data(), receives.displs.data(), t, comm, request);
      return MPI_Alltoallv(whole, sends.counts.data(), sends.displs.data(), t, blocks.data(),
                           receives.counts.data(), receives.displs.data(), t, comm);
    }
    /// Where this rank's block lies in a whole buffer.
    void* mine_in(const void* whole) const {
      return const_cast<unsigned char*>(static_cast<const unsigned char*>(whole)) +
             static_cast<std::size_t>(all.displs[static_cast<std::size_t>(rank)]) * elem;
    }
    /// into = the sum, in rank order, of this rank's block of `whole` and the blocks the
    /// others sent (into may be that block).
    void reduce(const void* whole, void* into, DType type, ReduceOp op) const {
      std::vector<const void*> sources;
      for (int q = 0; q < static_cast<int>(all.counts.size()); ++q)
        sources.push_back(q == rank ? mine_in(whole)
                                    : blocks.data() + static_cast<std::size_t>(q) * mine * elem);
      reduce_in_rank_order(into, sources, mine, type, op);
    }
  };
  Exchange exchange(const Collective& c) const {
    Exchange x;
    const char* what = op_name(c.op).data();
    const std::vector<std::size_t> counts =
        shard_counts(static_cast<std::int64_t>(c.count), size());
    x.all = v_counts(counts, what);
    x.sends = x.all;
    x.rank = rank();
    x.mine = counts[static_cast<std::size_t>(x.rank)];
    x.elem = dtype_size(c.type);
    x.sends.counts[static_cast<std::size_t>(x.rank)] = 0;  // my own block stays where it is
    for (int q = 0; q < size(); ++q) {
      x.receives.counts.push_back(q == x.rank ? 0 : as_int(x.mine, what));
      x.receives.displs.push_back(as_int(static_cast<std::size_t>(q) * x.mine, what));
    }
    x.blocks.resize(static_cast<std::size_t>(size()) * x.mine * x.elem);
    return x;
  }

  Check start_check(const Collective& c, const std::string& text = "") {
    const int N = size(), me = rank();
    Check check;
    Signature& m = check.mine;
    m.seq = ++checked_;
    m.op = static_cast<std::int32_t>(c.op);
    m.reduce = static_cast<std::int32_t>(c.reduce);
    m.root = c.root;
    m.type = static_cast<std::int32_t>(c.type);
    m.vector = c.vector ? 1 : 0;
    m.memory = static_cast<std::int32_t>(c.memory);
    m.count = static_cast<std::int64_t>(c.count);
    for (std::size_t n : c.counts) m.counts_hash = m.counts_hash * 1000003u + n + 1;
    const std::string said = text.empty() ? c.describe() : text;
    std::snprintf(m.text, sizeof m.text, "%s", said.c_str());
    check.recv_counts = c.recv_counts;
    check.in.resize(static_cast<std::size_t>(N));
    check.out.assign(static_cast<std::size_t>(N), m);
    check.requests.assign(2 * static_cast<std::size_t>(N), MPI_REQUEST_NULL);
    for (int q = 0; q < N; ++q) {
      if (q == me) continue;
      const auto k = static_cast<std::size_t>(q);
      if (c.vector) check.out[k].to_you = static_cast<std::int64_t>(c.counts[k]);
      MPI_CHECK(
          MPI_Irecv(&check.in[k], sizeof(Signature), MPI_BYTE, q, 0, checks_, &check.requests[k]));
      MPI_CHECK(MPI_Isend(&check.out[k], sizeof(Signature), MPI_BYTE, q, 0, checks_,
                          &check.requests[static_cast<std::size_t>(N) + k]));
    }
    return check;
  }

  /// Waits for every rank's signature (naming the ones that never came) and compares them
  /// with this rank's, in the words the threads backend uses.
  void finish_check(Check& check) {
    const int N = size(), me = rank();
    Deadline deadline(timeout());
    for (int polls = 0;; ++polls) {
      // One by one (MPI_Testall leaves every request pending until all are done, and then
      // could not say which rank is missing).
      bool done = true;
      for (MPI_Request& request : check.requests) {
        if (request == MPI_REQUEST_NULL) continue;
        int finished = 0;
        MPI_CHECK(MPI_Test(&request, &finished, MPI_STATUS_IGNORE));
        done = done && finished;
      }
      if (done) break;
      beat();
      if (deadline.passed()) {
        std::string missing;
        std::vector<int> named;
        // A rank is missing when its signature has not come, or has not taken this one's
        // (a process that is stopped does not drain what is sent to it).
        for (int q = 0; q < N; ++q)
          if (q != me && (check.requests[static_cast<std::size_t>(q)] != MPI_REQUEST_NULL ||
                          check.requests[static_cast<std::size_t>(N + q)] != MPI_REQUEST_NULL)) {
            missing += (missing.empty() ? "" : ", ") + std::to_string(q);
            named.push_back(q);
          }
        int order = 0;
        const std::string why = diagnose(comm_, named, Waited::to_join, order);
        throw CommError(
            "rank " + std::to_string(me) + ": " + check.mine.text + " waited " +
                format_seconds(timeout()) + " (--timeout) for rank(s) " + missing + " to join" +
                (why.empty() ? "; did they skip the call, or are they blocked elsewhere?" : why),
            order);
      }
      back_off(polls);
    }
    check.in[static_cast<std::size_t>(me)] = check.mine;
    const Signature& first = check.in[0];
    for (int q = 1; q < N; ++q) {
      const Signature& other = check.in[static_cast<std::size_t>(q)];
      if (!agrees(first, other))
        throw CommError("rank " + std::to_string(me) + ": collective mismatch: rank 0 called " +
                        first.text + " but rank " + std::to_string(q) + " called " + other.text +
                        " (every rank must make the same collective calls, in the same order, "
                        "with the same counts)");
    }
    if (!check.mine.vector) return;
    for (int q = 0; q < N; ++q) {  // alltoallv: what q sends here is what this rank expects
      if (q == me) continue;
      const std::int64_t sends = check.in[static_cast<std::size_t>(q)].to_you;
      const auto expects =
          static_cast<std::int64_t>(check.recv_counts[static_cast<std::size_t>(q)]);
      if (sends != expects)
        throw CommError("rank " + std::to_string(me) + ": alltoallv mismatch: rank " +
                        std::to_string(q) + " sends " + std::to_string(sends) +
                        " elements to rank " + std::to_string(me) + ", but rank " +
                        std::to_string(me) + " expects " + std::to_string(expects) +
                        " from it (exchange the counts first)");
    }
  }

  void finish(MpiCollective& c) {
    if (c.check) finish_check(*c.check);
    MPI_Status status;
    int code = MPI_SUCCESS;
    if (!poll(c.request, status, Deadline(remaining()), code, &c.tested)) {
      std::vector<int> others;
      for (int q = 0; q < size(); ++q)
        if (q != rank()) others.push_back(q);
      int order = 0;
      const std::string why = diagnose(comm_, others, Waited::the_others, order);
      throw CommError(
          "rank " + std::to_string(rank()) + ": " + c.what + " waited " +
              format_seconds(timeout()) + " (--timeout) for the other ranks" +
              (why.empty() ? "; did they skip the call, or are they blocked elsewhere?" : why),
          order);
    }
    MPI_CHECK(code);
    if (c.finish) c.finish();
  }

  /// Waits until the non-blocking collectives started on this communicator are complete:
  /// a blocking one, or a split, comes after them on every rank.
  void settle_started() {
    Deadline deadline(timeout());
    for (int polls = 0; progress.busy(comm_); ++polls) {
      if (deadline.passed())
        throw CommError("rank " + std::to_string(rank()) + ": a blocking call waited " +
                        format_seconds(timeout()) +
                        " (--timeout) for the non-blocking collectives started before it");
      beat();
      back_off(polls);
    }
  }

  /// What is left of the wait in progress (one wait, or the whole of a wait_all).
  std::chrono::milliseconds remaining() const {
    return std::chrono::duration_cast<std::chrono::milliseconds>(wait_deadline() - Clock::now());
  }

  /// Open MPI as packaged here is not CUDA-aware: device buffers are refused, not crashed on.
  static void host_only(Memory mem, std::string_view what) {
    if (mem == Memory::device)
      throw UsageError(std::string(what) +
                       ": the MPI backend takes host buffers only (this Open MPI is not "
                       "CUDA-aware); use --backend nccl for device buffers");
  }
  static int rank_of(MPI_Comm c) {
    int r = 0;
    MPI_Comm_rank(c, &r);
    return r;
  }
  static int size_of(MPI_Comm c) {
    int s = 0;
    MPI_Comm_size(c, &s);
    return s;
  }
  std::unique_ptr<MpiRequest> describe(bool is_send, int peer, int tag, std::size_t bytes) {
    auto r = std::make_unique<MpiRequest>();
    r->is_send = is_send;
    r->peer = peer;
    r->tag = tag;
    r->bytes = bytes;
    return r;
  }

  MPI_Comm comm_;
  MPI_Comm checks_ = MPI_COMM_NULL;
  // The second parts of the two-part collectives (an allreduce's all-gather): MPI matches
  // a communicator's collectives in the order they are posted, and a second part goes to
  // MPI when its first completes, which on one rank may come before the next first part is
  // posted and on another after. Apart, each communicator has its own order: comm_ the
  // first parts' (the order the collectives were started), this one the second parts'
  // (the same: Progress posts them in it).
  MPI_Comm seconds_ = MPI_COMM_NULL;
  bool owned_;
  std::int64_t checked_ = 0;  // collectives checked so far
};

}  // namespace

bool available() { return true; }

void init(int* argc, char*** argv, std::chrono::milliseconds timeout, const std::string& program) {
  if (initialized) return;
  program_name = program.empty() ? "" : program + ": ";
  int provided = 0;
  // The watchdog thread calls MPI_Abort while the rank's thread may sit in MPI.
  MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
  initialized = true;
  thread_multiple = provided >= MPI_THREAD_MULTIPLE;
  create_half_types();
  {
    char name[MPI_MAX_PROCESSOR_NAME] = {};
    int length = 0;
    MPI_Get_processor_name(name, &length);
    std::vector<char> all(static_cast<std::size_t>(world_size()) * MPI_MAX_PROCESSOR_NAME);
    MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME,
                  MPI_CHAR, MPI_COMM_WORLD);
    world_hosts.clear();
    for (int q = 0; q < world_size(); ++q)
      world_hosts.emplace_back(all.data() + static_cast<std::size_t>(q) * MPI_MAX_PROCESSOR_NAME);
  }
  // The two windows need one-sided communication between every pair of processes: shared
  // memory on one node, RDMA across nodes. Over plain TCP (a cluster of hosts on Ethernet)
  // Open MPI 4 has none that allows MPI_THREAD_MULTIPLE, and the windows are then left
  // out: every process may report, and a timeout cannot tell waiting ranks from stopped
  // ones.
  MPI_Errhandler fatal = MPI_ERRHANDLER_NULL;
  MPI_Comm_get_errhandler(MPI_COMM_WORLD, &fatal);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int* slot = nullptr;
  const MPI_Aint bytes = world_rank() == 0 ? static_cast<MPI_Aint>(sizeof(int)) : 0;
  if (MPI_Win_allocate(bytes, sizeof(int), MPI_INFO_NULL, MPI_COMM_WORLD, &slot, &report_window) !=
      MPI_SUCCESS)
    report_window = MPI_WIN_NULL;
  else if (world_rank() == 0)
    *slot = 0;
  std::uint64_t* counter = nullptr;
  if (MPI_Win_allocate(sizeof(std::uint64_t), sizeof(std::uint64_t), MPI_INFO_NULL, MPI_COMM_WORLD,
                       &counter, &beat_window) != MPI_SUCCESS) {
    beat_window = MPI_WIN_NULL;
  } else {
    *counter = 0;
    beats.store(counter);
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, fatal);
  MPI_Errhandler_free(&fatal);
  MPI_Barrier(MPI_COMM_WORLD);  // the slot and the counters are 0 before anyone can fail
  if (provided >= MPI_THREAD_MULTIPLE) {
    watchdog.start(timeout, world_rank());
  } else if (world_rank() == 0) {
    std::fprintf(stderr,
                 "warning: this MPI library gives thread level %d, not MPI_THREAD_MULTIPLE (%d): "
                 "a collective that hangs will not be ended after --timeout\n",
                 provided, MPI_THREAD_MULTIPLE);
  }
}

void finalize() {
  if (!initialized) return;
  free_half_types();
  if (report_window != MPI_WIN_NULL) MPI_Win_free(&report_window);
  beats.store(nullptr);
  if (beat_window != MPI_WIN_NULL) MPI_Win_free(&beat_window);
  progress.stop();
  {
    // MPI_Finalize waits for the other processes: watched like a collective.
    Watched w("MPI_Finalize (waiting for the other ranks to finish)", MPI_COMM_WORLD);
    MPI_Finalize();
  }
  watchdog.stop();
  initialized = false;
}

namespace {
/// Open MPI 4 prints ten lines of its own when a process calls MPI_Abort ("MPI_ABORT was
/// invoked on rank ... NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI
/// processes"), after the program's one line that says why. Its MCA parameter
/// orte_execute_quiet silences them, but it is read at MPI_Init, where it would also hide
/// Open MPI's warnings from runs that go on (a network it cannot use); so it is set only
/// here, as the job ends, in the variable that holds it. Another MPI, or Open MPI 5 (no
/// ORTE), has no such variable: nothing changes there.
void silence_launcher() {
  if (void* quiet = dlsym(RTLD_DEFAULT, "orte_execute_quiet")) *static_cast<bool*>(quiet) = true;
}
}  // namespace

void abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  silence_launcher();
  MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

void end_job(int code) {
  int started = 0, finished = 0;
  MPI_Initialized(&started);
  MPI_Finalized(&finished);
  if (finished) std::exit(code);
  // A process that exits non-zero, before MPI_Init or after MPI_Finalize, gets mpirun's
  // "Primary job terminated normally, but 1 process returned a non-zero exit code" banner;
  // an abort, silenced, gets none and gives mpirun the same exit code.
  if (!started) MPI_Init(nullptr, nullptr);
  abort(code);
}

namespace {
/// True when this process is the first of the job to claim the report. Where the claim
/// cannot be made (no window, no MPI_THREAD_MULTIPLE) or takes over two seconds (rank 0's
/// node unreachable), every process may speak: a line twice beats none.
bool claim_report() {
  if (report_window == MPI_WIN_NULL || !thread_multiple) return true;
  auto claimed = std::make_shared<std::promise<bool> >();
  std::future<bool> answer = claimed->get_future();
  std::thread([claimed] {
    const int mine = world_rank() + 1, empty = 0;
    int before = -1;
    MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, report_window);
    MPI_Compare_and_swap(&mine, &empty, &before, MPI_INT, 0, 0, report_window);
    MPI_Win_unlock(0, report_window);
    claimed->set_value(before == 0);
  }).detach();
  if (!beating_wait(answer, std::chrono::seconds(2))) return true;
  return answer.get();
}
}  // namespace

void fail(const std::string& line, int code, int order) {
  // A report nearer the cause (a lower order) gets in first.
  if (order > 1) beating_sleep(std::chrono::milliseconds(100 * std::min(order - 1, 15)));
  if (claim_report()) {
    std::fprintf(stderr, "%s\n", line.c_str());
    abort(code);
  }
  // Another process speaks and ends the job (its MPI_Abort ends this one too); should that
  // not come, end it from here.
  beating_sleep(std::chrono::seconds(30));
  abort(code);
}

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

std::vector<std::string> hosts() { return world_hosts; }

std::unique_ptr<Communicator> world(std::chrono::milliseconds timeout) {
  return std::make_unique<MpiComm>(MPI_COMM_WORLD, false, timeout);
}

}  // namespace shardlab::mpi

#endif
