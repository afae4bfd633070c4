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

struct Settings {
  std::string schedule = "all";
  int microbatches = 8;
  int chunks = 2;  // interleaved only
  int stages = 0;  // 0: 4 in simulation, the number of ranks on ranks
  Costs costs;
  bool simulate = false, benchmark = false;
  std::string trace;
  ModelConfig model{8, 256, 128, 0};
};

/// Adds the chapter's flags to `program`, filling `settings`; and its checks: on ranks one
/// stage per rank, a block for every stage chunk and a row for every microbatch; the
/// interleaved schedule's m a multiple of p; at most a million ops; a writable --trace.
void add_flags(shardlab::Program& program, Settings& settings);

}  // namespace ch04
