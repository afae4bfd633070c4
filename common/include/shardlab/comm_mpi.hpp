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
#include <vector>

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
/// Ends every process of the job with `code` (MPI_Abort), without the launcher's banner
/// (see fail).
[[noreturn]] void abort(int code);
/// Ends the job with `code` from a process that has said why (or lets another say it),
/// whether MPI has started or not: where a process would return a non-zero code, mpirun
/// adds ten lines of its own about it, and about one that exits before MPI_Init.
[[noreturn]] void end_job(int code);
/// This process failed: `line` is printed on stderr by one process of the job only, and
/// the job ends with `code`. When several processes fail at about the same time (a
/// mistake every rank makes, ranks timing out on one stopped rank), the first to claim
/// the job's one report speaks (an atomic on rank 0's memory), and the others end
/// silently with it; a lower `order` (CommError::report_order) waits less before it
/// claims. Open MPI 4's mpirun would follow it with its MPI_ABORT banner; it is silenced
/// for this abort only (not with `mpirun -q`, which also hides mpirun's own errors), so
/// the job's output ends with this one line.
[[noreturn]] void fail(const std::string& line, int code, int order = 0);
/// This process's rank in MPI_COMM_WORLD.
int world_rank();
/// The job's size (number of processes) in MPI_COMM_WORLD.
int world_size();
/// Every world rank's host name (MPI_Get_processor_name, gathered at init); empty before
/// init and without MPI.
std::vector<std::string> hosts();
/// A communicator over MPI_COMM_WORLD.
std::unique_ptr<Communicator> world(std::chrono::milliseconds timeout);

}  // namespace shardlab::mpi
