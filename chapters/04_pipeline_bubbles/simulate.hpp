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

/// The time one microbatch's F, B and W take on one stage (all of its chunks: one chunk's
/// op takes 1/v of it). A schedule that does not split the backward runs B + W as one op.
/// The textbook case: t_b = 2 t_f and W = 0 (the backward does twice the forward's
/// matmuls); zero-bubble papers take t_f = t_b = t_w.
struct Costs {
  double forward = 1;
  double backward = 2;
  double weight = 0;
};

/// One op as it ran: on which stage, from when to when.
struct Event {
  int stage = 0;
  Op op{Kind::forward, 0, 0};
  double start = 0, end = 0;
};

struct Timeline {
  std::vector<Event> events;           // every op, stage by stage, in the order each ran
  double makespan = 0;                 // from the first op's start to the last op's end
  std::vector<double> busy;            // per stage: the time spent in ops
  std::vector<double> peak_in_flight;  // per stage: most microbatches held at once
                                       // (a chunk's activations count 1/v)
  std::string deadlock;                // "" or which stage waits for what, for ever
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

}  // namespace ch04
