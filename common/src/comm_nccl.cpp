// The NCCL backend (see comm_nccl.hpp). NCCL is not linked: it is opened when the first
// NCCL communicator is created (gpu_library.hpp says why).
#include "shardlab/comm_nccl.hpp"

#include "shardlab/check.hpp"

#ifndef SHARDLAB_HAVE_NCCL

namespace shardlab::nccl {
bool available() { return false; }
std::unique_ptr<Communicator> create(Communicator&, int) {
  throw UsageError(
      "this build has no NCCL backend (install NCCL with the CUDA toolkit and rebuild)");
}
}  // namespace shardlab::nccl

#else

#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "gpu_check.hpp"
#include "gpu_library.hpp"
#include "shardlab/cuda.hpp"
#include "shardlab/results.hpp"

namespace shardlab::nccl {

namespace {
using Clock = std::chrono::steady_clock;

// The NCCL functions this file calls, opened on first use (the lookup is thread-safe).
// clang-format off
#define SHARDLAB_NCCL_FUNCTIONS(X) \
  X(ncclGetUniqueId) X(ncclCommInitRankConfig) X(ncclCommSplit) X(ncclCommFinalize) \
  X(ncclCommDestroy) X(ncclCommAbort) X(ncclCommGetAsyncError) X(ncclGetErrorString) \
  X(ncclGroupStart) X(ncclGroupEnd) X(ncclSend) X(ncclRecv) \
  X(ncclAllReduce) X(ncclReduce) X(ncclBroadcast) X(ncclReduceScatter) X(ncclAllGather)
// clang-format on
struct Nccl {
  SHARDLAB_GPU_DECLARE(SHARDLAB_NCCL_FUNCTIONS)
};
const Nccl& api() {
  static const Nccl nccl = [] {
    Nccl n;
    SHARDLAB_GPU_BIND(SHARDLAB_NCCL_FUNCTIONS, n,
                      gpu::open_library("NCCL", {SHARDLAB_NCCL_SONAME, SHARDLAB_NCCL_PATH}),
                      "NCCL");
    return n;
  }();
  return nccl;
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::f16:
      return ncclFloat16;
    case DType::bf16:
      return ncclBfloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
  }
  return ncclUint8;
}

/// NCCL's avg divides each contribution by N before summing (the others sum, then divide):
/// the same up to rounding.
ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclAvg;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  return ncclSum;
}

/// The communicators are non-blocking (config.blocking = 0): a call that would wait inside
/// NCCL — creating a communicator, splitting one, the first transfer between two ranks in
/// ncclGroupEnd — returns ncclInProgress and goes on in NCCL's own thread, and until the
/// communicator's state is ncclSuccess again no other NCCL call may be made on it. The
/// functions below wait for that state.

/// Aborts `comm` (ncclCommAbort: never destroy one that may be stuck) and forgets it.
void abort_comm(ncclComm_t& comm) {
  if (comm) api().ncclCommAbort(comm);
  comm = nullptr;
}

/// "rank R: NCCL what", the start of every message below.
std::string who(const Communicator& host, const std::string& what) {
  return "rank " + std::to_string(host.rank()) + ": NCCL " + what;
}

/// The communicator's state: ncclSuccess (done) or ncclInProgress (still at work); an
/// error aborts it and throws.
ncclResult_t state_of(ncclComm_t& comm, const Communicator& host, const std::string& what) {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t asked = api().ncclCommGetAsyncError(comm, &state);
  if (asked != ncclSuccess) state = asked;
  if (state == ncclSuccess || state == ncclInProgress) return state;
  abort_comm(comm);
  throw CommError(who(host, what) + " failed: " + api().ncclGetErrorString(state));
}

/// While waiting on `comm`: the job's end (another rank failed) or the deadline aborts it
/// and throws; `hint` ends the timeout's message.
void give_up_if_due(ncclComm_t& comm, const Communicator& host, Clock::time_point deadline,
                    const std::string& what, const char* hint) {
  try {
    host.check_not_aborted();
  } catch (...) {
    abort_comm(comm);
    throw;
  }
  if (Clock::now() <= deadline) return;
  abort_comm(comm);
  throw CommError(who(host, what) + " waited " + format_seconds(host.timeout()) + " (--timeout); " +
                  hint);
}

