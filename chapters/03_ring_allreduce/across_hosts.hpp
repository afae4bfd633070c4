// Chapter 03 across hosts: where the ranks sit, the bytes an algorithm sent to each peer
// and between hosts against their formulas, what the hosts' network interfaces sent, and
// busbw against the link between hosts. What the chapter program prints when its ranks
// run on several hosts (scripts/cluster.sh), or on hosts simulated by --ranks-per-node.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ring_allreduce.hpp"
#include "shardlab/bench.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/results.hpp"

namespace ch03 {

/// Where the ranks sit: one host (threads, or mpirun on one machine), the hosts of a
/// cluster (each process's host name), or hosts simulated by --ranks-per-node.
struct Hosts {
  Placement placement;  ///< Each rank's host.
  bool real = false;    ///< Hosts with network interfaces of their own (the wire can be read).
  std::optional<HostGroups> groups;  ///< The hierarchical allreduce's, once made.
  /// The number of hosts.
  int count() const { return placement.hosts(); }
  /// The hierarchical allreduce's groups, or nullptr where they were not made.
  HostGroups* hierarchical() { return groups ? &*groups : nullptr; }
  /// "2 hosts: ranks 0 1 | 2 3".
  std::string describe() const;
};

/// The hosts of `comm`'s ranks: `ranks_per_node` to a host in rank order where it is more
/// than 0 (simulated), else the hosts they run on (shardlab::host_names). Every rank calls it.
Hosts find_hosts(Communicator& comm, int ranks_per_node);

/// The hierarchical allreduce needs as many ranks on every host: where `names` has it,
/// makes its groups (hosts.groups); where the hosts hold different numbers of ranks,
/// leaves it out of `names` with a line saying so or, where it was `asked` for by
/// name, throws shardlab::UsageError. Every rank calls it.
void prepare_hierarchical(shardlab::Context& ctx, Hosts& hosts, std::vector<std::string>& names,
                          bool asked);

/// One algorithm's run, watched from construction to stop(): the bytes this rank sent to
/// each other rank, counted message by message on the communicator and on the
/// hierarchical allreduce's groups (their ranks mapped back); the statistics of all of
/// them; and what this rank's host sent on its network interfaces, read between barriers
/// (uncounted) with no rank sending: over TCP/IP, at least the bytes counted. Every rank
/// makes one.
class Traffic {
 public:
  /// Starts watching `comm` and `hosts`' groups.
  Traffic(Communicator& comm, Hosts& hosts);
  ~Traffic();
  Traffic(const Traffic&) = delete;
  Traffic& operator=(const Traffic&) = delete;
  /// Stops watching; every rank calls it.
  void stop();
  /// Bytes sent to each rank (the vector's index).
  const std::vector<std::size_t>& to() const { return to_; }
  /// The communicator's and the groups' statistics, since construction.
  const shardlab::CommStats& stats() const { return delta_; }
  /// Bytes this host sent on its network interfaces, since construction.
  std::uint64_t wire() const { return wire_; }

 private:
  void watch(Communicator& c, std::vector<int> members);
  void unwatch();
  shardlab::CommStats all_stats() const;
  Communicator& comm_;
  Hosts& hosts_;
  std::vector<std::size_t> to_;
  shardlab::CommStats before_, delta_;
  std::uint64_t wire_ = 0;
  bool watching_ = true;
};

/// The table "between_hosts": for each algorithm the bytes that went between hosts,
/// counted, by formula_link_bytes, and on the wire (real hosts only).
class BetweenHosts {
 public:
  /// A table for `hosts`.
  explicit BetweenHosts(const Hosts& hosts);
  /// Checks every rank's bytes to each peer against formula_bytes_to (not for "native",
  /// whose algorithm is hidden) and, on several hosts, adds the row of `name` and checks
  /// the bytes between hosts against formula_link_bytes. Every rank calls it.
  void add(shardlab::Context& ctx, const std::string& name, std::size_t count,
           const Traffic& traffic);
  /// Prints the table where the ranks sit on more than one host.
  void report(shardlab::Context& ctx) const;

 private:
  const Hosts& hosts_;
  shardlab::Table table_;
};

/// The share of a link's bytes that is data, for TCP over Ethernet with the usual 1500-byte
/// MTU: each 1514-byte frame (14 bytes of Ethernet header, 20 of IP, 32 of TCP with its
/// timestamps) carries 1448 bytes of data. A link's rate counts frames (tbf, which limits
/// scripts/cluster.sh's link, charges each frame's 1514 bytes); busbw counts data.
inline constexpr double payload_per_frame = 1448.0 / 1514.0;

/// Between hosts, the link is the bottleneck: an algorithm that sends B bytes out of its
/// busiest host needs at least B / (the link's data rate: its bytes per second times
/// payload_per_frame), so its busbw is at most 2(N-1)/N S over that. The table
/// "link_bound": at the benchmark's largest size, what each from-scratch algorithm of
/// `names` reached of its bound in `rows`, over a link of `link_gbit` Gbit/s each way.
void report_link_bound(shardlab::Context& ctx, const std::vector<std::string>& names,
                       double link_gbit, const Hosts& hosts,
                       const std::vector<shardlab::bench::Row>& rows);

}  // namespace ch03
