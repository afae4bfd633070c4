// Chapter 08: the mesh on real ranks, its communicators made from the learner's groups
// (mesh.hpp).
#include <algorithm>

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

std::vector<Axis> shown_axes(const MeshShape& shape) {
  std::vector<Axis> out;
  for (Axis axis : kAxes)
    if (axis == Axis::pp || axis == Axis::dp || axis == Axis::tp || shape.size(axis) > 1)
      out.push_back(axis);
  return out;
}

std::string mesh_name(const MeshShape& shape) {
  std::string names, sizes;
  for (Axis axis : shown_axes(shape)) {
    names += (names.empty() ? "" : " x ") + std::string(axis_name(axis));
    sizes += (sizes.empty() ? "" : " x ") + std::to_string(shape.size(axis));
  }
  return names + " = " + sizes;
}

std::vector<int> ranks_across(const MeshShape& shape, const Coords& at, std::vector<Axis> across) {
  // In kAxes' order, slowest first, whatever order they were given in.
  std::vector<Axis> axes;
  for (Axis axis : kAxes)
    if (std::find(across.begin(), across.end(), axis) != across.end()) axes.push_back(axis);
  int count = 1;
  for (Axis axis : axes) count *= shape.size(axis);
  std::vector<int> out;
  for (int key = 0; key < count; ++key) {
    Coords c = at;
    int rest = key;
    for (auto axis = axes.rbegin(); axis != axes.rend(); ++axis) {
      c.at(*axis) = rest % shape.size(*axis);
      rest /= shape.size(*axis);
    }
    out.push_back(rank_of(shape, c));
  }
  return out;
}

namespace {

/// This rank's group of the ranks that differ from it only along `across`: the colour is
/// the group's first rank, the key this rank's place in it.
std::unique_ptr<Communicator> split_across(Communicator& world, const MeshShape& shape,
                                           const Coords& me, std::vector<Axis> across) {
  const std::vector<int> members = ranks_across(shape, me, std::move(across));
  const auto place = std::find(members.begin(), members.end(), world.rank()) - members.begin();
  return world.split(members.front(), static_cast<int>(place));
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
