// The mesh against one device, and the bytes per axis against their formulas
// (mesh_checks.hpp).
#include "mesh_checks.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "shardlab/format.hpp"

namespace ch08 {

using shardlab::Context;
using shardlab::ReduceOp;
using shardlab::Table;

void report_vs_one_device(Context& ctx, const std::vector<Agreement>& rows,
                          const Tolerance& tolerance, const std::string& caption) {
  std::vector<double> alone;
  for (const Agreement& row : rows)
    alone.push_back(ctx.comm().agree(row.order_alone, ReduceOp::max));
  double worst = 0;  // of the rows held to the worst of all
  for (std::size_t i = 0; i < rows.size(); ++i)
    if (!rows[i].own_least) worst = nan_max(worst, alone[i]);
  Table vs({"what", "one_device", "mesh", "diff", "order_alone", "tolerance"});
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Agreement& row = rows[i];
    const bool own = row.own_least.has_value();
    const double within =
        std::max(own ? *row.own_least : tolerance.least,
                 tolerance.times * (tolerance.worst_of_all && !own ? worst : alone[i]));
    const double diff = ctx.verify_close(row.what, row.diff, within);
    auto cell = [](const std::optional<double>& v) -> shardlab::Cell {
      if (v) return *v;
      return "";
    };
    vs.add({row.what, cell(row.one_device), cell(row.mesh), diff, alone[i], within});
  }
  ctx.report(vs, "vs_single_device", caption);
}

void report_axis_bytes(Context& ctx, const MeshShape& mesh, const AxisBytes& sent,
                       const AxisBytes& formula, const std::string& caption) {
  const std::vector<Axis> shown = shown_axes(mesh);  // the coordinates and the byte columns
  std::vector<std::string> names{"rank"};
  for (Axis axis : shown) names.emplace_back(axis_name(axis));
  std::vector<std::vector<std::int64_t>> every;  // per axis: sent, then formula
  bool equal = true;
  for (Axis axis : shown) {
    names.push_back(std::string(axis_name(axis)) + "_bytes");
    names.push_back(std::string(axis_name(axis)) + "_formula");
    every.push_back(ctx.comm().gather_values(static_cast<std::int64_t>(sent[axis])));
    every.push_back(ctx.comm().gather_values(static_cast<std::int64_t>(formula[axis])));
    equal = equal && every[every.size() - 2] == every.back();
  }
  Table bytes(names);
  for (int r = 0; r < ctx.size(); ++r) {
    const Coords q = coords_of(mesh, r);
    std::vector<shardlab::Cell> row{r};
    for (Axis axis : shown) row.emplace_back(q.at(axis));
    for (const auto& values : every) row.emplace_back(values[static_cast<std::size_t>(r)]);
    bytes.add(row);
  }
  ctx.report(bytes, "bytes_per_axis", caption);
  ctx.verify(equal, "a rank sent other than its axis' formula (bytes_per_axis)");
}

AxisBytes between_hosts(const MeshShape& mesh, int rank, const AxisBytes& sent,
                        const std::vector<int>& host) {
  const Coords at = coords_of(mesh, rank);
  auto off = [&](int q) {
    return host[static_cast<std::size_t>(q)] != host[static_cast<std::size_t>(rank)];
  };
  // A ring over `group`: everything to the rank after this one.
  auto ring = [&](const std::vector<int>& group, std::uint64_t bytes) -> std::uint64_t {
    if (group.size() < 2) return 0;
    const auto me = std::find(group.begin(), group.end(), rank) - group.begin();
    return off(group[static_cast<std::size_t>(me + 1) % group.size()]) ? bytes : 0;
  };
  AxisBytes out;
  for (Axis axis : kAxes) {
    if (axis == Axis::ep) {  // an all-to-all: evenly to the others of the group
      const std::vector<int> ep = group_along(mesh, at, {Axis::ep});
      for (int q : ep)
        if (off(q)) out[axis] += sent[axis] / (ep.size() - 1);
    } else if (axis == Axis::pp) {  // half to each neighbouring stage
      std::vector<int> neighbours;
      for (int d : {-1, 1}) {
        Coords c = at;
        c.pp += d;
        if (c.pp >= 0 && c.pp < mesh.pp) neighbours.push_back(rank_of(mesh, c));
      }
      for (int q : neighbours)
        if (off(q)) out[axis] += sent[axis] / neighbours.size();
    } else {  // a ring over the axis's group (dp's: the replicas)
      out[axis] = ring(group_along(mesh, at, axis == Axis::dp ? kReplicaAxes : std::vector{axis}),
                       sent[axis]);
    }
  }
  return out;
}

