// Chapter 08: a mesh's layout on paper (layout.hpp).
#include "layout.hpp"

#include <nlohmann/json.hpp>
#include <set>

namespace ch08 {

using shardlab::Table;

void report_layout(shardlab::Context& ctx, const MeshShape& shape, int gpus_per_node, bool csv) {
  const std::string name = std::to_string(shape.pp) + " x " + std::to_string(shape.dp) + " x " +
                           std::to_string(shape.tp);
  Table ranks({"rank", "node", "pp", "dp", "tp"});
  for (int r = 0; r < shape.ranks(); ++r) {
    const Coords c = coords_of(shape, r);
    ranks.add({r, node_of(r, gpus_per_node), c.pp, c.dp, c.tp});
  }
  ctx.report(ranks, "ranks",
             "Chapter 08 - the mesh pp x dp x tp = " + name + " (" + std::to_string(shape.ranks()) +
                 " ranks, " + std::to_string(gpus_per_node) +
                 " per node): rank = (pp * dp + dp_i) * tp + tp_i, tp fastest (Megatron-LM)");

  if (csv) ctx.save_csv(ranks, "08_hybrid_mesh_layout");
  Table table({"axis", "group", "ranks", "nodes", "inside_a_node"});
  nlohmann::json all = nlohmann::json::object();
  int crossing_tp = 0;
  for (Axis axis : {Axis::tp, Axis::dp, Axis::pp}) {
    const std::string axis_text(axis_name(axis));
    const std::vector<std::vector<int>> gs = groups(shape, axis);
    all[axis_text] = gs;
    for (std::size_t g = 0; g < gs.size(); ++g) {
      std::set<int> nodes;
      std::string members;
      for (int r : gs[g]) {
        nodes.insert(node_of(r, gpus_per_node));
        members += (members.empty() ? "" : " ") + std::to_string(r);
      }
      const std::string span = nodes.size() == 1 ? std::to_string(*nodes.begin())
                                                 : std::to_string(*nodes.begin()) + "-" +
                                                       std::to_string(*nodes.rbegin());
      table.add({axis_text, g, members, span, nodes.size() == 1});
      if (axis == Axis::tp && nodes.size() > 1) ++crossing_tp;
    }
  }
  ctx.report(table, "group_table", "\nevery group per axis, and the nodes its ranks sit on");
  ctx.json()["groups"] = all;
  ctx.json()["tp_crosses_nodes"] = crossing_tp > 0;
  if (crossing_tp)
    ctx.say("\nwarning: " + std::to_string(crossing_tp) + " tp group(s) cross nodes (tp " +
            std::to_string(shape.tp) + " > " + std::to_string(gpus_per_node) +
            " GPUs per node, or not dividing it): their allreduces, two per block and "
            "microbatch, would leave NVLink for the network. Keep tp within a node.");
}

}  // namespace ch08
