// The NCCL backend (see comm_nccl.hpp).
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
#include <string>
#include <thread>
#include <vector>

#include "gpu_check.hpp"
#include "shardlab/results.hpp"

namespace shardlab::nccl {

namespace {
using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
  }
  return ncclUint8;
}

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

/// Calls f(std::span<T>) with the typed view of a host buffer.
template <class F>
void typed(void* buf, std::size_t count, DType type, F&& f) {
  visit_dtype(type, [&](auto zero) {
    using T = decltype(zero);
    f(std::span<T>(static_cast<T*>(buf), count));
  });
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
  std::string what;
};

class NcclComm final : public Communicator {
 public:
  NcclComm(Communicator& host, ncclComm_t comm, int device,
           std::unique_ptr<Communicator> owned = {})
      : Communicator(host.rank(), host.size(), host.timeout()),
        host_(host),
        owned_host_(std::move(owned)),
        comm_(comm),
        device_(device) {}
  ~NcclComm() override {
    if (comm_) ncclCommDestroy(comm_);
  }
  std::string_view backend() const override { return "nccl"; }

 protected:
  Request isend_impl(const void* buf, std::size_t bytes, Memory mem, int peer, int tag) override {
    auto r = std::make_unique<NcclRequest>();
    r->what = "send to rank " + std::to_string(peer) + " (" + std::to_string(bytes) + " bytes)";
    if (mem == Memory::host) {
      r->host = host_.isend(
          std::span<const std::uint8_t>(static_cast<const std::uint8_t*>(buf), bytes), peer, tag);
    } else {
      r->batch = open_batch();
      r->batch->ops.push_back(
          [=, this] { NCCL_CHECK(ncclSend(buf, bytes, ncclUint8, peer, comm_, stream())); });
    }
    return Request(std::move(r));
  }

  Request irecv_impl(void* buf, std::size_t bytes, Memory mem, int peer, int tag) override {
    auto r = std::make_unique<NcclRequest>();
    r->what = "recv from rank " + std::to_string(peer) + " (" + std::to_string(bytes) + " bytes)";
    if (mem == Memory::host) {
      r->host =
          host_.irecv(std::span<std::uint8_t>(static_cast<std::uint8_t*>(buf), bytes), peer, tag);
    } else {
      r->batch = open_batch();
      r->batch->ops.push_back(
          [=, this] { NCCL_CHECK(ncclRecv(buf, bytes, ncclUint8, peer, comm_, stream())); });
    }
    return Request(std::move(r));
  }

  void wait_impl(Request::Impl& request) override {
    auto& r = static_cast<NcclRequest&>(request);
    if (!r.batch) return host_.wait(r.host);
    issue(*r.batch);
    finish(r.batch->done, r.what);
  }

  void allreduce_impl(void* buf, std::size_t count, DType type, Memory mem, ReduceOp op) override {
    count_traffic(Op::allreduce,
                  collective_traffic(Op::allreduce, count, dtype_size(type), rank(), size()));
    if (mem == Memory::host)
      return typed(buf, count, type, [&](auto s) { host_.allreduce(s, op); });
    mark_modeled(Op::allreduce);
    flush();
    NCCL_CHECK(ncclAllReduce(buf, buf, count, nccl_type(type), nccl_op(op), comm_, stream()));
    finish("allreduce");
  }

  void reduce_impl(void* buf, std::size_t count, DType type, Memory mem, ReduceOp op,
                   int root) override {
    check_root(root, "reduce");
    count_traffic(Op::reduce,
                  collective_traffic(Op::reduce, count, dtype_size(type), rank(), size(), root));
    if (mem == Memory::host)
      return typed(buf, count, type, [&](auto s) { host_.reduce(s, op, root); });
    mark_modeled(Op::reduce);
    flush();
    NCCL_CHECK(ncclReduce(buf, buf, count, nccl_type(type), nccl_op(op), root, comm_, stream()));
    finish("reduce");
  }

