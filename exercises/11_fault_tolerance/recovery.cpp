// Chapter 11 exercise: the checkpoint interval and the recovery's bookkeeping
// (chapters/11_fault_tolerance/recovery.hpp says what each must do).
//
// `make check CH=11` runs the tests: Young's and Daly's intervals against the numbers of
// Daly's paper, the waste's minimum where Young puts it, and the step a restarted run goes
// on from for every failing step.
#include "recovery.hpp"

#include "shardlab/check.hpp"

namespace ch11 {

// TODO(ch11): young_interval
double young_interval(double checkpoint_s, double mtbf_s) {
  // The checkpoint's cost against half an interval's work lost per failure.
  (void)checkpoint_s;
  (void)mtbf_s;
  SHARDLAB_TODO("ch11: young_interval");
}

// TODO(ch11): daly_interval
double daly_interval(double checkpoint_s, double mtbf_s) {
  // Young's interval with Daly's two correction terms, less the checkpoint itself.
  (void)checkpoint_s;
  (void)mtbf_s;
  SHARDLAB_TODO("ch11: daly_interval");
}

// TODO(ch11): expected_waste
double expected_waste(double interval_s, double checkpoint_s, double restart_s, double mtbf_s) {
  // Three parts: the checkpoints, the work a failure loses, the restarts.
  (void)interval_s;
  (void)checkpoint_s;
  (void)restart_s;
  (void)mtbf_s;
  SHARDLAB_TODO("ch11: expected_waste");
}

// TODO(ch11): resume_point
ResumePoint resume_point(int every, int failed_at) {
  // The last checkpoint written before the failing step began; the failing step is lost.
  (void)every;
  (void)failed_at;
  SHARDLAB_TODO("ch11: resume_point");
}

}  // namespace ch11
