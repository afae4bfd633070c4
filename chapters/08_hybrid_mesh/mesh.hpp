// Chapter 08 API: the hybrid mesh. N = pp x dp x ep x cp x tp ranks as a grid of five axes,
// and the communicators of its groups.
//
// The grid's order is Megatron-LM's ("tp-cp-ep-dp-pp", megatron/core/parallel_state.py):
// tp fastest, then cp, then ep, then dp, then pp,
//     rank = (((pp_i * dp + dp_i) * ep + ep_i) * cp + cp_i) * tp + tp_i,
// so the tp ranks of a group are neighbours (one node, NVLink), the cp ranks of a sequence
// are next closest, and a pp group strides furthest. Megatron-LM's documented example:
// 16 GPUs, tp 2, pp 4 (so dp 2) has the tp groups [0, 1], [2, 3], ..., the dp groups
// [0, 2], [1, 3], [4, 6], ..., and the pp groups [0, 4, 8, 12], [1, 5, 9, 13], ...
//
// cp (context parallel) cuts every sequence over the ranks of a ring (chapter 10); ep
// (expert parallel) spreads a Mixture-of-Experts layer's experts (chapter 07) over ranks
// that each hold their own sequences, so it is carved out of data parallelism, as
// Megatron-LM and DeepSpeed do: the dense weights have ep x dp replicas, the experts dp
// (times cp, whose ranks hold the same weights too).
//
// The axes are data: an Axis names one, kAxes lists them in the grid's order, and a
// PerAxis<T> holds one T for each (a rank's bytes, a planner's costs, a profile's seconds),
// so that what is counted, costed or printed per axis is written once for all of them.
//
// The learner writes the mesh arithmetic in exercises/08_hybrid_mesh/mesh.cpp (and f and
// g, tensor_parallel.hpp, in mappings.cpp); the reference is solutions/08_hybrid_mesh/.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/tensor.hpp"

namespace ch08 {

using shardlab::Communicator;
using shardlab::Tensor;

/// One of the mesh's axes.
enum class Axis {
  pp,  ///< pipeline parallel: the stages
  dp,  ///< data parallel: the replicas (of the experts too)
  ep,  ///< expert parallel: replicas of the dense weights that split the experts
  cp,  ///< context parallel: the chunks of every sequence
  tp   ///< tensor parallel: the shards of each layer
};
/// The axes, in the grid's order, slowest first.
inline constexpr Axis kAxes[] = {Axis::pp, Axis::dp, Axis::ep, Axis::cp, Axis::tp};
/// How many axes the mesh has.
inline constexpr std::size_t kAxisCount = std::size(kAxes);
/// `axis`'s place in kAxes.
constexpr std::size_t index_of(Axis axis) { return static_cast<std::size_t>(axis); }

/// What each axis is called, what it splits (the flags' help) and what it sends, in kAxes'
/// order.
struct AxisInfo {
  Axis axis;                 ///< the axis
  std::string_view name;     ///< "pp", ...: its flag is --name
  std::string_view what;     ///< what its ranks split, for --help
  std::string_view sends;    ///< what its communication is: "the allreduces", ...
  bool inside_layer = true;  ///< its calls happen inside a layer's pass (not between steps' parts)
};
/// Every axis's AxisInfo, in kAxes' order.
inline constexpr AxisInfo kAxisInfo[] = {
    {Axis::pp, "pp", "pipeline stages: the layers cut into consecutive stages (chapter 04)",
     "activations between stages, and wte's allreduce", false},
    {Axis::dp, "dp", "data-parallel replicas: each its own share of the batch (chapter 02)",
     "gradients' allreduces", false},
    {Axis::ep, "ep",
     "expert-parallel ranks: the experts split over them, carved out of dp (chapter 07)",
     "all-to-alls", true},
    {Axis::cp, "cp", "context-parallel ranks: each sequence cut over a ring of them (chapter 10)",
     "ring's passes", true},
    {Axis::tp, "tp", "tensor-parallel ranks: each layer's weights split over them (chapter 08)",
     "allreduces", true},
};
static_assert(std::size(kAxisInfo) == kAxisCount);

/// "pp", "dp", "ep", "cp" or "tp".
constexpr std::string_view axis_name(Axis axis) { return kAxisInfo[index_of(axis)].name; }

/// The axes whose ranks hold the same dense weights and sum their gradients: data
/// parallelism's replicas (Megatron-LM's data-parallel group "with context parallel").
inline const std::vector<Axis> kReplicaAxes = {Axis::dp, Axis::ep, Axis::cp};
/// The axes whose ranks hold the same experts: the expert replicas (Megatron-LM's expert
/// data-parallel group).
inline const std::vector<Axis> kExpertReplicaAxes = {Axis::dp, Axis::cp};

/// One T for each axis, indexed by an Axis: a rank's bytes per axis, a plan's costs, a
/// profile's seconds. Value-initialised (zeros, false).
template <class T>
class PerAxis {
 public:
  /// The value of `axis`.
  T& operator[](Axis axis) { return values_[index_of(axis)]; }
  /// The value of `axis`.
  const T& operator[](Axis axis) const { return values_[index_of(axis)]; }
  /// Equal when every axis's value is.
  bool operator==(const PerAxis&) const = default;

