// Chapter 04: what a run of the chapter program is, from its flags: the schedule(s), the
// shape of the pipeline, the simulation's op costs and the toy model. add_flags puts them
// on a Program with the checks they must pass before any rank starts (bad usage: exit 2)
// and the memory a run needs.
#pragma once

#include <string>

#include "schedule.hpp"
#include "shardlab/launch.hpp"
#include "toy_stage.hpp"

namespace ch04 {

/// The chapter program's flags, as add_flags fills them.
struct Settings {
  std::string schedule = "all";  ///< --schedule: a row of schedules(), or all
  int microbatches = 8;          ///< --microbatches: m, the pieces the batch is cut into
  int chunks = 2;                ///< --chunks: v, model chunks per stage; interleaved only
  /// --stages: p; 0: 4 in simulation, the number of ranks on ranks.
  int stages = 0;
  /// The simulation's op times: --fwd-cost, --bwd-cost, --wgrad-cost.
  Costs costs;
  bool simulate = false;   ///< --simulate: on paper only, with `costs`
  bool benchmark = false;  ///< --benchmark: on ranks, sweep the microbatches and write CSV
  std::string trace;       ///< --trace: where to write the Chrome trace JSON; "": none
  ModelConfig model{8, 256, 128, 0};  ///< --layers, --width, --batch and the run's --seed
};

/// Adds the chapter's flags to `program`, filling `settings`; and its checks: on ranks one
/// stage per rank, a block for every stage chunk and a row for every microbatch; the
/// interleaved schedule's m a multiple of p; at most a million ops; a writable --trace.
void add_flags(shardlab::Program& program, Settings& settings);

}  // namespace ch04
