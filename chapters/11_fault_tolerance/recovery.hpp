// Chapter 11 API: when to checkpoint, and where a restarted run goes on from.
//
// A job on N devices fails about N times as often as one device: Llama 3's 54-day snapshot
// on 16,384 GPUs had 419 unexpected interruptions, one every 3.1 hours (Dubey et al. 2024,
// §3.3.4). A failure loses the work since the last checkpoint; a checkpoint costs its
// writing time δ. Checkpoint every T of work and a failure loses T/2 on average, so the
// share of the time wasted is about δ/T + (T/2 + R)/M for failures every M on average and
// a restart of R: least at Young's T = √(2 δ M) (Young 1974), or, closer when δ is not small
// against M, at Daly's higher-order τ (Daly 2006, eq. 37).
//
// The learner writes young_interval(), daly_interval(), expected_waste() and
// resume_point() in exercises/11_fault_tolerance/recovery.cpp; the reference is
// solutions/11_fault_tolerance/.
#pragma once

#include <vector>

namespace ch11 {

// [exercise]
/// Young's optimal time between checkpoints, √(2 δ M): `checkpoint_s` the time one
/// checkpoint takes (δ), `mtbf_s` the job's mean time between failures (M), both in
/// seconds (any one unit for both).
double young_interval(double checkpoint_s, double mtbf_s);

/// Daly's higher-order optimum (2006, eq. 37), the compute time between two checkpoints:
/// √(2 δ M) [1 + (1/3) √(δ / 2M) + (1/9) (δ / 2M)] − δ while δ < 2M, else M.
double daly_interval(double checkpoint_s, double mtbf_s);

/// The share of a run's time not spent on useful steps, to first order, for checkpoints
/// every `interval_s` of work: each costs `checkpoint_s`, a failure comes every `mtbf_s`
/// on average, loses half an interval's work on average and `restart_s` to start again:
/// δ/T + (T/2 + R)/M.
double expected_waste(double interval_s, double checkpoint_s, double restart_s, double mtbf_s);

/// Where a run restarted after a failure goes on from: the step of the last complete
/// checkpoint made before the failure, and the steps it must train again.
struct ResumePoint {
  int step = 0;  ///< the first step to train again (the checkpoint's step; 0: from scratch)
  int lost = 0;  ///< steps trained since that checkpoint, lost with the failure
};

/// A run that writes a checkpoint after every `every` steps (the state after steps
/// every, 2 every, ...; 0: none) fails during step `failed_at` (steps count from 0; that
/// step's work is lost too): the checkpoint it goes on from and the steps lost. Step t
/// trains on batch t, so going on from step s trains every batch once, none twice.
ResumePoint resume_point(int every, int failed_at);
// [exercise]

}  // namespace ch11
