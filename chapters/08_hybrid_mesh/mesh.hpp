// Chapter 08 API: the hybrid mesh. N = pp x dp x ep x cp x tp ranks as a grid of five axes,
// and the communicators of its groups.
//
// The grid's order is Megatron-LM's ("tp-cp-ep-dp-pp", megatron/core/parallel_state.py):
// tp fastest, then cp, then ep, then dp, then pp,
//     rank = (((pp_i * dp + dp_i) * ep + ep_i) * cp + cp_i) * tp + tp_i,
// so the tp ranks of a group are neighbours (one node, NVLink), the cp ranks of a sequence
// are next closest, and a pp group strides furthest. With cp = ep = 1 (chapters 08 and 09's
// first meshes) it is the 3-D pp x dp x tp grid, rank = (pp_i * dp + dp_i) * tp + tp_i.
// Megatron-LM's documented example: 16 GPUs, tp 2, pp 4 (so dp 2) has the tp groups
// [0, 1], [2, 3], ..., the dp groups [0, 2], [1, 3], [4, 6], ..., and the pp groups
// [0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15].
//
// The two axes chapters 09 and 10 add: cp (context parallel) cuts every sequence over the
// ranks of a ring (chapter 10); ep (expert parallel) spreads a Mixture-of-Experts layer's
// experts (chapter 07) over ranks that each hold their own sequences, so it is carved out
// of data parallelism, as Megatron-LM and DeepSpeed do: the dense weights have ep x dp
// replicas, the experts dp (times cp, whose ranks hold the same weights too).
//
// The learner writes the mesh arithmetic in exercises/08_hybrid_mesh/mesh.cpp (and f and
// g, tensor_parallel.hpp, in mappings.cpp); the reference is solutions/08_hybrid_mesh/.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/tensor.hpp"

namespace ch08 {

using shardlab::Communicator;
using shardlab::Tensor;

/// One of the mesh's five axes.
enum class Axis {
  pp,  ///< pipeline parallel: the stages
  dp,  ///< data parallel: the replicas (of the experts too)
  ep,  ///< expert parallel: replicas of the dense weights that split the experts
  cp,  ///< context parallel: the chunks of every sequence
  tp   ///< tensor parallel: the shards of each layer
};
/// The five axes, in the grid's order, slowest first.
inline constexpr Axis kAxes[] = {Axis::pp, Axis::dp, Axis::ep, Axis::cp, Axis::tp};
/// "pp", "dp", "ep", "cp" or "tp".
std::string_view axis_name(Axis axis);

/// The mesh's size along each axis; ranks = pp * dp * ep * cp * tp. Written {pp, dp, tp}
/// the mesh has no cp and no ep (each 1).
struct MeshShape {
  int pp = 1;  ///< pipeline stages
  int dp = 1;  ///< data-parallel replicas (of everything, experts too)
  int tp = 1;  ///< tensor-parallel shards
  int cp = 1;  ///< context-parallel chunks of each sequence
  int ep = 1;  ///< expert-parallel ranks: the experts split, the dense weights replicated
  /// The ranks of the mesh: pp * dp * ep * cp * tp.
  int ranks() const { return pp * dp * ep * cp * tp; }
  /// The mesh's size along `axis`.
  int size(Axis axis) const {
    switch (axis) {
      case Axis::pp:
        return pp;
      case Axis::dp:
        return dp;
      case Axis::ep:
        return ep;
      case Axis::cp:
        return cp;
      case Axis::tp:
        break;
    }
    return tp;
  }
  /// Equal when every axis's size is.
  bool operator==(const MeshShape&) const = default;
};

/// A rank's place on the mesh: its pipeline stage, its data-parallel replica, its
/// tensor-parallel shard, its chunk of the sequence and its share of the experts.
struct Coords {
  int pp = 0;  ///< the pipeline stage, 0 .. pp-1
  int dp = 0;  ///< the data-parallel replica, 0 .. dp-1
  int tp = 0;  ///< the tensor-parallel shard, 0 .. tp-1
  int cp = 0;  ///< the context-parallel rank, 0 .. cp-1
  int ep = 0;  ///< the expert-parallel rank, 0 .. ep-1
  /// The coordinate along `axis`.
  int at(Axis axis) const { return this->*member(axis); }
  /// The coordinate along `axis`, to set.
  int& at(Axis axis) { return this->*member(axis); }
  /// Equal when every coordinate is.
  bool operator==(const Coords&) const = default;

