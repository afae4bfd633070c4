// Chapter 04: drawing and exporting timelines.
#include "timeline.hpp"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

namespace ch04 {

std::string draw(const Timeline& t, double cell, bool color) {
  const int p = t.stages();
  const int columns = std::max(1, static_cast<int>(std::ceil(t.makespan / cell - 1e-9)));
  double origin = 0;
  for (std::size_t i = 0; i < t.events.size(); ++i)
    origin = i == 0 ? t.events[i].start : std::min(origin, t.events[i].start);
  auto column = [&](double time) {
    return std::clamp(static_cast<int>(std::lround((time - origin) / cell)), 0, columns);
  };
  // Per stage, per column: the text and the kind (-1 idle).
  std::vector<std::string> text(static_cast<std::size_t>(p), std::string(columns, '.'));
  std::vector<std::vector<int>> kind(static_cast<std::size_t>(p),
                                     std::vector<int>(static_cast<std::size_t>(columns), -1));
  for (const Event& e : t.events) {
    if (e.end <= e.start) continue;  // an op that takes no time (W with --wgrad-cost 0)
    const int a = column(e.start), b = std::max(column(e.end), a + 1);
    // Chunks by case: F3 is microbatch 3 through chunk 0 (2, 4, ...), f3 through chunk 1
    // (3, 5, ...). The trace and the CSV have the chunk itself.
    std::string name = label(ch04::Op{e.op.kind, e.op.microbatch, 0}, 1);
    if (e.op.chunk % 2 == 1) name[0] = static_cast<char>(name[0] - 'A' + 'a');
    for (int c = a; c < std::min(b, columns); ++c) {
      const auto k = static_cast<std::size_t>(c - a);
      text[static_cast<std::size_t>(e.stage)][static_cast<std::size_t>(c)] =
          k < name.size() ? name[k] : ' ';
      kind[static_cast<std::size_t>(e.stage)][static_cast<std::size_t>(c)] =
          static_cast<int>(e.op.kind);
    }
  }
  // Backgrounds: forward blue, backward green, weight gradient yellow (black text).
  const char* paint[] = {"\033[30;46m", "\033[30;42m", "\033[30;43m"};
  std::string out;
  for (int s = 0; s < p; ++s) {
    out += "stage " + std::to_string(s) + (s < 10 ? " " : "") + "|";
    int current = -2;
    for (int c = 0; c < columns; ++c) {
      const int k = kind[static_cast<std::size_t>(s)][static_cast<std::size_t>(c)];
      if (color && k != current) {
        out += k < 0 ? "\033[0m" : paint[k];
        current = k;
      }
      out += text[static_cast<std::size_t>(s)][static_cast<std::size_t>(c)];
    }
    if (color) out += "\033[0m";
    out += "|\n";
  }
  return out;
}

double cell_for(const Timeline& t, int max_columns) {
  double shortest = 0;
  for (const Event& e : t.events)
    if (e.end > e.start)
      shortest = shortest == 0 ? e.end - e.start : std::min(shortest, e.end - e.start);
  if (shortest == 0 || t.makespan <= 0) return 1;
  // A whole number of columns per shortest op keeps the ops of a row aligned.
  for (int per_op : {3, 2})
    if (t.makespan / (shortest / per_op) <= max_columns) return shortest / per_op;
  return t.makespan / max_columns;
}

void add_trace(nlohmann::json& trace_events, const Timeline& t, int pid, const std::string& process,
               int chunks, double us_per_unit) {
  trace_events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"args", {{"name", process}}}});
  for (int s = 0; s < t.stages(); ++s)
    trace_events.push_back({{"name", "thread_name"},
                            {"ph", "M"},
                            {"pid", pid},
                            {"tid", s},
                            {"args", {{"name", "stage " + std::to_string(s)}}}});
  const char* category[] = {"forward", "backward", "weight"};
  for (const Event& e : t.events)
    trace_events.push_back({{"name", label(e.op, chunks)},
                            {"cat", category[static_cast<int>(e.op.kind)]},
                            {"ph", "X"},
                            {"pid", pid},
                            {"tid", e.stage},
                            {"ts", e.start * us_per_unit},
                            {"dur", (e.end - e.start) * us_per_unit},
                            {"args", {{"microbatch", e.op.microbatch}, {"chunk", e.op.chunk}}}});
}

void write_trace(const std::string& path, const nlohmann::json& trace_events) {
  shardlab::write_file_atomic(
      path, nlohmann::json{{"traceEvents", trace_events}, {"displayTimeUnit", "ms"}}.dump());
}

shardlab::Table events_table() {
  return shardlab::Table({"schedule", "source", "stages", "microbatches", "chunks", "stage", "kind",
                          "microbatch", "chunk", "start_ms", "end_ms", "backend", "machine"});
}

void add_events(shardlab::Table& table, const Schedule& s, const std::string& source,
                const Timeline& t, const std::string& backend, const std::string& machine) {
  for (const Event& e : t.events)
    table.add({s.name, source, s.stages, s.microbatches, s.chunks, e.stage,
               std::string(1, "FBW"[static_cast<int>(e.op.kind)]), e.op.microbatch, e.op.chunk,
               e.start * 1e3, e.end * 1e3, backend, machine});
}

std::vector<Event> gather_events(shardlab::Communicator& comm, const std::vector<Event>& mine) {
  shardlab::Communicator::Uncounted not_counted(comm);
  constexpr std::size_t fields = 6;
  std::vector<double> packed;
  for (const Event& e : mine)
    packed.insert(packed.end(), {static_cast<double>(e.stage), static_cast<double>(e.op.kind),
                                 static_cast<double>(e.op.microbatch),
                                 static_cast<double>(e.op.chunk), e.start, e.end});
  const std::vector<std::int64_t> sizes =
      comm.gather_values(static_cast<std::int64_t>(packed.size()));
  std::vector<std::size_t> counts;
  std::size_t total = 0;
  for (std::int64_t n : sizes) {
    counts.push_back(static_cast<std::size_t>(n));
    total += static_cast<std::size_t>(n);
  }
  std::vector<double> all(total);
  comm.allgatherv(std::span<const double>(packed), std::span<double>(all), counts);
  std::vector<Event> events;
  for (std::size_t i = 0; i + fields <= all.size(); i += fields)
    events.push_back({static_cast<int>(all[i]),
                      {static_cast<OpKind>(static_cast<int>(all[i + 1])),
                       static_cast<int>(all[i + 2]), static_cast<int>(all[i + 3])},
                      all[i + 4],
                      all[i + 5]});
  return events;
}

}  // namespace ch04
