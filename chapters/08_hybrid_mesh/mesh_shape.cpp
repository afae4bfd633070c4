// Chapter 08: a mesh's shape as numbers and words, no ranks (mesh.hpp): what it shows, its
// products, its name and its rank's formula. The planner's too, so no learner's code here.
#include <algorithm>
#include <iterator>

#include "mesh.hpp"
#include "shardlab/check.hpp"
#include "shardlab/format.hpp"

namespace ch08 {

using shardlab::require_usage;

std::vector<Axis> shown_axes(const MeshShape& shape) {
  std::vector<Axis> out;
  for (Axis axis : kAxes)
    if (axis == Axis::pp || axis == Axis::dp || axis == Axis::tp || shape.size(axis) > 1)
      out.push_back(axis);
  return out;
}

double product(const MeshShape& shape, const std::vector<Axis>& axes) {
  double n = 1;
  for (Axis axis : axes) n *= shape.size(axis);
  return n;
}

std::string mesh_name(const MeshShape& shape, const std::vector<Axis>& axes) {
  std::string names, sizes;
  for (Axis axis : kAxes) {
    if (std::find(axes.begin(), axes.end(), axis) == axes.end()) continue;
    names += (names.empty() ? "" : " x ") + std::string(axis_name(axis));
    sizes += (sizes.empty() ? "" : " x ") + std::to_string(shape.size(axis));
  }
  return names + " = " + sizes;
}

std::string mesh_name(const MeshShape& shape) { return mesh_name(shape, shown_axes(shape)); }

std::vector<MeshShape> meshes_of(int ranks, const std::vector<Axis>& axes) {
  std::vector<MeshShape> out;
  // Axis by axis in the grid's order: each divisor of what the axes before it left.
  auto fill = [&](auto&& self, std::size_t next, MeshShape mesh, int left) -> void {
    if (next == kAxisCount) {
      if (left == 1) out.push_back(mesh);
      return;
    }
    const Axis axis = kAxes[next];
    const bool free = std::find(axes.begin(), axes.end(), axis) != axes.end();
    for (int size = 1; size <= (free ? left : 1); ++size) {
      if (left % size) continue;
      mesh.size(axis) = size;
      self(self, next + 1, mesh, left / size);
    }
  };
  fill(fill, 0, MeshShape{}, ranks);
  return out;
}

std::string rank_formula(const MeshShape& shape) {
  std::string rank;
  for (Axis axis : shown_axes(shape)) {
    const std::string name(axis_name(axis));
    if (rank.empty()) {
      rank = name + "_i";
      continue;
    }
    const bool sum = rank.find('+') != std::string::npos;
    rank = (sum ? "(" + rank + ")" : rank) + " * " + name + " + " + name + "_i";
  }
  return rank;
}

void check_mesh_size(const MeshShape& shape, double most) {
  const std::vector<Axis> all(std::begin(kAxes), std::end(kAxes));
  for (Axis axis : kAxes)
    require_usage(shape.size(axis) >= 1, "--" + std::string(axis_name(axis)) + " " +
                                             std::to_string(shape.size(axis)) +
                                             ": every axis has at least 1 rank");
  const double ranks = product(shape, all);
  require_usage(ranks <= most, mesh_name(shape, all) + " = " + shardlab::format_number(ranks) +
                                   " ranks: at most " + shardlab::format_number(most));
}

}  // namespace ch08
