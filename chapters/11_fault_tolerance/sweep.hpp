// Chapter 11's sweep (--sweep): the waste measured against the checkpoint interval at a
// fixed rate of failures, beside Young's first-order formula and its minimum.
#pragma once

#include <string>
#include <vector>

#include "train.hpp"

namespace shardlab {
class Context;
}

namespace ch11 {

/// What the sweep runs.
struct SweepSettings {
  ch09::TrainConfig run;       ///< the model, the mesh and the training
  std::string data;            ///< the corpus
  int steps = 40;              ///< steps of each run
  double mtbf_steps = 10;      ///< failures drawn every this many steps on average
  std::vector<int> intervals;  ///< the checkpoint intervals swept, in steps
  int rounds = 3;              ///< runs per interval, each with its own failures
  std::uint64_t seed = 0;      ///< round r's failures: draw_failures(..., seed + r, ...)
  std::string dir;             ///< where the runs' checkpoints go (removed after)
};

/// For each interval K and each round, trains `steps` steps with a checkpoint after every K
/// and kills drawn every `mtbf_steps` steps on average — the same failures for every K in a
/// round, so that the intervals are compared on the same luck. A failure here is noticed at
/// once by every rank (its step is known to all): the ranks build the model again and load
/// the last checkpoint, as a restarted job would, without starting again. The waste is one
/// less the goodput; the formula's is x / (1 + x), its share of the wall time, where
/// x = δ/T + (T/2 + R)/M is the first-order overhead per second of useful work (Young's),
/// with the checkpoint time δ, the rebuild-and-load time R and the step time measured. A table and
/// NN_slug.csv; every rank calls it.
void sweep_waste(shardlab::Context& ctx, const SweepSettings& s);

}  // namespace ch11
