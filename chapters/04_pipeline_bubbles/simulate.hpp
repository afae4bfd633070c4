// Chapter 04: a schedule run on paper. Every op takes a fixed time; each stage runs its
// ops in the schedule's order, each as soon as the stage is free and what it needs has
// been computed (no communication cost). What comes out is exact: the makespan, when
// every stage was busy or idle, and how many microbatches each stage held at once.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "schedule.hpp"

namespace ch04 {

/// One op as it ran: on which stage, from when to when.
struct Event {
  int stage = 0;                 ///< the stage (rank) that ran it
  Op op{OpKind::forward, 0, 0};  ///< the op
  double start = 0;  ///< when it started: simulated time units, or seconds when measured
  double end = 0;    ///< when it ended, in the same units
};

/// A schedule's run, simulated or measured: its ops' times and what they add up to.
struct Timeline {
  std::vector<Event> events;  ///< every op, stage by stage, in the order each ran
  double makespan = 0;        ///< from the first op's start to the last op's end
  std::vector<double> busy;   ///< per stage: the time spent in ops
  /// Per stage: most microbatches held at once (a chunk's activations count 1/v).
  std::vector<double> peak_in_flight;
  std::string deadlock;  ///< "" or which stage waits for what, for ever
  /// p: the number of stages (the length of `busy`).
  int stages() const { return static_cast<int>(busy.size()); }
  /// Idle time over total time p * makespan.
  double bubble_fraction() const;
  /// Idle time over busy time (the "ideal" time with no bubble), per stage on average.
  double bubble_over_ideal() const;
};

/// A timeline from events (each stage's in the order it ran them): makespan from the
/// earliest start to the latest end, busy time and peak microbatches held per stage.
Timeline timeline_of(std::vector<Event> events, int stages, int chunks, bool split_backward);

/// Runs `s` with op times from `cost(stage, op)`.
Timeline simulate(const Schedule& s, const std::function<double(int, const Op&)>& cost);
/// Runs `s` with the same costs on every stage; `scale` multiplies them (naive: one op
/// carries the whole batch of m microbatches, so scale = m).
Timeline simulate(const Schedule& s, const Costs& costs, double scale = 1);

/// "" when `s` is well formed (validate) and its stages can run it together (on paper,
/// with `costs`), else what is wrong, naming the schedule.
std::string problems(const Schedule& s, const Costs& costs);

/// "4 3 2 1": numbers with 3 significant digits, space-separated (microbatches in flight).
std::string join_numbers(const std::vector<double>& values);

/// "" when the timeline `t` of schedule `name` agrees with formula `f` (the bubble over
/// the ideal within 1e-9, the microbatches in flight exactly, where `f` says them), else
/// what differs.
std::string formula_mismatch(const std::string& name, const Timeline& t, const Formula& f);

/// The naive schedule's one "microbatch" is the whole batch of the run's m: what its
/// stages hold, counted in the others' microbatches (m times its peak; others unchanged).
void count_in_microbatches(Timeline& t, const Schedule& s, int batch_microbatches);

}  // namespace ch04