  void broadcast_impl(void* buf, std::size_t count, DType type, Memory mem, int root) override {
    check_root(root, "broadcast");
    count_traffic(Op::broadcast,
                  collective_traffic(Op::broadcast, count, dtype_size(type), rank(), size(), root));
    if (mem == Memory::host)
      return typed(buf, count, type, [&](auto s) { host_.broadcast(s, root); });
    mark_modeled(Op::broadcast);
    flush();
    NCCL_CHECK(ncclBroadcast(buf, buf, count, nccl_type(type), root, comm_, stream()));
    finish("broadcast");
  }

  void reduce_scatter_impl(const void* in, void* out, std::size_t count, DType type, Memory mem,
                           ReduceOp op) override {
    count_traffic(Op::reduce_scatter,
                  collective_traffic(Op::reduce_scatter, count, dtype_size(type), rank(), size()));
    if (mem == Memory::host) {
      const std::size_t all = count * static_cast<std::size_t>(size());
      return typed(out, count, type, [&](auto o) {
        using T = typename decltype(o)::value_type;
        host_.reduce_scatter(std::span<const T>(static_cast<const T*>(in), all), o, op);
      });
    }
    mark_modeled(Op::reduce_scatter);
    flush();
    NCCL_CHECK(ncclReduceScatter(in, out, count, nccl_type(type), nccl_op(op), comm_, stream()));
    finish("reduce_scatter");
  }

  void allgatherv_impl(const void* in, void* out, std::span<const std::size_t> counts, DType type,
                       Memory mem) override {
    const std::size_t elem = dtype_size(type);
    count_traffic(Op::allgather, collective_traffic(Op::allgather, counts, elem, rank()));
    const std::size_t mine = counts[static_cast<std::size_t>(rank())];
    if (mem == Memory::host) {
      std::size_t all = 0;
      for (std::size_t c : counts) all += c;
      return typed(out, all, type, [&](auto o) {
        using T = typename decltype(o)::value_type;
        host_.allgatherv(std::span<const T>(static_cast<const T*>(in), mine), o, counts);
      });
    }
    mark_modeled(Op::allgather);
    flush();
    // Uneven counts: one broadcast per rank into its place, issued as one group.
    NCCL_CHECK(ncclGroupStart());
    std::size_t offset = 0;
    for (int q = 0; q < size(); ++q) {
      const std::size_t n = counts[static_cast<std::size_t>(q)];
      NCCL_CHECK(ncclBroadcast(in, static_cast<char*>(out) + offset * elem, n, nccl_type(type), q,
                               comm_, stream()));
      offset += n;
    }
    NCCL_CHECK(ncclGroupEnd());
    finish("allgather");
  }

  void gatherv_impl(const void* in, void* out, std::span<const std::size_t> counts, DType type,
                    Memory mem, int root) override {
    check_root(root, "gatherv");
    const std::size_t elem = dtype_size(type);
    count_traffic(Op::gather, collective_traffic(Op::gather, counts, elem, rank(), root));
    const std::size_t mine = counts[static_cast<std::size_t>(rank())];
    if (mem == Memory::host) {
      std::size_t all = 0;
      for (std::size_t c : counts) all += c;
      return typed(out, rank() == root ? all : 0, type, [&](auto o) {
        using T = typename decltype(o)::value_type;
        host_.gatherv(std::span<const T>(static_cast<const T*>(in), mine), o, counts, root);
      });
    }
    mark_modeled(Op::gather);
    flush();
    NCCL_CHECK(ncclGroupStart());
    if (rank() == root) {
      std::size_t offset = 0;
      for (int q = 0; q < size(); ++q) {
        const std::size_t n = counts[static_cast<std::size_t>(q)];
        char* dst = static_cast<char*>(out) + offset * elem;
        if (q == root)
          CUDA_CHECK(cudaMemcpyAsync(dst, in, n * elem, cudaMemcpyDeviceToDevice, stream()));
        else
          NCCL_CHECK(ncclRecv(dst, n, nccl_type(type), q, comm_, stream()));
        offset += n;
      }
    } else {
      NCCL_CHECK(ncclSend(in, mine, nccl_type(type), root, comm_, stream()));
    }
    NCCL_CHECK(ncclGroupEnd());
    finish("gatherv");
  }

