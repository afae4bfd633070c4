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
void init(int*, char***, std::chrono::milliseconds) { missing(); }
void finalize() {}
void abort(int code) { std::exit(code); }
int world_rank() { return 0; }
int world_size() { return 1; }
std::unique_ptr<Communicator> world(std::chrono::milliseconds) { missing(); }
}  // namespace shardlab::mpi

#else

#include <mpi.h>

#include <atomic>
#include <climits>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>

#include "shardlab/results.hpp"

namespace shardlab::mpi {

namespace {
using Clock = std::chrono::steady_clock;

bool initialized = false;

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

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
    case DType::u8:
      return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return MPI_SUM;  // avg: sum, then divide by N here
    case ReduceOp::max:
      return MPI_MAX;
    case ReduceOp::min:
      return MPI_MIN;
  }
  return MPI_SUM;
}

int as_int(std::size_t n, const char* what) {
  if (n > static_cast<std::size_t>(INT_MAX))
    throw UsageError(std::string(what) + ": " + std::to_string(n) +
                     " elements is more than one MPI call takes (2^31 - 1)");
  return static_cast<int>(n);
}

// ---------------------------------------------------------------------------
// The watchdog: MPI's blocking collectives cannot time out, so a thread watches the
// one in progress and ends the job with a diagnostic when it outlasts the timeout.

class Watchdog {
 public:
  void start(std::chrono::milliseconds timeout) {
    timeout_ = timeout;
    thread_ = std::thread([this] { loop(); });
  }
  void stop() {
    stopping_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  void enter(std::string what) {
    std::lock_guard<std::mutex> lock(m_);
    what_ = std::move(what);
    since_ = Clock::now();
    busy_ = true;
  }
  void leave() {
    std::lock_guard<std::mutex> lock(m_);
    busy_ = false;
  }

 private:
  void loop() {
    while (!stopping_.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      std::lock_guard<std::mutex> lock(m_);
      if (busy_ && Clock::now() - since_ > timeout_) {
        std::fprintf(
            stderr,
            "rank %d: %s waited %s (--timeout) for the other ranks; did they skip the "
            "call, or are they blocked elsewhere? Ending the job.\n",
            world_rank(), what_.c_str(),
            (format_number(static_cast<double>(timeout_.count()) / 1000.0, 3) + " s").c_str());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
    }
  }
  std::chrono::milliseconds timeout_{60000};
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::mutex m_;
  std::string what_;
  Clock::time_point since_;
  bool busy_ = false;
};

Watchdog watchdog;

struct Watched {
  explicit Watched(std::string what) { watchdog.enter(std::move(what)); }
  ~Watched() { watchdog.leave(); }
};

// ---------------------------------------------------------------------------

struct MpiRequest final : Request::Impl {
  MPI_Request request = MPI_REQUEST_NULL;
  bool is_send = false;
  int peer = 0, tag = 0;
  std::size_t bytes = 0;
  ~MpiRequest() override {
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

class MpiComm final : public Communicator {
 public:
  MpiComm(MPI_Comm comm, bool owned, std::chrono::milliseconds timeout)
      : Communicator(rank_of(comm), size_of(comm), timeout), comm_(comm), owned_(owned) {
    MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  }
  ~MpiComm() override {
    if (owned_) MPI_Comm_free(&comm_);
  }
  std::string_view backend() const override { return "mpi"; }

 protected:
  Request isend_impl(const void* buf, std::size_t bytes, Memory mem, int peer, int tag) override {
    host_only(mem, "send");
    auto r = describe(true, peer, tag, bytes);
    MPI_CHECK(MPI_Isend(buf, as_int(bytes, "send"), MPI_BYTE, peer, tag, comm_, &r->request));
    return Request(std::move(r));
  }

  Request irecv_impl(void* buf, std::size_t bytes, Memory mem, int peer, int tag) override {
    host_only(mem, "recv");
    auto r = describe(false, peer, tag, bytes);
    MPI_CHECK(MPI_Irecv(buf, as_int(bytes, "recv"), MPI_BYTE, peer, tag, comm_, &r->request));
    return Request(std::move(r));
  }

  void wait_impl(Request::Impl& request) override {
    auto& r = static_cast<MpiRequest&>(request);
    const auto deadline = Clock::now() + timeout();
    MPI_Status status;
    int done = 0;
    for (;;) {
      const int code = MPI_Test(&r.request, &done, &status);
      if (code != MPI_SUCCESS && !r.is_send) {
        throw CommError("rank " + std::to_string(rank()) + ": " + r.describe() +
                        " failed: the message from rank " + std::to_string(r.peer) +
                        " is longer than the receive buffer");
      }
      MPI_CHECK(code);
      if (done) break;
      if (Clock::now() > deadline) {
        throw CommError(
            "rank " + std::to_string(rank()) + ": " + r.describe() + " waited " +
            format_number(static_cast<double>(timeout().count()) / 1000.0, 3) + " s (--timeout): " +
            (r.is_send ? "rank " + std::to_string(r.peer) + " never posted a matching recv"
                       : "no matching send came; is rank " + std::to_string(r.peer) +
                             " sending to rank " + std::to_string(rank()) + " with tag " +
                             std::to_string(r.tag) + "?"));
      }
    }
    if (!r.is_send) {
      int got = 0;
      MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &got));
      if (static_cast<std::size_t>(got) != r.bytes)
        throw CommError("rank " + std::to_string(rank()) + " posted a recv of " +
                        std::to_string(r.bytes) + " bytes from rank " + std::to_string(r.peer) +
                        " (tag " + std::to_string(r.tag) + "), but rank " + std::to_string(r.peer) +
                        " sent " + std::to_string(got) + " bytes");
    }
  }

  void allreduce_impl(void* buf, std::size_t count, DType type, Memory mem, ReduceOp op) override {
    host_only(mem, "allreduce");
    modeled(Op::allreduce, count, type);
    Watched w("allreduce");
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, buf, as_int(count, "allreduce"), mpi_type(type),
                            mpi_op(op), comm_));
    finish_reduce(buf, count, type, op, size());
  }