/// Polls the communicator's state until it is done (or an error, the deadline, the job's
/// end).
void settle(ncclComm_t& comm, const Communicator& host, Clock::time_point deadline,
            const std::string& what) {
  while (state_of(comm, host, what) != ncclSuccess) {
    give_up_if_due(comm, host, deadline, what,
                   "did every rank make the call, and can they reach each other (NCCL_DEBUG="
                   "INFO says how NCCL connects)?");
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

/// An NCCL call on a non-blocking communicator: an error throws (naming the call), and
/// ncclInProgress waits until the communicator has settled.
void call(ncclResult_t r, ncclComm_t& comm, const Communicator& host, const char* what) {
  if (r == ncclInProgress) return settle(comm, host, Clock::now() + host.timeout(), what);
  if (r != ncclSuccess)
    throw CommError(who(host, what) + " failed: " + api().ncclGetErrorString(r));
}

/// ncclGroupStart() ... ncclGroupEnd(), closed even when a call in between throws (an
/// open group defers every later NCCL call of the thread, destroy included). The calls in
/// between are only queued; ncclGroupEnd issues them (and may be the one to wait).
class Group {
 public:
  Group(ncclComm_t& comm, const Communicator& host)
      : comm_(comm), host_(host), exceptions_(std::uncaught_exceptions()) {
    NCCL_CHECK(api().ncclGroupStart());
  }
  ~Group() noexcept(false) {
    const ncclResult_t r = api().ncclGroupEnd();
    if (std::uncaught_exceptions() == exceptions_) {
      call(r, comm_, host_, "group of calls");
      return;
    }
    // Unwinding already: the group's state cannot be waited for here, and an unsettled
    // communicator refuses every later call, so it is aborted.
    if (r != ncclSuccess) abort_comm(comm_);
  }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

 private:
  ncclComm_t& comm_;
  const Communicator& host_;
  int exceptions_;
};

/// A configuration for non-blocking communicators (see settle).
ncclConfig_t non_blocking() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

/// Point-to-point operations posted since the last wait, issued together at the next.
struct Batch {
  std::vector<std::function<void()> > ops;
  cudaEvent_t done = nullptr;
  bool issued = false;
  ~Batch() {
    if (done) cudaEventDestroy(done);
  }
};

struct NcclRequest final : Request::Impl {
  Request host;                  // a host-buffer transfer, on the host communicator
  std::shared_ptr<Batch> batch;  // or a device one, in a batch
  cudaEvent_t done = nullptr;    // or a non-blocking collective, ending at this event
  std::string what;
  ~NcclRequest() override {
    if (done) cudaEventDestroy(done);
  }
};

class NcclComm;
/// The NCCL communicators of this thread (one rank's). A wait on one first issues the
/// sends and receives posted on the others: a pipeline stage that sends on one
/// communicator and then receives on another would otherwise wait for ever for its
/// peer's send, which waits in a batch not yet issued.
thread_local std::vector<NcclComm*> thread_comms;

class NcclComm final : public Communicator {
 public:
  NcclComm(Communicator& host, ncclComm_t comm, int device,
           std::unique_ptr<Communicator> owned = {})
      : Communicator(host.rank(), host.size(), host.timeout()),
        host_(host),
        owned_host_(std::move(owned)),
        comm_(comm),
        device_(device) {
    // A stream of the communicator's own: with a non-blocking communicator NCCL may
    // enqueue from its own thread, where cudaStreamPerThread would name that thread's
    // stream, not this rank's.
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&caller_done_, cudaEventDisableTiming));
    thread_comms.push_back(this);
  }
  /// Finalizes (flushes what was issued) and destroys the communicator; one that does not
  /// finish within the timeout, or has failed, is aborted instead.
  ~NcclComm() override {
    std::erase(thread_comms, this);
    if (comm_) {
      try {
        call(api().ncclCommFinalize(comm_), comm_, host_, "finalize");
        if (comm_) api().ncclCommDestroy(comm_);
      } catch (...) {  // settle has aborted it, unless finalize failed at once
        abort_comm(comm_);
      }
      comm_ = nullptr;
    }
    if (caller_done_) cudaEventDestroy(caller_done_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  std::string_view backend() const override { return "nccl"; }
  void check_not_aborted() const override { host_.check_not_aborted(); }

 protected:
  Request isend_impl(const void* buf, std::size_t bytes, Memory mem, int peer, int tag) override {
    auto r = std::make_unique<NcclRequest>();
    r->what = "send to rank " + std::to_string(peer) + " (" + std::to_string(bytes) + " bytes)";
    if (mem == Memory::host) {
      r->host = host_.isend(ConstBuffer(buf, bytes, DType::u8, Memory::host), peer, tag);
    } else {
      r->batch = open_batch();
      r->batch->ops.push_back(
          [=, this] { NCCL_CHECK(api().ncclSend(buf, bytes, ncclUint8, peer, comm_, stream_)); });
    }
    return Request(std::move(r));
  }

  Request irecv_impl(void* buf, std::size_t bytes, Memory mem, int peer, int tag) override {
    auto r = std::make_unique<NcclRequest>();
    r->what = "recv from rank " + std::to_string(peer) + " (" + std::to_string(bytes) + " bytes)";
    if (mem == Memory::host) {
      r->host = host_.irecv(MutableBuffer(buf, bytes, DType::u8, Memory::host), peer, tag);
    } else {
      r->batch = open_batch();
      r->batch->ops.push_back(
          [=, this] { NCCL_CHECK(api().ncclRecv(buf, bytes, ncclUint8, peer, comm_, stream_)); });
    }
    return Request(std::move(r));
  }

  void wait_impl(Request::Impl& request) override {
    auto& r = static_cast<NcclRequest&>(request);
    if (r.done) return finish(r.done, r.what);
    if (!r.batch) return host_.wait(r.host);
    issue(*r.batch);
    finish(r.batch->done, r.what);
  }

  void run_collective(const Collective& c) override {
    if (c.op == Op::barrier) {
      flush();
      host_.barrier();
      return;
    }
    if (c.memory == Memory::host) return on_host(c);
    count_modeled(c);
    flush();
    enqueue(c);
    finish(c.describe());
  }

  Request start_collective(Collective c) override {
    if (c.memory == Memory::host) {  // the program's bookkeeping: run it now
      on_host(c);
      return {};
    }
    count_modeled(c);
    flush();
    enqueue(c);
    auto r = std::make_unique<NcclRequest>();
    r->what = c.describe();
    CUDA_CHECK(cudaEventCreateWithFlags(&r->done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(r->done, stream_));
    return Request(std::move(r));
  }

  std::unique_ptr<Communicator> split_impl(int color, int key) override {
    std::unique_ptr<Communicator> host = host_.split(color, key);
    ncclComm_t sub = nullptr;
    ncclConfig_t config = non_blocking();
    const auto deadline = Clock::now() + timeout();
    // The split goes on in NCCL's thread: the parent is "in progress" (ncclCommSplit itself
    // returns ncclSuccess) and `sub` stays null until it is done, so the parent is waited
    // for first, then the new communicator.
    const ncclResult_t r = api().ncclCommSplit(live(), color, key, &sub, &config);
    if (r != ncclSuccess && r != ncclInProgress) call(r, comm_, host_, "split");
    settle(comm_, host_, deadline, "split");
    if (!sub)
      throw CommError("rank " + std::to_string(rank()) + ": NCCL split gave no communicator");
    settle(sub, *host, deadline, "split (the new communicator)");
    Communicator& h = *host;
    return std::make_unique<NcclComm>(h, sub, device_, std::move(host));
  }

 private:
  /// The communicator, or an error when an earlier failure has aborted it.
  ncclComm_t live() const {
    if (!comm_)
      throw CommError("rank " + std::to_string(rank()) +
                      ": this NCCL communicator was aborted after an earlier failure");
    return comm_;
  }

  /// What the rank queued on its own stream before the call comes first on NCCL's.
  void after_caller() {
    CUDA_CHECK(cudaEventRecord(caller_done_, cudaStreamPerThread));
    CUDA_CHECK(cudaStreamWaitEvent(stream_, caller_done_, 0));
  }

  /// Host buffers go through the host communicator; its counters' growth is added here.
  void on_host(const Collective& c) {
    const CommStats before = host_.stats();
    auto whole = [&](std::size_t n) { return MutableBuffer(c.out, n, c.type, Memory::host); };
    auto from = [&](std::size_t n) { return ConstBuffer(c.in, n, c.type, Memory::host); };
    const auto total = std::accumulate(c.counts.begin(), c.counts.end(), std::size_t{0});
    const auto r = static_cast<std::size_t>(rank());
    switch (c.op) {
      case Op::allreduce:
        host_.allreduce(whole(c.count), c.reduce);
        break;
      case Op::reduce:
        host_.reduce(whole(c.count), c.reduce, c.root);
        break;
      case Op::broadcast:
        host_.broadcast(whole(c.count), c.root);
        break;
      case Op::reduce_scatter:
        host_.reduce_scatter(
            from(c.count),
            whole(static_cast<std::size_t>(
                shard_range(static_cast<std::int64_t>(c.count), size(), rank()).length)),
            c.reduce);
        break;
      case Op::allgather:
        host_.allgatherv(from(c.counts[r]), whole(total), c.counts);
        break;
      case Op::gather:
        host_.gatherv(from(c.counts[r]), whole(rank() == c.root ? total : 0), c.counts, c.root);
        break;
      case Op::alltoall:
        if (c.vector)
          host_.alltoallv(
              from(std::accumulate(c.counts.begin(), c.counts.end(), std::size_t{0})), c.counts,
              whole(std::accumulate(c.recv_counts.begin(), c.recv_counts.end(), std::size_t{0})),
              c.recv_counts);
        else
          host_.alltoall(from(c.count * static_cast<std::size_t>(size())),
                         whole(c.count * static_cast<std::size_t>(size())));
        break;
      default:
        throw Error("nccl backend: no collective " + std::string(op_name(c.op)));
    }
    const CommStats delta = host_.stats().since(before);
    count_traffic(c.op, delta[c.op].bytes_sent, delta[c.op].bytes_received);
    if (delta.is_modeled(c.op)) mark_modeled(c.op);
  }

  /// Puts one collective on the stream: NCCL's own call, or a group of them where NCCL
  /// has none (uneven reduce_scatter and allgather, gather, alltoall(v)).
  void enqueue(const Collective& c) {
    const std::size_t elem = dtype_size(c.type);
    const ncclDataType_t t = nccl_type(c.type);
    const int N = size(), r = rank();
    const ncclComm_t comm = live();
    after_caller();
    auto at = [&](const void* p, std::size_t elements) {
      return static_cast<const char*>(p) + elements * elem;
    };
    auto at_out = [&](std::size_t elements) { return static_cast<char*>(c.out) + elements * elem; };
    switch (c.op) {
      case Op::allreduce:
        return settled(
            api().ncclAllReduce(c.out, c.out, c.count, t, nccl_op(c.reduce), comm, stream_), c);
      case Op::reduce:
        return settled(
            api().ncclReduce(c.out, c.out, c.count, t, nccl_op(c.reduce), c.root, comm, stream_),
            c);
      case Op::broadcast:
        return settled(api().ncclBroadcast(c.out, c.out, c.count, t, c.root, comm, stream_), c);
      case Op::reduce_scatter: {
        if (c.count % static_cast<std::size_t>(N) == 0) {
          return settled(api().ncclReduceScatter(c.in, c.out, c.count / static_cast<std::size_t>(N),
                                                 t, nccl_op(c.reduce), comm, stream_),
                         c);
        }
        // Uneven shards: one reduce per shard, to its owner, issued as one group.
        Group group(comm_, host_);
        for (int q = 0; q < N; ++q) {
          const ShardRange s = shard_range(static_cast<std::int64_t>(c.count), N, q);
          NCCL_CHECK(api().ncclReduce(at(c.in, static_cast<std::size_t>(s.offset)), c.out,
                                      static_cast<std::size_t>(s.length), t, nccl_op(c.reduce), q,
                                      comm, stream_));
        }
        return;
      }
      case Op::allgather: {
        const bool even = std::adjacent_find(c.counts.begin(), c.counts.end(),
                                             std::not_equal_to<>()) == c.counts.end();
        if (even) {
          return settled(api().ncclAllGather(c.in, c.out, c.counts[0], t, comm, stream_), c);
        }
        // Uneven counts: one broadcast per rank into its place, issued as one group.
        Group group(comm_, host_);
        std::size_t offset = 0;
        for (int q = 0; q < N; ++q) {
          const std::size_t n = c.counts[static_cast<std::size_t>(q)];
          NCCL_CHECK(api().ncclBroadcast(c.in, at_out(offset), n, t, q, comm, stream_));
          offset += n;
        }
        return;
      }
      case Op::gather: {
        Group group(comm_, host_);
        if (r == c.root) {
          std::size_t offset = 0;
          for (int q = 0; q < N; ++q) {
            const std::size_t n = c.counts[static_cast<std::size_t>(q)];
            if (q == c.root)
              CUDA_CHECK(cudaMemcpyAsync(at_out(offset), c.in, n * elem, cudaMemcpyDeviceToDevice,
                                         stream_));
            else
              NCCL_CHECK(api().ncclRecv(at_out(offset), n, t, q, comm, stream_));
            offset += n;
          }
        } else {
          NCCL_CHECK(api().ncclSend(c.in, c.counts[static_cast<std::size_t>(r)], t, c.root, comm,
                                    stream_));
        }
        return;
      }
      case Op::alltoall: {
        // Grouped sends and receives (NCCL has no alltoall(v)): block q to rank q, and
        // rank q's block for me into place q.
        Group group(comm_, host_);
        std::size_t sent = 0, received = 0;
        for (int q = 0; q < N; ++q) {
          const std::size_t out_n = c.vector ? c.counts[static_cast<std::size_t>(q)] : c.count;
          const std::size_t in_n = c.vector ? c.recv_counts[static_cast<std::size_t>(q)] : c.count;
          NCCL_CHECK(api().ncclSend(at(c.in, sent), out_n, t, q, comm, stream_));
          NCCL_CHECK(api().ncclRecv(at_out(received), in_n, t, q, comm, stream_));
          sent += out_n;
          received += in_n;
        }
        return;
      }
      default:
        throw Error("nccl backend: no collective " + std::string(op_name(c.op)));
    }
  }

  /// A collective issued alone (not in a group) on the non-blocking communicator: NCCL
  /// may still be enqueueing it (ncclInProgress), and nothing may follow on its stream, not
  /// even the event that marks its end, until it has.
  void settled(ncclResult_t r, const Collective& c) { call(r, comm_, host_, c.describe().c_str()); }

  /// Sends and receives posted but not yet waited for go out before a collective, so that
  /// a peer waiting on them is not stuck behind it.
  void flush() {
    if (batch_ && !batch_->issued) issue(*batch_);
  }

  std::shared_ptr<Batch> open_batch() {
    if (!batch_ || batch_->issued) batch_ = std::make_shared<Batch>();
    return batch_;
  }

  /// Issues a batch's sends and receives as one NCCL group, and marks its end.
  void issue(Batch& b) {
    if (b.issued) return;
    b.issued = true;
    (void)live();
    after_caller();
    {
      Group group(comm_, host_);
      for (auto& op : b.ops) op();
    }
    CUDA_CHECK(cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(b.done, stream_));
  }

  void finish(const std::string& what) {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(e, stream_));
    try {
      finish(e, what);
    } catch (...) {
      cudaEventDestroy(e);
      throw;
    }
    cudaEventDestroy(e);
  }

  /// Polls `done` until it completes, with the communicator's state (an error, the
  /// timeout or the job's end aborts the communicator and throws).
  void finish(cudaEvent_t done, const std::string& what) {
    for (NcclComm* other : thread_comms) other->flush();
    const auto deadline = wait_deadline();
    for (;;) {
      const cudaError_t state = cudaEventQuery(done);
      if (state == cudaSuccess) return;
      if (state != cudaErrorNotReady) CUDA_CHECK(state);
      (void)live();
      state_of(comm_, host_, what);
      give_up_if_due(comm_, host_, deadline, what,
                     "did the other ranks skip the call, or are they blocked elsewhere?");
      std::this_thread::yield();
    }
  }

  Communicator& host_;
  std::unique_ptr<Communicator> owned_host_;  // the host side of a split
  ncclComm_t comm_;
  int device_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t caller_done_ = nullptr;
  std::shared_ptr<Batch> batch_;
};

}  // namespace

bool available() { return true; }

std::unique_ptr<Communicator> create(Communicator& host, int device) {
  const int devices = cuda::device_count();
  if (devices == 0) throw UsageError("--backend nccl: no CUDA device found");
  // NCCL needs a GPU of its own for every rank: with more ranks than GPUs, say so now
  // rather than hang in ncclCommInitRank (threads: one process sees all the ranks).
  if (host.backend() == "threads" && host.size() > devices)
    throw UsageError("--backend nccl needs one GPU per rank: " + std::to_string(host.size()) +
                     " ranks, " + std::to_string(devices) +
                     " GPU(s) (use fewer ranks, or the threads backend with --device cuda)");
  api();  // every rank opens NCCL before the first collective: all fail alike without it
  // Across processes (MPI), no two ranks of one host may pick the same GPU either.
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  const auto host_id = static_cast<std::int64_t>(std::hash<std::string>{}(name)&0x7fffffffffffffff);
  const std::vector<std::int64_t> hosts = host.gather_values(host_id);
  const std::vector<std::int32_t> gpus = host.gather_values(static_cast<std::int32_t>(device));
  for (int q = 0; q < host.size(); ++q)
    for (int p = 0; p < q; ++p)
      if (hosts[static_cast<std::size_t>(p)] == hosts[static_cast<std::size_t>(q)] &&
          gpus[static_cast<std::size_t>(p)] == gpus[static_cast<std::size_t>(q)])
        throw UsageError("--backend nccl needs one GPU per rank: ranks " + std::to_string(p) +
                         " and " + std::to_string(q) + " would share GPU " +
                         std::to_string(gpus[static_cast<std::size_t>(q)]) +
                         " of one host (start fewer ranks per host)");
  CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id{};
  if (host.rank() == 0) NCCL_CHECK(api().ncclGetUniqueId(&id));
  std::vector<std::uint8_t> bytes(sizeof id);
  std::memcpy(bytes.data(), &id, sizeof id);
  {
    Communicator::Uncounted not_counted(host);
    host.broadcast(bytes, 0);
  }
  std::memcpy(&id, bytes.data(), sizeof id);
  // Non-blocking (see settle): a rank that never joins ends in a message at the timeout,
  // not a hang inside ncclCommInitRank.
  ncclComm_t comm = nullptr;
  ncclConfig_t config = non_blocking();
  const auto deadline = Clock::now() + host.timeout();
  const ncclResult_t r = api().ncclCommInitRankConfig(&comm, host.size(), id, host.rank(), &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    abort_comm(comm);
    throw CommError(who(host, "communicator creation") + " failed: " + api().ncclGetErrorString(r));
  }
  settle(comm, host, deadline, "communicator creation (ncclCommInitRank)");
  return std::make_unique<NcclComm>(host, comm, device);
}

}  // namespace shardlab::nccl

const char* shardlab::gpu::nccl_error_string(ncclResult_t r) {
  return shardlab::nccl::api().ncclGetErrorString(r);
}

#endif
