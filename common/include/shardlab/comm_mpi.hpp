// The MPI backend: ranks are processes started by `mpirun -np N`.
//
// Point-to-point calls are MPI_Isend/MPI_Irecv, waited for by polling MPI_Test against
// the deadline, so a hung wait becomes a CommError. Collectives are the library's own
// blocking calls (MPI_Allreduce, ...), watched by a thread that ends the job with a
// diagnostic if one outlasts the timeout. Their algorithms are hidden inside OpenMPI,
// so their counters are modeled (see CommStats).
#pragma once

#include <chrono>
#include <memory>

#include "shardlab/comm.hpp"

namespace shardlab::mpi {

/// True when this build has the MPI backend.
bool available();
/// MPI_Init (once per process). Throws UsageError when the build has no MPI.
void init(int* argc, char*** argv, std::chrono::milliseconds timeout);
/// MPI_Finalize, if init ran.
void finalize();
/// Ends every process of the job with `code` (MPI_Abort).
[[noreturn]] void abort(int code);
/// This process's rank and the job's size in MPI_COMM_WORLD.
int world_rank();
int world_size();
/// A communicator over MPI_COMM_WORLD.
std::unique_ptr<Communicator> world(std::chrono::milliseconds timeout);

}  // namespace shardlab::mpi