  void alltoall_impl(const void* in, void* out, std::size_t block, DType type,
                     Memory mem) override {
    const std::size_t elem = dtype_size(type);
    count_traffic(Op::alltoall, collective_traffic(Op::alltoall, block, elem, rank(), size()));
    if (mem == Memory::host) {
      const std::size_t all = block * static_cast<std::size_t>(size());
      return typed(out, all, type, [&](auto o) {
        using T = typename decltype(o)::value_type;
        host_.alltoall(std::span<const T>(static_cast<const T*>(in), all), o);
      });
    }
    mark_modeled(Op::alltoall);
    flush();
    NCCL_CHECK(ncclGroupStart());
    for (int q = 0; q < size(); ++q) {
      NCCL_CHECK(ncclSend(static_cast<const char*>(in) + q * block * elem, block, nccl_type(type),
                          q, comm_, stream()));
      NCCL_CHECK(ncclRecv(static_cast<char*>(out) + q * block * elem, block, nccl_type(type), q,
                          comm_, stream()));
    }
    NCCL_CHECK(ncclGroupEnd());
    finish("alltoall");
  }

  void barrier_impl() override {
    flush();
    host_.barrier();
  }

  std::unique_ptr<Communicator> split_impl(int color, int key) override {
    std::unique_ptr<Communicator> host = host_.split(color, key);
    ncclComm_t sub = nullptr;
    NCCL_CHECK(ncclCommSplit(comm_, color, key, &sub, nullptr));
    Communicator& h = *host;
    return std::make_unique<NcclComm>(h, sub, device_, std::move(host));
  }

 private:
  static cudaStream_t stream() { return cudaStreamPerThread; }

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
    NCCL_CHECK(ncclGroupStart());
    for (auto& op : b.ops) op();
    NCCL_CHECK(ncclGroupEnd());
    CUDA_CHECK(cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(b.done, stream()));
  }

  void finish(const std::string& what) {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(e, stream()));
    try {
      finish(e, what);
    } catch (...) {
      cudaEventDestroy(e);
      throw;
    }
    cudaEventDestroy(e);
  }

  /// Polls `done` until it completes or the timeout runs out; then aborts NCCL and throws.
  void finish(cudaEvent_t done, const std::string& what) {
    const auto deadline = Clock::now() + timeout();
    for (;;) {
      const cudaError_t state = cudaEventQuery(done);
      if (state == cudaSuccess) return;
      if (state != cudaErrorNotReady) CUDA_CHECK(state);
      ncclResult_t async = ncclSuccess;
      NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
      if (async != ncclSuccess)
        throw CommError("rank " + std::to_string(rank()) + ": NCCL " + what +
                        " failed: " + ncclGetErrorString(async));
      if (Clock::now() > deadline) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        throw CommError(
            "rank " + std::to_string(rank()) + ": NCCL " + what + " waited " +
            format_number(static_cast<double>(timeout().count()) / 1000.0, 3) +
            " s (--timeout); did the other ranks skip the call, or are they blocked elsewhere?");
      }
      std::this_thread::yield();
    }
  }

  Communicator& host_;
  std::unique_ptr<Communicator> owned_host_;  // the host side of a split
  ncclComm_t comm_;
  int device_;
  std::shared_ptr<Batch> batch_;
};

}  // namespace

bool available() { return true; }

std::unique_ptr<Communicator> create(Communicator& host, int device) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    throw UsageError("--backend nccl: no CUDA device found");
  // NCCL needs a GPU of its own for every rank: with more ranks than GPUs, say so now
  // rather than hang in ncclCommInitRank (threads: one process sees all the ranks).
  if (host.backend() == "threads" && host.size() > devices)
    throw UsageError("--backend nccl needs one GPU per rank: " + std::to_string(host.size()) +
                     " ranks, " + std::to_string(devices) +
                     " GPU(s) (use fewer ranks, or the threads backend with --device cuda)");
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
  if (host.rank() == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  std::vector<std::uint8_t> bytes(sizeof id);
  std::memcpy(bytes.data(), &id, sizeof id);
  {
    Communicator::Uncounted quiet(host);
    host.broadcast(bytes, 0);
  }
  std::memcpy(&id, bytes.data(), sizeof id);
  ncclComm_t comm = nullptr;
  NCCL_CHECK(ncclCommInitRank(&comm, host.size(), id, host.rank()));
  return std::make_unique<NcclComm>(host, comm, device);
}

}  // namespace shardlab::nccl

#endif
