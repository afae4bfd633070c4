// Chapter 04: timelines drawn in the terminal, written as Chrome trace events, and as rows
// of the events CSV.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/results.hpp"
#include "simulate.hpp"

namespace ch04 {

/// One row per stage, one column per `cell` of time: each op as its label (F3, B3, W3)
/// followed by blanks for as long as it runs, idle time as dots, like the figures of
/// the GPipe and Megatron-LM papers; with several chunks per stage, odd chunks in lower
/// case (f3: microbatch 3 through chunk 1). With `color`, forwards, backwards and weight
/// gradients get background colours of their own.
///   stage 0 |F0 F1 F2 F3 ..................B0    B1    B2    B3    |
std::string draw(const Timeline& t, double cell, bool color);

/// The column width that gives the shortest op three columns, or two (simulated
/// timelines), in no more than `max_columns` columns in all; else makespan / max_columns.
double cell_for(const Timeline& t, int max_columns = 120);

/// Appends `t` to a Chrome trace-event list (chrome://tracing, ui.perfetto.dev): one
/// process `pid` named `process`, one thread per stage, one complete event per op.
/// `us_per_unit` turns the timeline's time into microseconds.
void add_trace(nlohmann::json& trace_events, const Timeline& t, int pid, const std::string& process,
               int chunks, double us_per_unit);

/// Writes trace events (add_trace) as a Chrome trace file, atomically.
void write_trace(const std::string& path, const nlohmann::json& trace_events);

/// The events CSV the notebook draws as Gantt charts: one row per op, its times in ms.
/// Columns: schedule source stages microbatches chunks stage kind microbatch chunk
/// start_ms end_ms backend machine.
shardlab::Table events_table();
/// Adds every op of `t` (schedule `s`, `source` "measured" or "simulated"; times in
/// seconds) to an events_table().
void add_events(shardlab::Table& table, const Schedule& s, const std::string& source,
                const Timeline& t, const std::string& backend, const std::string& machine);

/// Every rank's events, on every rank (an allgather; not counted as the run's traffic).
std::vector<Event> gather_events(shardlab::Communicator& comm, const std::vector<Event>& mine);

}  // namespace ch04
