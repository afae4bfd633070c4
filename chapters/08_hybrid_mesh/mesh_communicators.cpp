// Chapter 08: the mesh on real ranks, its communicators made from the learner's groups
// (mesh.hpp).
#include <algorithm>
#include <initializer_list>

#include "mesh.hpp"
#include "shardlab/check.hpp"

namespace ch08 {

using shardlab::Error;
using shardlab::require_usage;

std::string_view axis_name(Axis axis) {
  switch (axis) {
    case Axis::pp:
      return "pp";
    case Axis::dp:
      return "dp";
    case Axis::ep:
      return "ep";
    case Axis::cp:
      return "cp";
    case Axis::tp:
      break;
  }
  return "tp";
}

namespace {

/// This rank's group of the ranks that differ from it only along `across`: the colour is
/// the rank with those coordinates at 0, the key its place among them (slowest first).
std::unique_ptr<Communicator> split_across(Communicator& world, const MeshShape& shape,
                                           const Coords& me, std::initializer_list<Axis> across) {
  Coords base = me;
  int key = 0;
  for (Axis axis : kAxes)
    for (Axis a : across)
      if (a == axis) {
        key = key * shape.size(axis) + me.at(axis);
        base.at(axis) = 0;
      }
  return world.split(rank_of(shape, base), key);
}

}  // namespace

Mesh::Mesh(Communicator& world, MeshShape shape) : world_(world), shape_(shape) {
  bool positive = true;
  std::string sizes;
  for (Axis axis : kAxes) {
    positive = positive && shape.size(axis) > 0;
    sizes += (sizes.empty() ? "" : " x ") + std::to_string(shape.size(axis));
  }
  require_usage(positive && shape.ranks() == world.size(),
                "the mesh pp x dp x ep x cp x tp = " + sizes + " must hold the " +
                    std::to_string(world.size()) + " ranks");
  const int me = world.rank();
  coords_ = coords_of(shape, me);
  if (rank_of(shape, coords_) != me)
    throw Error("rank_of(coords_of(" + std::to_string(me) + ")) is " +
                std::to_string(rank_of(shape, coords_)) + ", not " + std::to_string(me) +
                ": coords_of and rank_of are not each other's inverse");
  for (Axis axis : kAxes) {
    const std::string name(axis_name(axis));
    // The group that holds this rank is its colour; its place in the group, the key.
    int color = -1, key = -1, found = 0;
    const std::vector<std::vector<int>> all = groups(shape, axis);
    for (std::size_t g = 0; g < all.size(); ++g) {
      const auto at = std::find(all[g].begin(), all[g].end(), me);
      if (at == all[g].end()) continue;
      ++found;
      color = static_cast<int>(g);
      key = static_cast<int>(at - all[g].begin());
      if (all[g].size() != static_cast<std::size_t>(shape.size(axis)))
        throw Error("groups(" + name + ") has a group of " + std::to_string(all[g].size()) +
                    " ranks holding rank " + std::to_string(me) + "; every " + name +
                    " group has " + std::to_string(shape.size(axis)));
    }
    if (found != 1)
      throw Error("groups(" + name + ") puts rank " + std::to_string(me) + " in " +
                  std::to_string(found) + " groups; every rank is in exactly one per axis");
    if (key != coords_.at(axis))
      throw Error("groups(" + name + ") has rank " + std::to_string(me) + " at place " +
                  std::to_string(key) + " of its group, but coords_of puts it at " + name + " = " +
                  std::to_string(coords_.at(axis)));
    axes_.push_back(world.split(color, key));
  }
  replicas_ = split_across(world, shape, coords_, {Axis::dp, Axis::ep, Axis::cp});
  expert_replicas_ = split_across(world, shape, coords_, {Axis::dp, Axis::cp});
}

Communicator& Mesh::axis(Axis axis) { return *axes_[static_cast<std::size_t>(axis)]; }

}  // namespace ch08
