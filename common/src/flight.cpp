// Flight recorder (see flight.hpp).
#include "shardlab/flight.hpp"

#include <algorithm>
#include <set>

#include "shardlab/format.hpp"

namespace shardlab {

namespace {
bool point_to_point(Op op) { return op == Op::send || op == Op::recv; }
}  // namespace

std::string Flight::describe() const {
  std::string out = group + " " + std::string(op_name(op)) + " #" + std::to_string(seq);
  if (point_to_point(op))
    return out + (op == Op::send ? " to rank " : " from rank ") + std::to_string(peer) + " (" +
           std::to_string(count) + " bytes)";
  if (op == Op::barrier) return out;
  return out + " (" + std::to_string(count) + " x " + std::string(dtype_name(type)) + ")";
}

std::string flight_channel(const Flight& f) {
  if (!point_to_point(f.op)) return f.group;
  return f.group + (f.op == Op::send ? " send " : " recv ") + std::to_string(f.peer);
}

FlightRecorder::FlightRecorder(int rank, std::size_t capacity)
    : rank_(rank), capacity_(std::max<std::size_t>(capacity, 1)) {
  totals_.rank = rank;
}

std::uint64_t FlightRecorder::started(Flight f, const std::vector<int>& members) {
  const std::lock_guard lock(mutex_);
  std::uint64_t& count = totals_.started[flight_channel(f)];
  ++count;
  if (f.seq == 0) f.seq = count;
  totals_.groups.try_emplace(f.group, members);
  if (kept_.size() == capacity_) kept_.pop_front();
  const std::uint64_t id = next_id_++;
  kept_.emplace_back(id, std::move(f));
  return id;
}

void FlightRecorder::finished(std::uint64_t id) {
  const double now =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  const std::lock_guard lock(mutex_);
  for (auto it = kept_.rbegin(); it != kept_.rend(); ++it)
    if (it->first == id) {
      it->second.end = now;
      return;
    }
}

void FlightRecorder::waited(double seconds) {
  const std::lock_guard lock(mutex_);
  waited_ += seconds;
}

double FlightRecorder::waited() const {
  const std::lock_guard lock(mutex_);
  return waited_;
}

void FlightRecorder::set_hosts(std::vector<std::string> hosts) {
  const std::lock_guard lock(mutex_);
  totals_.hosts = std::move(hosts);
}

FlightRecord FlightRecorder::record() const {
  const std::lock_guard lock(mutex_);
  FlightRecord out = totals_;
  for (const auto& [id, f] : kept_) out.flights.push_back(f);
  return out;
}

// ---------------------------------------------------------------------------
// The comparison

namespace {

/// What one rank's unreturned call waits for.
struct Wait {
  Flight call;
  std::vector<int> on;  // the ranks that have not yet started the matching call
};

/// How many calls `rank` started on `channel`; a rank without a record started none.
std::uint64_t started_on(const std::vector<std::optional<FlightRecord>>& records, int rank,
                         const std::string& channel) {
  const auto& r = records[static_cast<std::size_t>(rank)];
  if (!r) return 0;
  const auto it = r->started.find(channel);
  return it == r->started.end() ? 0 : it->second;
}

/// The ranks `f` (an unreturned call of `rank`) waits for.
std::vector<int> waits_for(const std::vector<std::optional<FlightRecord>>& records, int rank,
                           const FlightRecord& mine, const Flight& f) {
  std::vector<int> on;
  if (point_to_point(f.op)) {
    // A receive waits for the peer's matching send; a send for the peer's receive.
    const Flight other{f.group, 0, f.op == Op::send ? Op::recv : Op::send, rank};
    if (f.peer != rank && started_on(records, f.peer, flight_channel(other)) < f.seq)
      on.push_back(f.peer);
    return on;
  }
  const auto members = mine.groups.find(f.group);
  if (members == mine.groups.end()) return on;
  for (int q : members->second)
    if (q != rank && started_on(records, q, f.group) < f.seq) on.push_back(q);
  return on;
}

}  // namespace

FlightVerdict compare_flights(const std::vector<std::optional<FlightRecord>>& records) {
  FlightVerdict v;
  // " (on node1)" for a rank named, where the records know the ranks' hosts and there
  // are several (the cause may be the host, or the network to it).
  std::vector<std::string> hosts;
  for (const auto& rec : records)
    if (rec && hosts.empty()) hosts = rec->hosts;
  const bool several =
      std::any_of(hosts.begin(), hosts.end(), [&](const std::string& h) { return h != hosts[0]; });
  auto where = [&](int q) {
    return several && std::size_t(q) < hosts.size() ? " (on " + hosts[std::size_t(q)] + ")"
                                                    : std::string();
  };
  const int n = static_cast<int>(records.size());
  // Each rank's unreturned calls and whom they wait for.
  std::vector<std::vector<Wait>> waits(static_cast<std::size_t>(n));
  std::vector<std::set<int>> edges(static_cast<std::size_t>(n));
  bool anyone_waits = false;
  for (int r = 0; r < n; ++r) {
    const auto& rec = records[static_cast<std::size_t>(r)];
    if (!rec) continue;
    for (const Flight& f : rec->flights) {
      if (f.done()) continue;
      anyone_waits = true;
      Wait w{f, waits_for(records, r, *rec, f)};
      for (int q : w.on)
        if (q >= 0 && q < n) edges[static_cast<std::size_t>(r)].insert(q);
      waits[static_cast<std::size_t>(r)].push_back(std::move(w));
    }
  }
  v.anyone_waited = anyone_waits;
  if (!anyone_waits) {
    v.lines.push_back("no rank was inside a call when the job ended");
    return v;
  }
  // The ranks someone waits for that wait for nobody: where the ranks part.
  std::set<int> waited_on;
  for (const auto& e : edges) waited_on.insert(e.begin(), e.end());
  // Those outside any call (or without a record) come first; a rank inside a call every
  // member entered is named only when no rank is outside (the job may have been ended
  // around it while the call ran: a rank killed elsewhere).
  std::vector<int> inside;
  for (int q : waited_on)
    if (edges[static_cast<std::size_t>(q)].empty())
      (records[static_cast<std::size_t>(q)] && !waits[static_cast<std::size_t>(q)].empty()
           ? inside
           : v.stopped)
          .push_back(q);
  if (v.stopped.empty()) v.stopped = inside;
  // Ranks on a circle of waits (each reaches itself): a deadlock.
  for (int r = 0; r < n; ++r) {
    std::vector<bool> seen(static_cast<std::size_t>(n), false);
    std::vector<int> todo(edges[static_cast<std::size_t>(r)].begin(),
                          edges[static_cast<std::size_t>(r)].end());
    while (!todo.empty()) {
      const int q = todo.back();
      todo.pop_back();
      if (seen[static_cast<std::size_t>(q)]) continue;
      seen[static_cast<std::size_t>(q)] = true;
      todo.insert(todo.end(), edges[static_cast<std::size_t>(q)].begin(),
                  edges[static_cast<std::size_t>(q)].end());
    }
    if (seen[static_cast<std::size_t>(r)]) v.deadlocked.push_back(r);
  }

  for (int q : v.stopped) {
    // The ranks waiting for q, and the call that waits for the fewest ranks besides q
    // (the one q alone holds up, where there is one).
    std::vector<int> waiters;
    const Wait* call = nullptr;
    for (int r = 0; r < n; ++r)
      for (const Wait& w : waits[static_cast<std::size_t>(r)])
        if (std::find(w.on.begin(), w.on.end(), q) != w.on.end()) {
          if (waiters.empty() || waiters.back() != r) waiters.push_back(r);
          if (!call || w.on.size() < call->on.size()) call = &w;
        }
    const auto& rec = records[static_cast<std::size_t>(q)];
    std::string line = "rank " + std::to_string(q) + where(q);
    if (!rec) {
      line += " left no record (its process is gone, or never stopped to write it)";
    } else if (!waits[static_cast<std::size_t>(q)].empty()) {
      line += " is inside " + waits[static_cast<std::size_t>(q)].front().call.describe() +
              ", which every rank of its group entered";
    } else {
      line += " stopped outside any call";
      const auto last = std::find_if(rec->flights.rbegin(), rec->flights.rend(),
                                     [](const Flight& f) { return f.done(); });
      if (last != rec->flights.rend()) line += " after " + last->describe();
    }
    // Who waits in that very call, and who in others.
    std::vector<int> in_call, elsewhere;
    for (int r : waiters) {
      bool same = false;
      for (const Wait& w : waits[static_cast<std::size_t>(r)])
        same = same || (w.call.group == call->call.group && w.call.op == call->call.op &&
                        w.call.seq == call->call.seq &&
                        std::find(w.on.begin(), w.on.end(), q) != w.on.end());
      (same ? in_call : elsewhere).push_back(r);
    }
    line += ": " + format_ranks(in_call) + " wait" + (in_call.size() == 1 ? "s" : "") +
            " for it in " + call->call.describe();
    if (!elsewhere.empty())
      line += "; " + format_ranks(elsewhere) + (elsewhere.size() == 1 ? " waits" : " wait") +
              " for it in other calls";
    v.lines.push_back(line);
  }
  if (!v.deadlocked.empty()) {
    std::string line = format_ranks(v.deadlocked) + " wait for each other (a deadlock of the " +
                       "program's own calls):";
    for (int r : v.deadlocked)
      for (const Wait& w : waits[static_cast<std::size_t>(r)])
        if (!w.on.empty())
          line += " rank " + std::to_string(r) + " in " + w.call.describe() + " for " +
                  format_ranks(w.on) + ";";
    line.pop_back();
    v.lines.push_back(line);
  }
  if (v.stopped.empty() && v.deadlocked.empty()) {
    // Every rank of the unreturned calls entered them: one stopped inside a call.
    for (int r = 0; r < n; ++r)
      for (const Wait& w : waits[static_cast<std::size_t>(r)]) {
        v.lines.push_back("every rank of " + w.call.group + " entered " + w.call.describe() +
                          "; none is missing, so a rank stopped inside it");
        return v;
      }
  }
  return v;
}

}  // namespace shardlab
