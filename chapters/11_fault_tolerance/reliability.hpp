// Chapter 11's planner: what failures cost a job of many devices, on paper, from the one
// large run whose failures were published in full — Llama 3's (Dubey et al. 2024, §3.3.4):
// a 54-day snapshot of pre-training on up to 16,384 H100 GPUs, 466 job interruptions, 47
// planned and 419 unexpected, counted by cause in its Table 5.
//
// A job that needs every device fails when any one does: its mean time between failures
// is one device's over the device count. Checkpointing at Young's interval √(2 δ M), the
// share of its time wasted is, to first order, √(2 δ / M) + R / M (a checkpoint of δ, a
// restart of R, failures every M): the planner says what δ and R keep the goodput above a
// goal, and how that changes with the number of devices.
#pragma once

#include <string>
#include <vector>

namespace shardlab {
class Context;
}

namespace ch11 {

/// One row of Llama 3's Table 5: a cause of unexpected interruptions, as printed.
struct Interruption {
  std::string component;  ///< "Faulty GPU"
  std::string category;   ///< "GPU"
  int count = 0;          ///< interruptions it caused
  double printed = 0;     ///< the share the table prints, in percent
};

/// Table 5 of the Llama 3 paper, row by row as printed (its counts add up to 419).
const std::vector<Interruption>& llama3_interruptions();

/// The snapshot the table counts.
struct Llama3Snapshot {
  double days = 54;      ///< its length
  double gpus = 16384;   ///< the devices the job needed at once
  int unexpected = 419;  ///< unexpected interruptions (Table 5's)
  int planned = 47;      ///< planned ones (466 in all)
  /// The job's mean time between unexpected interruptions, hours: 54 × 24 / 419.
  double job_mtbf_hours() const { return days * 24 / unexpected; }
  /// One GPU's, hours: the job's times the GPUs (a failure of any one stops the job).
  double gpu_mtbf_hours() const { return job_mtbf_hours() * gpus; }
};

/// The mean time between failures of a job needing `devices` devices that each fail once
/// in `device_mtbf` on average (any unit; the result in the same).
double job_mtbf(double device_mtbf, double devices);

/// The share of the time wasted, to first order, checkpointing at Young's interval
/// √(2 δ M): √(2 δ / M) + R / M, for checkpoints of `checkpoint`, restarts of `restart`
/// and failures every `mtbf` (one unit for all three).
double waste_at_young(double checkpoint, double restart, double mtbf);

/// The longest checkpoint that keeps the goodput at least `goodput` (0..1), checkpointing
/// at Young's interval, with restarts of `restart` and failures every `mtbf`:
/// M (1 − goodput − R / M)² / 2; 0 when the restarts alone take more than the rest.
double longest_checkpoint(double goodput, double restart, double mtbf);

/// --plan: Llama 3's snapshot and its Table 5 checked against its counts, then, at its
/// rate of failures per GPU, the job's MTBF, Young's interval and the longest checkpoints
/// and restarts that keep the goodput above 90 % and 95 %, from 1,024 to 131,072 GPUs.
void report_plan(shardlab::Context& ctx);

/// The longest restart that keeps the goodput at least `goodput` with checkpoints of
/// `checkpoint` at Young's interval: M (1 − goodput) − √(2 δ M); 0 when none does.
double longest_restart(double goodput, double checkpoint, double mtbf);

}  // namespace ch11
