// Chapter 04: the discrete-event simulation of a schedule.
#include "simulate.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <tuple>

#include "shardlab/format.hpp"

namespace ch04 {

double Timeline::bubble_fraction() const {
  if (makespan <= 0) return 0;
  const double busy_total = std::accumulate(busy.begin(), busy.end(), 0.0);
  return (stages() * makespan - busy_total) / (stages() * makespan);
}

double Timeline::bubble_over_ideal() const {
  const double busy_total = std::accumulate(busy.begin(), busy.end(), 0.0);
  if (busy_total <= 0) return 0;
  return (stages() * makespan - busy_total) / busy_total;
}

Timeline timeline_of(std::vector<Event> events, int stages, int chunks, bool split_backward) {
  Timeline t;
  t.events = std::move(events);
  t.busy.assign(static_cast<std::size_t>(stages), 0.0);
  t.peak_in_flight.assign(static_cast<std::size_t>(stages), 0.0);
  std::vector<int> held(static_cast<std::size_t>(stages), 0);
  double first = 0, last = 0;
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const Event& e = t.events[i];
    const auto st = static_cast<std::size_t>(e.stage);
    first = i == 0 ? e.start : std::min(first, e.start);
    last = i == 0 ? e.end : std::max(last, e.end);
    t.busy[st] += e.end - e.start;
    // A microbatch's activations are held from its forward until its backward is done
    // (its W, when the backward is split: the weight gradient needs them too).
    if (e.op.kind == OpKind::forward) ++held[st];
    if ((e.op.kind == OpKind::backward && !split_backward) || e.op.kind == OpKind::weight)
      --held[st];
    t.peak_in_flight[st] = std::max(t.peak_in_flight[st], static_cast<double>(held[st]) / chunks);
  }
  t.makespan = last - first;
  return t;
}

Timeline simulate(const Schedule& s, const std::function<double(int, const Op&)>& cost) {
  const int p = s.stages, last = p * s.chunks - 1;
  std::vector<Event> events;
  std::vector<std::size_t> next(static_cast<std::size_t>(p), 0);
  std::vector<double> free_at(static_cast<std::size_t>(p), 0.0);
  // When (kind, microbatch, virtual stage) finished.
  std::map<std::tuple<OpKind, int, int>, double> done;

  // What op `op` on stage `st` needs first: (kind, microbatch, virtual stage), or nothing
  // (the first virtual stage's forward).
  auto needs = [&](int st, const Op& op) -> std::tuple<bool, OpKind, int, int> {
    const int vs = virtual_stage(st, op.chunk, p);
    switch (op.kind) {
      case OpKind::forward:
        return {vs > 0, OpKind::forward, op.microbatch, vs - 1};
      case OpKind::backward:
        return vs == last ? std::tuple{true, OpKind::forward, op.microbatch, vs}
                          : std::tuple{true, OpKind::backward, op.microbatch, vs + 1};
      case OpKind::weight:
        return {true, OpKind::backward, op.microbatch, vs};
    }
    return {false, OpKind::forward, 0, 0};
  };

  std::size_t remaining = 0;
  for (const auto& ops : s.ops) remaining += ops.size();
  std::string deadlock;
  while (remaining > 0) {
    bool progressed = false;
    for (int st = 0; st < p; ++st) {
      const auto& ops = s.ops[static_cast<std::size_t>(st)];
      auto& at = next[static_cast<std::size_t>(st)];
      while (at < ops.size()) {
        const Op& op = ops[at];
        const auto [has, kind, j, vs] = needs(st, op);
        double ready = 0;
        if (has) {
          const auto it = done.find({kind, j, vs});
          if (it == done.end()) break;
          ready = it->second;
        }
        Event e{st, op, std::max(free_at[static_cast<std::size_t>(st)], ready), 0};
        e.end = e.start + cost(st, op);
        free_at[static_cast<std::size_t>(st)] = e.end;
        done[{op.kind, op.microbatch, virtual_stage(st, op.chunk, p)}] = e.end;
        events.push_back(e);
        ++at;
        --remaining;
        progressed = true;
      }
    }
    if (progressed) continue;
    // Nobody can move: say who waits for what.
    for (int st = 0; st < p; ++st) {
      const auto& ops = s.ops[static_cast<std::size_t>(st)];
      const std::size_t at = next[static_cast<std::size_t>(st)];
      if (at == ops.size()) continue;
      const auto [has, kind, j, vs] = needs(st, ops[at]);
      (void)has;
      const Op wanted{kind, j, vs / p};
      deadlock += std::string(deadlock.empty() ? "" : "; ") + "stage " + std::to_string(st) +
                  " waits at op " + std::to_string(at) + " (" + label(ops[at], s.chunks) +
                  ") for " + label(wanted, s.chunks) + " on stage " + std::to_string(vs % p);
    }
    break;
  }
  // Events stage by stage, each stage's in the order it ran them.
  std::stable_sort(events.begin(), events.end(),
                   [](const Event& a, const Event& b) { return a.stage < b.stage; });
  Timeline t = timeline_of(std::move(events), p, s.chunks, s.split_backward());
  t.deadlock = deadlock;
  return t;
}

Timeline simulate(const Schedule& s, const Costs& costs, double scale) {
  const bool split = s.split_backward();
  return simulate(s, [&](int, const Op& op) {
    const double c = op.kind == OpKind::forward    ? costs.forward
                     : op.kind == OpKind::backward ? costs.backward + (split ? 0 : costs.weight)
                                                   : costs.weight;
    return scale * c / s.chunks;
  });
}

void count_in_microbatches(Timeline& t, const Schedule& s, int batch_microbatches) {
  if (s.name == "naive")
    for (double& held : t.peak_in_flight) held *= batch_microbatches;
}

std::string problems(const Schedule& s, const Costs& costs) {
  if (const std::string problem = validate(s); !problem.empty()) return s.name + ": " + problem;
  if (const std::string deadlock = simulate(s, costs).deadlock; !deadlock.empty())
    return s.name + ": the schedule deadlocks: " + deadlock;
  return "";
}

std::string join_numbers(const std::vector<double>& values) {
  std::string text;
  for (double v : values) text += (text.empty() ? "" : " ") + shardlab::format_number(v, 3);
  return text;
}

std::string formula_mismatch(const std::string& name, const Timeline& t, const Formula& f) {
  using shardlab::format_number;
  if (f.over_ideal >= 0 &&
      !(std::fabs(t.bubble_over_ideal() - f.over_ideal) <= 1e-9 * std::max(1.0, f.over_ideal)))
    return name + ": the simulated bubble " + format_number(t.bubble_over_ideal()) +
           " of the ideal differs from the formula's " + format_number(f.over_ideal);
  if (!f.peak.empty() && t.peak_in_flight != f.peak)
    return name + ": microbatches in flight " + join_numbers(t.peak_in_flight) + ", formula " +
           join_numbers(f.peak);
  return "";
}

}  // namespace ch04
