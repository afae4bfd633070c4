// Chapter 08 on paper: a mesh's layout, for any size (layout.hpp), no ranks started: each
// rank's coordinates and node, every group per axis, and the tp groups that leave a node.
//
// Run:
//   build/default/bin/ch08_layout --pp 4 --dp 2 --tp 2       Megatron-LM's 16-GPU example
//   build/default/bin/ch08_layout --pp 64 --dp 6 --tp 8      NVIDIA's 1T model's 3072 GPUs
//   build/default/bin/ch08_layout --tp 16                    a tp group across two nodes
//   build/default/bin/ch08_layout --tp 2 --cp 2 --ep 2 --dp 2 --pp 2   all five axes
//
// Expected: the groups of Megatron-LM's documentation (tp [0, 1], dp [0, 2], pp
// [0, 4, 8, 12], ...); a warning for every tp group that crosses nodes.
#include <nlohmann/json.hpp>

#include "layout.hpp"
#include "mesh_flags.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/launch.hpp"

using namespace shardlab;
using namespace ch08;

int main(int argc, char** argv) {
  Program program(
      "ch08_layout",
      "Chapter 08 on paper: the ranks and groups of a pp x dp x ep x cp x tp mesh, node "
      "by node");
  program.on_paper();
  MeshShape mesh{.pp = 2, .dp = 2, .tp = 2};
  int gpus_per_node = 8;
  bool csv = false;
  auto& cli = program.cli();
  add_mesh_flags(cli, mesh, {std::begin(kAxes), std::end(kAxes)});
  cli.add_option("--gpus-per-node", gpus_per_node, "GPUs a node (consecutive ranks)")
      ->check(cli::whole(1, 1 << 20))
      ->capture_default_str();
  cli.add_flag("--csv", csv, "also write the ranks' table as CSV");
  program.validate([&](const Options&) { check_mesh_size(mesh, 1 << 16); });
  program.writes_csv([&] { return csv; });
  return program.run(argc, argv, [&](Context& ctx) {
    ctx.json()["chapter"] = "08_hybrid_mesh";
    report_layout(ctx, mesh, gpus_per_node, csv);
  });
}
