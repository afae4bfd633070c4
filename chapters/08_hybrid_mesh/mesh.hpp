// Chapter 08 API: the hybrid mesh. N = pp x dp x tp ranks as a 3-D grid, and the
// communicators of its groups.
//
// The grid's order is Megatron-LM's: tp fastest, then dp, then pp,
//     rank = (pp_i * dp + dp_i) * tp + tp_i,
// so the tp ranks of a group are neighbours (one node, NVLink), a dp group strides by tp,
// and a pp group by dp * tp. Megatron-LM's documented example: 16 GPUs, tp 2, pp 4 (so
// dp 2) has the tp groups [0, 1], [2, 3], ..., the dp groups [0, 2], [1, 3], [4, 6], ...,
// and the pp groups [0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15].
//
// The learner writes the mesh arithmetic in exercises/08_hybrid_mesh/mesh.cpp (and f and
// g, tensor_parallel.hpp, in mappings.cpp); the reference is solutions/08_hybrid_mesh/.
#pragma once

#include <string_view>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/tensor.hpp"

namespace ch08 {

using shardlab::Communicator;
using shardlab::Tensor;

/// One of the mesh's three axes.
enum class Axis {
  pp,  ///< pipeline parallel: the stages
  dp,  ///< data parallel: the replicas
  tp   ///< tensor parallel: the shards of each layer
};
/// The three axes, in the grid's order, slowest first.
inline constexpr Axis kAxes[] = {Axis::pp, Axis::dp, Axis::tp};
/// "pp", "dp" or "tp".
std::string_view axis_name(Axis axis);

/// The mesh's size along each axis; ranks = pp * dp * tp.
struct MeshShape {
  int pp = 1;  ///< pipeline stages
  int dp = 1;  ///< data-parallel replicas
  int tp = 1;  ///< tensor-parallel shards
  /// The ranks of the mesh: pp * dp * tp.
  int ranks() const { return pp * dp * tp; }
  /// The mesh's size along `axis`.
  int size(Axis axis) const { return axis == Axis::pp ? pp : axis == Axis::dp ? dp : tp; }
  /// Equal when every axis's size is.
  bool operator==(const MeshShape&) const = default;
};

/// A rank's place on the mesh: its pipeline stage, its data-parallel replica, and its
/// tensor-parallel shard.
struct Coords {
  int pp = 0;  ///< the pipeline stage, 0 .. pp-1
  int dp = 0;  ///< the data-parallel replica, 0 .. dp-1
  int tp = 0;  ///< the tensor-parallel shard, 0 .. tp-1
  /// The coordinate along `axis`.
  int at(Axis axis) const { return axis == Axis::pp ? pp : axis == Axis::dp ? dp : tp; }
  /// Equal when every coordinate is.
  bool operator==(const Coords&) const = default;
};

// ---------------------------------------------------------------------------
// The exercise

// [exercise]
/// The coordinates of `rank` (0 <= rank < shape.ranks()): tp fastest, then dp, then pp.
Coords coords_of(const MeshShape& shape, int rank);
/// The rank at `coords`: the inverse of coords_of.
int rank_of(const MeshShape& shape, const Coords& coords);
/// Every group along `axis`: the ranks whose coordinates differ only along it, ordered by
/// that coordinate (so rank i of the group is at coordinate i). The groups are listed in
/// the order of their first rank. Every rank is in exactly one group per axis.
std::vector<std::vector<int>> groups(const MeshShape& shape, Axis axis);
// [exercise]

// ---------------------------------------------------------------------------
// The mesh on real ranks

/// One communicator per axis, made from `world` with the groups above (world.split: the
/// group's index as the colour, the coordinate along the axis as the key). Every rank of
/// `world` constructs it, with the same shape (UsageError unless shape.ranks() is
/// world.size()).
class Mesh {
 public:
  /// Splits `world` into this rank's group along each axis (world.split, three times: every
  /// rank of `world` calls it). UsageError unless shape.ranks() is world.size().
  Mesh(Communicator& world, MeshShape shape);
  /// The mesh's size along each axis.
  const MeshShape& shape() const { return shape_; }
  /// This rank's coordinates: coords_of(shape(), world().rank()).
  const Coords& coords() const { return coords_; }
  /// The communicator of this rank's group along `axis`; its rank there is coords().at(axis).
  Communicator& axis(Axis axis);
  /// The pipeline group: this rank and the other stages of its replica and tp shard.
  Communicator& pp() { return axis(Axis::pp); }
  /// The data-parallel group: this rank's counterparts in the other replicas.
  Communicator& dp() { return axis(Axis::dp); }
  /// The tensor-parallel group: the ranks that share this rank's layers.
  Communicator& tp() { return axis(Axis::tp); }
  /// The communicator the mesh was made from, every rank.
  Communicator& world() { return world_; }

 private:
  Communicator& world_;
  MeshShape shape_;
  Coords coords_;
  std::vector<std::unique_ptr<Communicator>> axes_;  // pp, dp, tp
};

}  // namespace ch08