  void reduce_impl(void* buf, std::size_t count, DType type, Memory mem, ReduceOp op,
                   int root) override {
    host_only(mem, "reduce");
    check_root(root, "reduce");
    modeled(Op::reduce, count, type, root);
    Watched w("reduce");
    const int n = as_int(count, "reduce");
    if (rank() == root) {
      MPI_CHECK(MPI_Reduce(MPI_IN_PLACE, buf, n, mpi_type(type), mpi_op(op), root, comm_));
      finish_reduce(buf, count, type, op, size());
    } else {
      MPI_CHECK(MPI_Reduce(buf, nullptr, n, mpi_type(type), mpi_op(op), root, comm_));
    }
  }

  void broadcast_impl(void* buf, std::size_t count, DType type, Memory mem, int root) override {
    host_only(mem, "broadcast");
    check_root(root, "broadcast");
    modeled(Op::broadcast, count, type, root);
    Watched w("broadcast");
    MPI_CHECK(MPI_Bcast(buf, as_int(count, "broadcast"), mpi_type(type), root, comm_));
  }

  void reduce_scatter_impl(const void* in, void* out, std::size_t count, DType type, Memory mem,
                           ReduceOp op) override {
    host_only(mem, "reduce_scatter");
    modeled(Op::reduce_scatter, count, type);
    Watched w("reduce_scatter");
    MPI_CHECK(MPI_Reduce_scatter_block(in, out, as_int(count, "reduce_scatter"), mpi_type(type),
                                       mpi_op(op), comm_));
    finish_reduce(out, count, type, op, size());
  }

  void allgatherv_impl(const void* in, void* out, std::span<const std::size_t> counts, DType type,
                       Memory mem) override {
    host_only(mem, "allgather");
    count_traffic(Op::allgather,
                  collective_traffic(Op::allgather, counts, dtype_size(type), rank()));
    mark_modeled(Op::allgather);
    const auto [n, displs] = ints(counts, "allgather");
    Watched w("allgather");
    MPI_CHECK(MPI_Allgatherv(in, n[static_cast<std::size_t>(rank())], mpi_type(type), out, n.data(),
                             displs.data(), mpi_type(type), comm_));
  }

  void gatherv_impl(const void* in, void* out, std::span<const std::size_t> counts, DType type,
                    Memory mem, int root) override {
    host_only(mem, "gatherv");
    check_root(root, "gatherv");
    count_traffic(Op::gather,
                  collective_traffic(Op::gather, counts, dtype_size(type), rank(), root));
    mark_modeled(Op::gather);
    const auto [n, displs] = ints(counts, "gather");
    Watched w("gather");
    MPI_CHECK(MPI_Gatherv(in, n[static_cast<std::size_t>(rank())], mpi_type(type), out, n.data(),
                          displs.data(), mpi_type(type), root, comm_));
  }

  void alltoall_impl(const void* in, void* out, std::size_t block, DType type,
                     Memory mem) override {
    host_only(mem, "alltoall");
    modeled(Op::alltoall, block, type);
    Watched w("alltoall");
    const int n = as_int(block, "alltoall");
    MPI_CHECK(MPI_Alltoall(in, n, mpi_type(type), out, n, mpi_type(type), comm_));
  }

  void barrier_impl() override {
    Watched w("barrier");
    MPI_CHECK(MPI_Barrier(comm_));
  }

  std::unique_ptr<Communicator> split_impl(int color, int key) override {
    MPI_Comm sub = MPI_COMM_NULL;
    {
      Watched w("split");
      MPI_CHECK(MPI_Comm_split(comm_, color, key, &sub));
    }
    return std::make_unique<MpiComm>(sub, true, timeout());
  }

 private:
  /// Open MPI as packaged here is not CUDA-aware: device buffers are refused, not crashed on.
  static void host_only(Memory mem, const char* what) {
    if (mem == Memory::device)
      throw UsageError(std::string(what) +
                       ": the MPI backend takes host buffers only (this Open MPI is not "
                       "CUDA-aware); use the threads backend for device buffers");
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
  void modeled(Op op, std::size_t count, DType type, int root = 0) {
    count_traffic(op, collective_traffic(op, count, dtype_size(type), rank(), size(), root));
    mark_modeled(op);
  }
  static std::pair<std::vector<int>, std::vector<int> > ints(std::span<const std::size_t> counts,
                                                             const char* what) {
    std::vector<int> n, displs;
    std::size_t offset = 0;
    for (std::size_t c : counts) {
      n.push_back(as_int(c, what));
      displs.push_back(as_int(offset, what));
      offset += c;
    }
    return {n, displs};
  }

  MPI_Comm comm_;
  bool owned_;
};

}  // namespace

bool available() { return true; }

void init(int* argc, char*** argv, std::chrono::milliseconds timeout) {
  if (initialized) return;
  int provided = 0;
  // The watchdog thread calls MPI_Abort while the rank's thread may sit in MPI.
  MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
  initialized = true;
  watchdog.start(timeout);
}

void finalize() {
  if (!initialized) return;
  watchdog.stop();
  MPI_Finalize();
  initialized = false;
}

void abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
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

std::unique_ptr<Communicator> world(std::chrono::milliseconds timeout) {
  return std::make_unique<MpiComm>(MPI_COMM_WORLD, false, timeout);
}

}  // namespace shardlab::mpi

#endif
