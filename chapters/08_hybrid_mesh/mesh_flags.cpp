// Chapter 08: the mesh from a command line (mesh_flags.hpp).
#include "mesh_flags.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <string>

#include "shardlab/check.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/format.hpp"

namespace ch08 {

void add_mesh_flags(CLI::App& cli, MeshShape& shape, const std::vector<Axis>& axes,
                    std::string_view zero_means) {
  for (const AxisInfo& info : kAxisInfo) {
    if (std::find(axes.begin(), axes.end(), info.axis) == axes.end()) continue;
    int& size = shape.size(info.axis);
    const bool zero = size == 0;
    std::string what(info.what);
    if (zero) what += " (0: " + std::string(zero_means) + ")";
    cli.add_option("--" + std::string(info.name), size, what)
        ->check(shardlab::cli::whole(zero ? 0 : 1, kMaxAxisSize))
        ->capture_default_str();
  }
}

MeshShape mesh_for_ranks(MeshShape shape, int ranks) {
  const std::string N = std::to_string(ranks);
  // The axes given besides dp (those of size 1 beyond pp and tp left unnamed).
  std::vector<Axis> others;
  for (Axis axis : shown_axes(shape))
    if (axis != Axis::dp) others.push_back(axis);
  const double rest = product(shape, others);
  shardlab::require_usage(rest >= 1 && rest <= ranks && ranks % static_cast<int>(rest) == 0,
                          mesh_name(shape, others) + " (" + shardlab::format_number(rest) +
                              ") must divide the " + N + " ranks");
  if (shape.dp == 0) shape.dp = ranks / static_cast<int>(rest);
  const std::vector<Axis> all(std::begin(kAxes), std::end(kAxes));
  shardlab::require_usage(product(shape, all) == ranks,
                          mesh_name(shape, all) + " (" +
                              shardlab::format_number(product(shape, all)) + ") must be the " + N +
                              " ranks");
  return shape;
}

}  // namespace ch08
