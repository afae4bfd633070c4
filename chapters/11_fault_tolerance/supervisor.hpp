// Chapter 11: a run of processes under mpirun, supervised (--processes N). The supervisor
// starts `mpirun -np N` on this program, waits for the job, and when it fails starts it
// again — new processes, the same checkpoint folder — until it finishes, as torchrun's
// elastic agent restarts its workers (and, with --elastic, on fewer processes). What the
// attempts did and which faults struck is kept beside the checkpoints (run_folder), since
// a killed process keeps nothing.
#pragma once

#include <string>
#include <vector>

#include "fault_run.hpp"

namespace ch11 {

/// Runs `s` as s.processes processes of `args` (this program's command line, its first
/// word the program) under s.mpirun, restarting after each failure while faults remain
/// to strike. Returns the exit code: 0 when an attempt finished; under `json`, that
/// attempt's JSON is printed. What each attempt prints goes through as it comes.
int supervise(Settings11 s, const std::vector<std::string>& args, bool json);

}  // namespace ch11
