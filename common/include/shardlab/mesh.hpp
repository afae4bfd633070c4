// DeviceMesh: the ranks of a job as an N-D grid with named axes, and one communicator per
// axis.
//
// The grid is row-major with the last axis innermost, as PyTorch's init_device_mesh lays
// it out: on a (pp, dp, tp) = (2, 2, 2) mesh, world rank 5 is at (1, 0, 1), and its "tp"
// communicator holds ranks 4 and 5 — neighbours, the way Megatron-LM's "tp-dp-pp" order
// keeps tensor-parallel ranks on one node. Each axis communicator holds the ranks whose
// coordinates differ from this rank's only along that axis, ordered by that coordinate.
//
//   DeviceMesh mesh(comm, {2, 2, 2}, {"pp", "dp", "tp"});
//   mesh.axis("tp").allreduce(partial);        // among this rank's tensor-parallel group
//   mesh.coord("pp")                           // this rank's pipeline stage
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardlab/comm.hpp"

namespace shardlab {

/// The ranks of a job as an N-D grid with named axes, and this rank's communicator along
/// each axis (see the top of the file for the layout).
class DeviceMesh {
 public:
  /// Every rank of `world` calls it. The product of `shape` must be world.size(), and
  /// there is one distinct name per axis (Error otherwise).
  DeviceMesh(Communicator& world, std::vector<int> shape, std::vector<std::string> names);

  /// The number of axes.
  int ndim() const { return static_cast<int>(shape_.size()); }
  /// The length of each axis, outermost first.
  const std::vector<int>& shape() const { return shape_; }
  /// The name of each axis, in the order of shape().
  const std::vector<std::string>& names() const { return names_; }
  /// The index of the axis called `name` (Error when there is none).
  int axis_index(std::string_view name) const;
  /// The length of `axis`: the number of ranks in this rank's communicator along it.
  int size(std::string_view axis) const {
    return shape_[static_cast<std::size_t>(axis_index(axis))];
  }
  /// This rank's coordinate along `axis`.
  int coord(std::string_view axis) const {
    return coords_[static_cast<std::size_t>(axis_index(axis))];
  }
  /// This rank's coordinates, one per axis.
  const std::vector<int>& coords() const { return coords_; }
  /// The world rank at `coords` (row-major, last axis innermost).
  int rank_at(const std::vector<int>& coords) const;
  /// The coordinates of world rank `rank`.
  std::vector<int> coords_of(int rank) const;
  /// The communicator the mesh was made from.
  Communicator& world() { return world_; }
  /// This rank's communicator along `axis`.
  Communicator& axis(std::string_view name);
  /// This rank's counters on each axis communicator, summed: the traffic of one rank
  /// over every axis (the world communicator's own calls are not in it).
  CommStats axis_stats() const;

 private:
  Communicator& world_;
  std::vector<int> shape_;
  std::vector<std::string> names_;
  std::vector<int> coords_;
  std::vector<std::unique_ptr<Communicator>> axes_;
};

}  // namespace shardlab
