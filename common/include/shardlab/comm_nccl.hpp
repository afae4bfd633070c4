// The NCCL backend: one GPU per rank, NCCL's own collectives and point-to-point.
//
// A NCCL communicator is built on top of a host one (threads or MPI): rank 0 creates the
// ncclUniqueId and the host communicator broadcasts it, then every rank joins with
// ncclCommInitRank on its own GPU. Device buffers go through NCCL on the rank's stream;
// host buffers (the program's bookkeeping) go through the host communicator, so one
// communicator serves both.
//
// Point-to-point: NCCL has no tags and no requests. Sends and receives posted between
// two waits are issued together in one ncclGroupStart/End at the first wait, so a
// sendrecv (or any set of isend/irecv) cannot deadlock on itself; messages between two
// ranks match in the order they were posted, whatever their tags.
// Waits poll the stream against the timeout; a wait that runs out aborts the NCCL
// communicator (ncclCommAbort) and throws CommError naming the rank and the operation.
#pragma once

#include <memory>

#include "shardlab/comm.hpp"

namespace shardlab::nccl {

/// True when this build has NCCL.
bool available();

/// A NCCL communicator over the same ranks as `host` (which must outlive it), on CUDA
/// device `device`. Every rank of `host` calls it. Throws UsageError when the build has
/// no NCCL, or when ranks share a GPU (NCCL needs one GPU per rank).
std::unique_ptr<Communicator> create(Communicator& host, int device);

}  // namespace shardlab::nccl