 private:
  std::array<T, kAxisCount> values_{};
};

/// The values of every axis added up.
template <class T>
T total(const PerAxis<T>& values) {
  T sum{};
  for (Axis axis : kAxes) sum += values[axis];
  return sum;
}

/// The mesh's size along each axis, in the grid's order; ranks = pp * dp * ep * cp * tp.
/// Written with the axes' names: MeshShape{.pp = 2, .dp = 2, .tp = 2}.
struct MeshShape {
  int pp = 1;  ///< pipeline stages
  int dp = 1;  ///< data-parallel replicas (of everything, experts too)
  int ep = 1;  ///< expert-parallel ranks: the experts split, the dense weights replicated
  int cp = 1;  ///< context-parallel chunks of each sequence
  int tp = 1;  ///< tensor-parallel shards
  /// The ranks of the mesh: pp * dp * ep * cp * tp (a mesh whose product fits an int:
  /// sizes from a command line are checked with check_mesh_size first).
  int ranks() const {
    int n = 1;
    for (Axis axis : kAxes) n *= size(axis);
    return n;
  }
  /// The mesh's size along `axis`.
  int size(Axis axis) const { return this->*field(axis); }
  /// The mesh's size along `axis`, to set.
  int& size(Axis axis) { return this->*field(axis); }
  /// Equal when every axis's size is.
  bool operator==(const MeshShape&) const = default;

 private:
  static int MeshShape::*field(Axis axis) {
    static constexpr int MeshShape::*fields[] = {&MeshShape::pp, &MeshShape::dp, &MeshShape::ep,
                                                 &MeshShape::cp, &MeshShape::tp};
    static_assert(std::size(fields) == kAxisCount);
    return fields[index_of(axis)];
  }
};

/// A rank's place on the mesh: its pipeline stage, its data-parallel replica, its share of
/// the experts, its chunk of the sequence and its tensor-parallel shard.
struct Coords {
  int pp = 0;  ///< the pipeline stage, 0 .. pp-1
  int dp = 0;  ///< the data-parallel replica, 0 .. dp-1
  int ep = 0;  ///< the expert-parallel rank, 0 .. ep-1
  int cp = 0;  ///< the context-parallel rank, 0 .. cp-1
  int tp = 0;  ///< the tensor-parallel shard, 0 .. tp-1
  /// The coordinate along `axis`.
  int at(Axis axis) const { return this->*field(axis); }
  /// The coordinate along `axis`, to set.
  int& at(Axis axis) { return this->*field(axis); }
  /// Equal when every coordinate is.
  bool operator==(const Coords&) const = default;