 private:
  static int Coords::*member(Axis axis) {
    switch (axis) {
      case Axis::pp:
        return &Coords::pp;
      case Axis::dp:
        return &Coords::dp;
      case Axis::ep:
        return &Coords::ep;
      case Axis::cp:
        return &Coords::cp;
      case Axis::tp:
        break;
    }
    return &Coords::tp;
  }
};

// ---------------------------------------------------------------------------
// The exercise

// [exercise]
/// The coordinates of `rank` (0 <= rank < shape.ranks()): tp fastest, then cp, ep, dp, and
/// pp slowest.
Coords coords_of(const MeshShape& shape, int rank);
/// The rank at `coords`: the inverse of coords_of.
int rank_of(const MeshShape& shape, const Coords& coords);
/// Every group along `axis`: the ranks whose coordinates differ only along it, ordered by
/// that coordinate (so rank i of the group is at coordinate i). The groups are listed in
/// the order of their first rank. Every rank is in exactly one group per axis.
std::vector<std::vector<int>> groups(const MeshShape& shape, Axis axis);
// [exercise]

/// The axes a table of `shape` shows, slowest first: pp, dp and tp always, ep and cp where
/// they are more than 1 (a 3-D mesh's tables stay as they were).
std::vector<Axis> shown_axes(const MeshShape& shape);

/// "pp x dp x tp = 2 x 2 x 2", or with cp or ep "pp x dp x ep x cp x tp = 1 x 2 x 2 x 2 x 1":
/// the shown_axes and their sizes.
std::string mesh_name(const MeshShape& shape);

/// The ranks that differ from `at` only along `across` (at itself among them), in the
/// order of those coordinates, slowest axis first: the members of a group that spans
/// several axes (Mesh::replicas: dp, ep and cp). From coords_of and rank_of.
std::vector<int> ranks_across(const MeshShape& shape, const Coords& at, std::vector<Axis> across);

// ---------------------------------------------------------------------------
// The mesh on real ranks

/// One communicator per axis, made from `world` with the groups above (world.split: the
/// group's index as the colour, the coordinate along the axis as the key), and the two
/// groups data parallelism sums gradients over. Every rank of `world` constructs it, with
/// the same shape (UsageError unless shape.ranks() is world.size()).
class Mesh {
 public:
  /// Splits `world` into this rank's group along each axis, and into its replicas and
  /// expert replicas (world.split, seven times: every rank of `world` calls it).
  /// UsageError unless shape.ranks() is world.size().
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
  /// The expert-parallel group: the ranks that split the experts between them.
  Communicator& ep() { return axis(Axis::ep); }
  /// The context-parallel group: the ranks that hold the other chunks of this rank's
  /// sequences (a ring, in chapter 10).
  Communicator& cp() { return axis(Axis::cp); }
  /// The tensor-parallel group: the ranks that share this rank's layers.
  Communicator& tp() { return axis(Axis::tp); }
  /// Every rank that holds the same dense weights as this one: the same pp and tp
  /// coordinates, any dp, ep and cp (Megatron-LM's data-parallel group "with context
  /// parallel"). Their gradients are summed over it. With cp = ep = 1, dp's ranks.
  Communicator& replicas() { return *replicas_; }
  /// Every rank that holds the same experts as this one: the same pp, ep and tp
  /// coordinates, any dp and cp (Megatron-LM's expert data-parallel group).
  Communicator& expert_replicas() { return *expert_replicas_; }
  /// The communicator the mesh was made from, every rank.
  Communicator& world() { return world_; }

 private:
  Communicator& world_;
  MeshShape shape_;
  Coords coords_;
  std::vector<std::unique_ptr<Communicator>> axes_;  // in kAxes' order
  std::unique_ptr<Communicator> replicas_, expert_replicas_;
};

}  // namespace ch08
