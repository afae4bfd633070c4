// Chapter 11: the failures a run is given on purpose (--inject), and what a run that
// recovers from them did, attempt by attempt (its goodput).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardlab/flight.hpp"
#include "shardlab/tensor.hpp"

namespace shardlab {
class Context;
}

namespace ch11 {

/// A failure to inject (--inject), on one rank:
/// - `kill@RANK@STEP`: the rank ends without a word, as a process killed or a machine lost;
/// - `hang@RANK@STEP`: it stops in the step, between two calls, and never answers again
///   (a deadlocked GPU);
/// - `stall@RANK@STEP`: it stops inside the first collective of the step, once it has
///   entered it (a kernel that never ends inside the collective);
/// - `slow@RANK@FACTOR`: every step of it takes FACTOR times its time (a straggler);
/// - `nan@RANK@STEP`: a NaN in one of its gradients of that step;
/// - `flip@RANK@STEP`: one bit of one of its weights flipped after that step's update
///   (silent data corruption: its data-parallel replica no longer equals the others).
struct Fault {
  /// What happens to the rank.
  enum class Kind { kill, hang, slow, nan, flip, stall };
  Kind kind = Kind::kill;  ///< which failure
  int rank = 0;            ///< the rank it strikes
  int step = 0;            ///< during (flip: after) this step, from 0; slow: every step
  double factor = 1;       ///< slow: how many times longer its steps take
  std::string spec;        ///< as given
};

/// The fault `spec` names; shardlab::UsageError (one line, naming the spec) when it is not
/// one of the forms above with whole numbers (FACTOR: a number from 1 to 100).
Fault parse_fault(const std::string& spec);

/// `specs` parsed ("none" alone: no fault), in the order their steps come (slow ones
/// first); UsageError when a rank is not one of `ranks` or a step not one of `steps`.
std::vector<Fault> parse_faults(const std::vector<std::string>& specs, int ranks, int steps);

/// Failures drawn from a mean time between failures of `mtbf_steps` steps (--mtbf-steps):
/// the gaps between them exponential (a memoryless failure process, as in Young's and
/// Daly's model), each a kill of a rank drawn uniformly from `ranks`, in steps 0..steps-1.
/// The same `seed` gives the same failures (a std::mt19937_64 of the seed, its numbers
/// turned into the gaps here, not by the library's distributions, which differ between
/// standard libraries).
std::vector<Fault> draw_failures(double mtbf_steps, std::uint64_t seed, int ranks, int steps);

/// A checksum of a tensor's bytes (64-bit FNV-1a, over 8-byte words): replicas that hold
/// the same weights have the same one; one flipped bit changes it.
std::uint64_t checksum(const shardlab::Tensor& t);

/// Which of a group's replicas differ, from each one's checksum (in the group's order).
struct ReplicaVote {
  std::vector<int> odd;  ///< the replicas that differ from the majority (all, without one)
  int healthy = -1;      ///< a replica holding the majority's value; -1: no strict majority
  /// True when every replica holds the same value.
  bool agree() const { return odd.empty(); }
};
/// The vote of `sums`: a value held by more than half the replicas is the healthy one and
/// the others are odd; with no such value (two replicas that differ) every replica is odd
/// and none is known healthy.
ReplicaVote vote(const std::vector<std::uint64_t>& sums);

/// The median of `values` (the mean of the middle two for an even count; 0 for none).
double median(std::vector<double> values);

/// The stragglers among ranks whose typical step kept them busy (not waiting for others)
/// `busy[r]` seconds: those busier than `over` times the median rank.
std::vector<int> stragglers(const std::vector<double>& busy, double over = 1.5);

/// What one attempt of the run did (rank 0's clock, seconds from the run's start).
struct Attempt {
  double start = 0;                  ///< the attempt's ranks started
  double ready = 0;                  ///< the model built and the checkpoint loaded
  int resumed = 0;                   ///< the step it went on from
  std::vector<int> steps;            ///< the steps it completed, in order
  std::vector<double> step_s;        ///< and each one's time
  std::vector<double> checkpoint_s;  ///< each checkpoint, the time it stopped training for
  std::vector<double> written_s;     ///< each background save (--async-checkpoints), its write
  double check_s = 0;                ///< its replica checks' time, all together
  std::vector<int> skipped;          ///< the steps it trained but skipped (a NaN): no update
  int failed_at = -1;                ///< the step it was in when it failed (or its last)
  double end = 0;                    ///< it ended (finished, or failed and stopped)
  std::string failure;               ///< why it ended early ("": it finished)
};

/// Where a run's wall time went (seconds): the steps whose results it kept, the steps it
/// trained and then lost to a failure (trained again after it), the checkpoints, and the
/// rest (noticing the failure, starting again, building the model, loading).
struct Goodput {
  double wall = 0;         ///< from the first attempt's start to the last one's end
  double useful = 0;       ///< the steps whose results the run kept
  double lost = 0;         ///< the steps trained and then lost to a failure
  double checkpoints = 0;  ///< writing checkpoints
  double checks = 0;       ///< comparing the replicas' weights (and waiting for them there)
  double restart = 0;      ///< the rest: starting, noticing, starting again, loading
  /// The goodput: useful over wall (0 for no time).
  double fraction() const { return wall > 0 ? useful / wall : 0; }
};

/// The goodput of `attempts` (the last one the run that finished): a step's time is
/// useful in the last attempt that completed it, lost in the others and where that
/// attempt skipped it.
Goodput goodput_of(const std::vector<Attempt>& attempts);

/// The steps whose update the run skipped in the end (skipped by the last attempt that
/// trained them): what a run without failures must skip to be equal to it.
std::vector<int> skipped_steps(const std::vector<Attempt>& attempts);

/// The attempts (rank 0's; the other ranks' empty) as a table, and where the wall time
/// went, with the goodput in the JSON (goodput_fraction).
void report_goodput(shardlab::Context& ctx, const std::vector<Attempt>& attempts);

/// The flight records a job under mpirun left in `dir` (--flight-dir: rank_R.json, one
/// per process that could write its own), compared (shardlab::compare_flights); a rank
/// without a file is a rank whose process was gone. UsageError when `dir` holds none.
shardlab::FlightVerdict compare_flight_dir(const std::string& dir);

/// The first file of checkpoint folder `a` that folder `b` lacks or holds other bytes in;
/// "" when every file is the same, byte for byte.
std::string first_difference(const std::string& a, const std::string& b);

}  // namespace ch11