 private:
  static int Coords::*field(Axis axis) {
    static constexpr int Coords::*fields[] = {&Coords::pp, &Coords::dp, &Coords::ep, &Coords::cp,
                                              &Coords::tp};
    static_assert(std::size(fields) == kAxisCount);
    return fields[index_of(axis)];
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

/// The axes a table of `shape` shows, slowest first: pp, dp and tp always, the others where
/// they are more than 1.
std::vector<Axis> shown_axes(const MeshShape& shape);

/// The product of `shape`'s sizes along `axes`, in floating point: exact up to 2^53 and
/// never overflowing, whatever sizes a command line gives (compare it with a limit before
/// ranks() is called).
double product(const MeshShape& shape, const std::vector<Axis>& axes);

/// "pp x dp x tp = 2 x 2 x 2": the axes of `axes`, slowest first whatever their order
/// there, and their sizes.
std::string mesh_name(const MeshShape& shape, const std::vector<Axis>& axes);
/// mesh_name over shown_axes(shape): "pp x dp x tp = 2 x 2 x 2", or with cp or ep
/// "pp x dp x ep x cp x tp = 1 x 2 x 2 x 2 x 1".
std::string mesh_name(const MeshShape& shape);

/// Every mesh of `ranks` ranks over `axes` (the others of size 1): each size along them a
/// divisor, their product `ranks`; in the grid's order, the slowest axis's size growing
/// slowest.
std::vector<MeshShape> meshes_of(int ranks, const std::vector<Axis>& axes);

/// The rank at a place of the mesh, over shown_axes(shape): "(pp_i * dp + dp_i) * tp + tp_i".
std::string rank_formula(const MeshShape& shape);

/// UsageError unless every size of `shape` is at least 1 and their product at most `most`
/// ranks: "pp x dp x ep x cp x tp = 8 x 1 x 1048576 x 1048576 x 1048576 = 9.223e18 ranks: at
/// most 65536".
void check_mesh_size(const MeshShape& shape, double most);

/// The ranks that differ from `at` only along `across` (at itself among them), in the
/// order of those coordinates, slowest axis first: the members of a group that spans
/// several axes (Mesh::replicas: kReplicaAxes). From coords_of and rank_of.
std::vector<int> group_along(const MeshShape& shape, const Coords& at, std::vector<Axis> across);

// ---------------------------------------------------------------------------
// The mesh on real ranks

/// One communicator per axis, made from `world` with the groups above (world.split: the
/// group's index as the colour, the coordinate along the axis as the key), and the two
/// groups data parallelism sums gradients over. Every rank of `world` constructs it, with
/// the same shape (UsageError unless shape.ranks() is world.size()).
class Mesh {
 public:
  /// Splits `world` into this rank's group along each axis, and into its replicas and
  /// expert replicas (world.split, once per axis and twice more: every rank of `world`
  /// calls it). UsageError unless shape.ranks() is world.size().
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
  /// Every rank that holds the same dense weights as this one: the same coordinates but
  /// along kReplicaAxes (Megatron-LM's data-parallel group "with context parallel"). Their
  /// gradients are summed over it. With cp = ep = 1, dp's ranks.
  Communicator& replicas() { return *replicas_; }
  /// Every rank that holds the same experts as this one: the same coordinates but along
  /// kExpertReplicaAxes (Megatron-LM's expert data-parallel group).
  Communicator& expert_replicas() { return *expert_replicas_; }
  /// The communicator the mesh was made from, every rank.
  Communicator& world() { return world_; }
  /// Every communicator of the mesh with the axis whose traffic it carries: each axis's
  /// own, and the replicas and the expert replicas as dp's (data parallelism's sums).
  std::vector<std::pair<Axis, Communicator*>> communicators();

 private:
  Communicator& world_;
  MeshShape shape_;
  Coords coords_;
  std::vector<std::unique_ptr<Communicator>> axes_;  // in kAxes' order
  std::unique_ptr<Communicator> replicas_, expert_replicas_;
};

/// The bytes this rank sends on each axis, from the meter's making to sent(): over every
/// communicator of Mesh::communicators(), and any count_as() adds.
///
///   AxisMeter meter(mesh);  ... a step ...;  PerAxis<std::uint64_t> bytes = meter.sent();
class AxisMeter {
 public:
  /// Starts counting on every communicator of `mesh` (it must outlive the meter).
  explicit AxisMeter(Mesh& mesh);
  /// Counts what `comm` sends from now on as `axis`'s too (chapter 09: the embedding
  /// group's allreduce of wte's gradient, as pp's).
  void count_as(Axis axis, Communicator& comm);
  /// The bytes sent on each axis since the meter began (or since count_as, for those).
  PerAxis<std::uint64_t> sent() const;

 private:
  struct Counted {
    Axis axis;
    Communicator* comm;
    shardlab::CommStats start;
  };
  std::vector<Counted> counted_;
};

}  // namespace ch08
