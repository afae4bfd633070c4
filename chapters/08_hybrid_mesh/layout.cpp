// Chapter 08: a mesh's layout on paper (layout.hpp).
#include "layout.hpp"

#include <nlohmann/json.hpp>
#include <set>

namespace ch08 {

using shardlab::Table;

namespace {

/// A group's ranks as the table shows them: all of a group of up to 16, else the first 8,
/// "...", the last 4 and how many ("0 1 ... 7 ... 65532 65533 65534 65535 (65536 ranks)"):
/// a column as wide as 65536 ranks would make every row of the table as wide.
std::string members_text(const std::vector<int>& group) {
  std::string out;
  const std::size_t n = group.size(), shown = n <= 16 ? n : 8;
  for (std::size_t i = 0; i < shown; ++i) out += (i ? " " : "") + std::to_string(group[i]);
  if (n == shown) return out;
  out += " ...";
  for (std::size_t i = n - 4; i < n; ++i) out += " " + std::to_string(group[i]);
  return out + " (" + std::to_string(n) + " ranks)";
}

}  // namespace

void report_layout(shardlab::Context& ctx, const MeshShape& shape, int gpus_per_node, bool csv) {
  const std::vector<Axis> axes = shown_axes(shape);
  const std::string name = mesh_name(shape), formula = rank_formula(shape);
  std::vector<std::string> columns{"rank", "node"};
  for (Axis axis : axes) columns.emplace_back(axis_name(axis));
  Table ranks(columns);
  for (int r = 0; r < shape.ranks(); ++r) {
    const Coords c = coords_of(shape, r);
    std::vector<shardlab::Cell> row{r, node_of(r, gpus_per_node)};
    for (Axis axis : axes) row.emplace_back(c.at(axis));
    ranks.add(row);
  }
  ctx.report(ranks, "ranks",
             "Chapter 08 - the mesh " + name + " (" + std::to_string(shape.ranks()) + " ranks, " +
                 std::to_string(gpus_per_node) + " per node): rank = " + formula +
                 ", tp fastest (Megatron-LM)");

  if (csv) ctx.save_csv(ranks, "08_hybrid_mesh_layout");
  Table table({"axis", "group", "ranks", "nodes", "inside_a_node"});
  nlohmann::json all = nlohmann::json::object();
  int crossing_tp = 0, crossing_cp = 0;
  for (auto axis = axes.rbegin(); axis != axes.rend(); ++axis) {  // tp first
    const std::string axis_text(axis_name(*axis));
    const std::vector<std::vector<int>> gs = groups(shape, *axis);
    all[axis_text] = gs;
    for (std::size_t g = 0; g < gs.size(); ++g) {
      std::set<int> nodes;
      for (int r : gs[g]) nodes.insert(node_of(r, gpus_per_node));
      const std::string members = members_text(gs[g]);
      const std::string span = nodes.size() == 1 ? std::to_string(*nodes.begin())
                                                 : std::to_string(*nodes.begin()) + "-" +
                                                       std::to_string(*nodes.rbegin());
      table.add({axis_text, g, members, span, nodes.size() == 1});
      if (nodes.size() > 1 && *axis == Axis::tp) ++crossing_tp;
      if (nodes.size() > 1 && *axis == Axis::cp) ++crossing_cp;
    }
  }
  ctx.report(table, "group_table", "\nevery group per axis, and the nodes its ranks sit on");
  ctx.json()["groups"] = all;
  ctx.json()["tp_crosses_nodes"] = crossing_tp > 0;
  if (shape.cp > 1) ctx.json()["cp_crosses_nodes"] = crossing_cp > 0;
  if (crossing_tp)
    ctx.say("\nwarning: " + std::to_string(crossing_tp) + " tp group(s) cross nodes (tp " +
            std::to_string(shape.tp) + " > " + std::to_string(gpus_per_node) +
            " GPUs per node, or not dividing it): their allreduces, two per block and "
            "microbatch, would leave NVLink for the network. Keep tp within a node.");
  if (crossing_cp)
    ctx.say("\nnote: " + std::to_string(crossing_cp) + " cp group(s) cross nodes: their ring " +
            "passes every rank's keys and values on at each of its cp - 1 steps, forward and " +
            "backward, in every block; it hides behind the attention's compute only while the " +
            "link keeps up (chapter 10).");
}

}  // namespace ch08
