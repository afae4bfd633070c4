// Chapter 11: the failures a run is given on purpose (--inject), and what a run that
// recovers from them did, attempt by attempt (its goodput).
#pragma once

#include <string>
#include <vector>

#include "shardlab/flight.hpp"

namespace shardlab {
class Context;
}

namespace ch11 {

/// A failure to inject: `kill@RANK@STEP` (the rank ends without a word, as a process
/// killed or a machine lost would) or `hang@RANK@STEP` (the rank stops inside the step and
/// never answers again, as a deadlocked GPU would).
struct Fault {
  /// What the rank does: ends (kill), or stops answering (hang).
  enum class Kind { kill, hang };
  Kind kind = Kind::kill;  ///< kill or hang
  int rank = 0;            ///< the rank that fails
  int step = 0;            ///< during this step (from 0)
  std::string spec;        ///< as given
};

/// The fault `spec` names; shardlab::UsageError (one line, naming the spec) when it is not
/// kill@RANK@STEP or hang@RANK@STEP with whole numbers.
Fault parse_fault(const std::string& spec);

/// `specs` parsed ("none" alone: no fault), in the order their steps come; UsageError when
/// a rank is not one of `ranks` or a step not one of `steps`.
std::vector<Fault> parse_faults(const std::vector<std::string>& specs, int ranks, int steps);

/// What one attempt of the run did (rank 0's clock, seconds from the run's start).
struct Attempt {
  double start = 0;                  ///< the attempt's ranks started
  double ready = 0;                  ///< the model built and the checkpoint loaded
  int resumed = 0;                   ///< the step it went on from
  std::vector<int> steps;            ///< the steps it completed, in order
  std::vector<double> step_s;        ///< and each one's time
  std::vector<double> checkpoint_s;  ///< each checkpoint it wrote, its time
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
  double restart = 0;      ///< the rest: noticing, starting again, building, loading
  /// The goodput: useful over wall (0 for no time).
  double fraction() const { return wall > 0 ? useful / wall : 0; }
};

/// The goodput of `attempts` (the last one the run that finished): a step's time is
/// useful in the last attempt that completed it, lost in the others.
Goodput goodput_of(const std::vector<Attempt>& attempts);

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