namespace {

/// The hosts of a run: which ranks each holds, and what their interfaces sent.
struct HostsOf {
  std::string placement;  // "node0: 0 1 | node1: 2 3"
  nlohmann::json ranks;   // host name -> its ranks
  std::int64_t wire = 0;  // bytes every host's interfaces sent, each host read once
};
HostsOf hosts_of(const std::vector<int>& host, const std::vector<std::string>& distinct,
                 const std::vector<std::int64_t>& wires) {
  HostsOf out;
  out.ranks = nlohmann::json::object();
  for (std::size_t h = 0; h < distinct.size(); ++h) {
    std::vector<int> ranks;
    for (std::size_t r = 0; r < host.size(); ++r)
      if (host[r] == static_cast<int>(h)) ranks.push_back(static_cast<int>(r));
    out.wire += wires[static_cast<std::size_t>(ranks.front())];  // the host's first rank's
    out.placement += (h ? " | " : "") + distinct[h] + ":";
    for (int r : ranks) out.placement += " " + std::to_string(r);
    out.ranks[distinct[h]] = ranks;
  }
  return out;
}

}  // namespace

void report_hosts(Context& ctx, const MeshShape& mesh, const AxisBytes& sent,
                  const StepMeasure& step) {
  shardlab::Communicator& comm = ctx.comm();
  const auto [host, distinct] = shardlab::number_hosts(shardlab::host_names(comm));
  const AxisBytes mine = between_hosts(mesh, comm.rank(), sent, host);
  const std::uint64_t wire = step.wire;
  const double seconds = comm.agree(step.seconds, ReduceOp::max);
  const std::vector<Axis> shown = shown_axes(mesh);
  std::vector<std::int64_t> crossing;
  for (Axis axis : shown)
    crossing.push_back(comm.agree(static_cast<std::int64_t>(mine[axis]), ReduceOp::sum));
  const std::vector<std::int64_t> wires = comm.gather_values(static_cast<std::int64_t>(wire));
  ctx.json()["step_ms"] = 1e3 * seconds;
  if (distinct.size() < 2) {
    ctx.json()["wire_bytes"] = wires[0];
    return;
  }

  // One reading of the wire per host (its ranks share its interfaces): its first rank's.
  const HostsOf hosts = hosts_of(host, distinct, wires);
  Table t({"axis", "groups", "groups_across_hosts", "bytes_between_hosts"});
  std::int64_t all = 0;
  for (std::size_t k = 0; k < shown.size(); ++k) {
    const std::vector<std::vector<int>> every = groups(mesh, shown[k]);
    std::int64_t across = 0;
    for (const std::vector<int>& g : every)
      across += std::any_of(g.begin(), g.end(), [&](int q) {
        return host[static_cast<std::size_t>(q)] != host[static_cast<std::size_t>(g[0])];
      });
    t.add({std::string(axis_name(shown[k])), static_cast<std::int64_t>(every.size()), across,
           crossing[k]});
    all += crossing[k];
  }
  t.add({std::string("all"), std::string(""), std::string(""), all});
  ctx.json()["hosts"] = hosts.ranks;
  ctx.report(t, "between_hosts",
             "\nthe ranks on " + std::to_string(distinct.size()) + " hosts (" + hosts.placement +
                 "); bytes that went between hosts in the last step, per axis: each rank's bytes "
                 "of the axis where the next rank of its group (its neighbour stage, for pp) is "
                 "on another host");
  const std::int64_t on_wire = hosts.wire;
  ctx.json()["wire_bytes"] = on_wire;
  ctx.say(
      "on the wire in that step (what the hosts' network interfaces sent, headers and "
      "acknowledgements included): " +
      std::to_string(on_wire) + " bytes, " +
      shardlab::format_number(
          all > 0 ? static_cast<double>(on_wire) / static_cast<double>(all) : 0.0, 4) +
      " x the bytes above; a step takes " + shardlab::format_number(1e3 * seconds, 4) +
      " ms (the median step, the slowest rank)");
}

}  // namespace ch08
