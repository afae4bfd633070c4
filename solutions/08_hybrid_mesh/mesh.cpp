// Chapter 08 reference, part 1: the mesh arithmetic (mesh.hpp).
#include "mesh.hpp"

namespace ch08 {

Coords coords_of(const MeshShape& shape, int rank) {
  // tp is the fastest-moving coordinate, then dp, then pp.
  return {rank / (shape.dp * shape.tp), rank / shape.tp % shape.dp, rank % shape.tp};
}

int rank_of(const MeshShape& shape, const Coords& c) {
  return (c.pp * shape.dp + c.dp) * shape.tp + c.tp;
}

std::vector<std::vector<int>> groups(const MeshShape& shape, Axis axis) {
  // A group is every rank that shares the other two coordinates: walk the ranks in order,
  // and start a group at each rank whose coordinate along `axis` is 0.
  std::vector<std::vector<int>> out;
  for (int rank = 0; rank < shape.ranks(); ++rank) {
    Coords c = coords_of(shape, rank);
    if (c.at(axis) != 0) continue;
    std::vector<int>& group = out.emplace_back();
    for (int i = 0; i < shape.size(axis); ++i) {
      (axis == Axis::pp ? c.pp : axis == Axis::dp ? c.dp : c.tp) = i;
      group.push_back(rank_of(shape, c));
    }
  }
  return out;
}

}  // namespace ch08
