// Chapter 08: the mesh on real ranks, its communicators made from the learner's groups
// (mesh.hpp).
#include <algorithm>

#include "mesh.hpp"
#include "shardlab/check.hpp"

namespace ch08 {

using shardlab::Error;
using shardlab::require_usage;

std::vector<int> group_along(const MeshShape& shape, const Coords& at, std::vector<Axis> across) {
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
  const std::vector<int> members = group_along(shape, me, std::move(across));
  const auto place = std::find(members.begin(), members.end(), world.rank()) - members.begin();
  return world.split(members.front(), static_cast<int>(place));
}

}  // namespace

Mesh::Mesh(Communicator& world, MeshShape shape) : world_(world), shape_(shape) {
  const std::vector<Axis> every(std::begin(kAxes), std::end(kAxes));
  bool positive = true;
  for (Axis axis : kAxes) positive = positive && shape.size(axis) > 0;
  require_usage(positive && product(shape, every) == world.size(),
                "the mesh " + mesh_name(shape, every) + " must hold the " +
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
    axes_.back()->name_flights(name);  // a flight record's "tp[4,5]"
  }
  replicas_ = split_across(world, shape, coords_, kReplicaAxes);
  replicas_->name_flights("replicas");
  expert_replicas_ = split_across(world, shape, coords_, kExpertReplicaAxes);
  expert_replicas_->name_flights("expert_replicas");
}

Communicator& Mesh::axis(Axis axis) { return *axes_[index_of(axis)]; }

std::vector<std::pair<Axis, Communicator*>> Mesh::communicators() {
  std::vector<std::pair<Axis, Communicator*>> out;
  for (Axis a : kAxes) out.emplace_back(a, &axis(a));
  out.emplace_back(Axis::dp, replicas_.get());
  out.emplace_back(Axis::dp, expert_replicas_.get());
  return out;
}

AxisMeter::AxisMeter(Mesh& mesh) {
  for (auto [axis, comm] : mesh.communicators()) count_as(axis, *comm);
}

void AxisMeter::count_as(Axis axis, Communicator& comm) {
  counted_.push_back({axis, &comm, comm.stats()});
}

PerAxis<std::uint64_t> AxisMeter::sent() const {
  PerAxis<std::uint64_t> out;
  for (const Counted& c : counted_)
    out[c.axis] += c.comm->stats().since(c.start).total().bytes_sent;
  return out;
}

}  // namespace ch08
