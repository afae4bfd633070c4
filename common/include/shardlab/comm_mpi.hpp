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
#include <string>

#include "shardlab/comm.hpp"

namespace shardlab::mpi {

/// True when this build has the MPI backend.
bool available();
/// MPI_Init (once per process). Throws UsageError when the build has no MPI. `program`
/// starts the messages of a call that hangs inside MPI ("ch02_gradient_allreduce").
void init(int* argc, char*** argv, std::chrono::milliseconds timeout,
          const std::string& program = "");
/// MPI_Finalize, if init ran.
void finalize();
/// Ends every process of the job with `code` (MPI_Abort).
[[noreturn]] void abort(int code);
/// This process failed: `line` is printed on stderr by one process of the job only, and
/// the job ends with `code`. When several processes fail at about the same time (a
/// mistake every rank makes, ranks timing out on one stopped rank), the first to claim
/// the job's one report speaks (an atomic on rank 0's memory), and the others end
/// silently with it; a lower `order` (CommError::report_order) waits less before it
/// claims. What mpirun adds (its MPI_ABORT and exit-status banners) is mpirun's own:
/// `mpirun -q` leaves only this line.
[[noreturn]] void fail(const std::string& line, int code, int order = 0);
/// This process's rank in MPI_COMM_WORLD.
int world_rank();
/// The job's size (number of processes) in MPI_COMM_WORLD.
int world_size();
/// A communicator over MPI_COMM_WORLD.
std::unique_ptr<Communicator> world(std::chrono::milliseconds timeout);

}  // namespace shardlab::mpi
