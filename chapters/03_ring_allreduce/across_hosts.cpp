// Chapter 03 across hosts (across_hosts.hpp).
#include "across_hosts.hpp"

#include <algorithm>
#include <numeric>

#include "shardlab/format.hpp"

namespace ch03 {

using shardlab::Cell;
using shardlab::CommStats;
using shardlab::Context;

namespace {
template <class T>
T sum_of(const std::vector<T>& v) {
  return std::accumulate(v.begin(), v.end(), T{0});
}

/// Bytes sent on this host's network interfaces, read by every rank with no algorithm
/// running anywhere (barriers, uncounted). Before one (`starting`): a barrier, the reading,
/// and a barrier that keeps every rank from sending its first message before every host's
/// counter is read (without it, a rank that left the first barrier before its host's first
/// rank had read the counter could send before the reading, and the wire came out short of
/// the bytes counted: 11967310 of the ring's 12000036 in one run). After it: a barrier, which every
/// rank enters having received all it was sent, so every byte of the algorithm has left its host's
/// interface, then the reading. Between the two readings the wire carries the algorithm's bytes,
/// their headers and acknowledgements, and the barriers' own few bytes: over TCP/IP, never less
/// than what was counted.
std::uint64_t wire_now(Communicator& comm, bool starting) {
  Communicator::Uncounted not_counted(comm);
  comm.barrier();
  const std::uint64_t sent = shardlab::network_bytes_sent();
  if (starting) comm.barrier();
  return sent;
}
}  // namespace

std::string Hosts::describe() const {
  std::string text = std::to_string(count()) + " hosts: ranks";
  for (int h = 0; h < count(); ++h) {
    if (h > 0) text += " |";
    for (int q : placement.ranks_on(h)) text += " " + std::to_string(q);
  }
  return text;
}

Hosts find_hosts(Communicator& comm, int ranks_per_node) {
  Hosts h;
  if (ranks_per_node > 0) {
    h.placement = blocks(comm.size(), ranks_per_node);
  } else {
    h.placement = placement_of(shardlab::host_names(comm));
    h.real = h.placement.hosts() > 1;
  }
  return h;
}

void prepare_hierarchical(Context& ctx, Hosts& hosts, std::vector<std::string>& names, bool asked) {
  if (std::ranges::find(names, "hierarchical") == names.end()) return;
  const std::string uneven = hosts.placement.uneven();
  if (uneven.empty())
    hosts.groups = group_by_host(ctx.comm(), hosts.placement);
  else if (asked)
    throw shardlab::UsageError(uneven + " (" + hosts.describe() + ")");
  else
    std::erase(names, "hierarchical"), ctx.say(uneven + ": left out\n");
}

// ---------------------------------------------------------------------------

Traffic::Traffic(Communicator& comm, Hosts& hosts) : comm_(comm), hosts_(hosts) {
  wire_ = wire_now(comm, true);
  before_ = all_stats();
  to_.assign(static_cast<std::size_t>(comm.size()), 0);
  watch(comm, {});
  if (hosts.groups) {
    watch(*hosts.groups->local, hosts.groups->local_ranks);
    watch(*hosts.groups->across, hosts.groups->across_ranks);
  }
}

Traffic::~Traffic() {
  if (watching_) unwatch();
}

void Traffic::stop() {
  unwatch();
  delta_ = all_stats().since(before_);
  wire_ = wire_now(comm_, false) - wire_;
}

void Traffic::watch(Communicator& c, std::vector<int> members) {
  c.trace_messages([this, members](const shardlab::MessageEvent& e) {
    if (e.op != shardlab::Op::send) return;
    const int peer = members.empty() ? e.peer : members[static_cast<std::size_t>(e.peer)];
    to_[static_cast<std::size_t>(peer)] += e.bytes;
  });
}

void Traffic::unwatch() {
  watching_ = false;
  comm_.trace_messages({});
  if (hosts_.groups) {
    hosts_.groups->local->trace_messages({});
    hosts_.groups->across->trace_messages({});
  }
}

CommStats Traffic::all_stats() const {
  CommStats all = comm_.stats();
  if (hosts_.groups) all += hosts_.groups->local->stats(), all += hosts_.groups->across->stats();
  return all;
}

// ---------------------------------------------------------------------------

BetweenHosts::BetweenHosts(const Hosts& hosts)
    : hosts_(hosts),
      table_({"algorithm", "between_hosts", "formula", "on_the_wire", "wire_over_counted"}) {}

void BetweenHosts::add(Context& ctx, const std::string& name, std::size_t count,
                       const Traffic& traffic) {
  Communicator& comm = ctx.comm();
  const int r = ctx.rank();
  const Placement& placement = hosts_.placement;
  const int my_host = placement.host[static_cast<std::size_t>(r)];
  // To whom: every message of the from-scratch algorithms, peer by peer.
  std::int64_t off_host = 0;
  if (name != "native") {
    const std::vector<std::size_t> want = formula_bytes_to(name, count, r, placement);
    const std::vector<std::size_t>& to = traffic.to();
    for (int q = 0; q < ctx.size(); ++q) {
      const auto i = static_cast<std::size_t>(q);
      ctx.verify(to[i] == want[i], name + " on rank " + std::to_string(r) + ": sent " +
                                       std::to_string(to[i]) + " bytes to rank " +
                                       std::to_string(q) + ", the formula says " +
                                       std::to_string(want[i]));
      if (placement.host[i] != my_host) off_host += static_cast<std::int64_t>(to[i]);
    }
  }
  if (hosts_.count() < 2) return;
  const auto all_off = comm.gather_values(off_host);
  // The wire: one reading per host (its ranks share the interfaces), from its first rank.
  const auto all_wire = comm.gather_values(static_cast<std::int64_t>(traffic.wire()));
  std::int64_t on_wire = 0;
  for (int h = 0; h < hosts_.count(); ++h)
    on_wire += all_wire[static_cast<std::size_t>(placement.ranks_on(h)[0])];
  const auto formula =
      static_cast<std::int64_t>(sum_of(formula_link_bytes(name, count, placement)));
  const std::int64_t counted = sum_of(all_off);
  const bool known = name != "native";
  auto cell = [](std::int64_t v, bool shown) { return shown ? Cell(v) : Cell(std::string("-")); };
  table_.add({name, cell(counted, known), cell(formula, known), cell(on_wire, hosts_.real),
              hosts_.real && known && counted > 0
                  ? Cell(static_cast<double>(on_wire) / static_cast<double>(counted))
                  : Cell(std::string("-"))});
  if (known)
    ctx.verify(counted == formula, name + ": " + std::to_string(counted) +
                                       " bytes crossed between hosts, the formula says " +
                                       std::to_string(formula));
}

void BetweenHosts::report(Context& ctx) const {
  if (hosts_.count() < 2) return;
  ctx.report(table_, "between_hosts",
             "\nbytes between hosts (" + hosts_.describe() +
                 (hosts_.real ? "" : ", simulated: --ranks-per-node") +
                 "): counted message by message, the formula, and " +
                 (hosts_.real ? "what the hosts' network interfaces sent (headers and "
                                "acknowledgements included; MPI's own allreduce only here)"
                              : "no wire to read (one machine)"));
}

// ---------------------------------------------------------------------------

void report_link_bound(Context& ctx, const std::vector<std::string>& names, double link_gbit,
                       const Hosts& hosts, const std::vector<shardlab::bench::Row>& rows) {
  const double N = ctx.size(), link = link_gbit * 1e9 / 8;  // bytes per second, each way
  const double payload = link * payload_per_frame;          // what busbw can count of it
  shardlab::Table t(
      {"algorithm", "busbw_GBps", "busiest_host_sends_S", "busbw_bound_GBps", "of_bound"});
  for (const std::string& name : names) {
    const std::vector<shardlab::bench::Row> mine = shardlab::bench::rows_of(rows, name);
    if (mine.empty() || name == "native") continue;
    const shardlab::bench::Row& last = mine.back();
    const std::vector<std::size_t> from =
        formula_link_bytes(name, static_cast<std::size_t>(last.count), hosts.placement);
    const double busiest = static_cast<double>(*std::max_element(from.begin(), from.end()));
    const double S = static_cast<double>(last.bytes);
    const double bound = busiest > 0 ? 2 * (N - 1) / N * S / (busiest / payload) / 1e9 : 0;
    t.add({name, last.busbw_GBps, busiest / S, bound, bound > 0 ? last.busbw_GBps / bound : 0});
  }
  ctx.report(t, "link_bound",
             "#\n# against the link (" + shardlab::format_number(link_gbit) +
                 " Gbit/s each way = " + shardlab::format_number(link / 1e9, 4) +
                 " GB/s of frames; TCP's 1448 bytes of data in each 1514-byte frame leave " +
                 shardlab::format_number(payload / 1e9, 4) + " GB/s of data) at " +
                 shardlab::format_number(static_cast<double>(rows.back().bytes), 10) +
                 " bytes: the busiest host sends busiest_host_sends_S x S to the others, "
                 "so busbw <= 2(N-1)/N S / (that / the data rate)");
}

}  // namespace ch03
