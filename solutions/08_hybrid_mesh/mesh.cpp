// Chapter 08 reference, part 1: the mesh arithmetic (mesh.hpp).
#include "mesh.hpp"

#include <iterator>

namespace ch08 {

Coords coords_of(const MeshShape& shape, int rank) {
  // Peel the coordinates off from the fastest axis (tp) to the slowest (pp), as the digits
  // of a number in a mixed radix.
  Coords c;
  for (auto axis = std::rbegin(kAxes); axis != std::rend(kAxes); ++axis) {
    c.at(*axis) = rank % shape.size(*axis);
    rank /= shape.size(*axis);
  }
  return c;
}

int rank_of(const MeshShape& shape, const Coords& c) {
  // The same digits put back together, slowest first.
  int rank = 0;
  for (Axis axis : kAxes) rank = rank * shape.size(axis) + c.at(axis);
  return rank;
}

std::vector<std::vector<int>> groups(const MeshShape& shape, Axis axis) {
  // A group is every rank that shares the other coordinates: walk the ranks in order, and
  // start a group at each rank whose coordinate along `axis` is 0.
  std::vector<std::vector<int>> out;
  for (int rank = 0; rank < shape.ranks(); ++rank) {
    Coords c = coords_of(shape, rank);
    if (c.at(axis) != 0) continue;
    std::vector<int>& group = out.emplace_back();
    for (int i = 0; i < shape.size(axis); ++i) {
      c.at(axis) = i;
      group.push_back(rank_of(shape, c));
    }
  }
  return out;
}

}  // namespace ch08
