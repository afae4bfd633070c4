// Chapter 08 exercise, part 1: the mesh's arithmetic (part 2, f and g: mappings.cpp).
// Read chapters/08_hybrid_mesh/README.md first (its picture shows the 2 x 2 x 2 mesh);
// check your work with `make check CH=08`, and see your mesh with
// `build/learner/bin/ch08_layout --dp 2 --tp 2 --pp 4`.
//
// Part 1, the mesh. N = pp x dp x ep x cp x tp ranks, in Megatron-LM's order: tp fastest,
// then cp, then ep, then dp, then pp. On a (pp, dp, tp) = (2, 2, 2) mesh (cp = ep = 1)
// rank 5 is at pp 1, dp 0, tp 1; on pp 1, dp 2, ep 2, cp 2, tp 1, rank 5 is at dp 1, ep 0,
// cp 1. Coords::at(axis) reads or sets one coordinate, MeshShape::size(axis) one size, and
// kAxes lists the axes slowest first. The tests check your groups against Megatron-LM's
// documented 16-GPU example (mesh.hpp) and meshes of five axes, and run the chapter's 3-D
// training on communicators made from them.
//
// Stuck? The chapter README's Exercise section has hints, one at a time.
#include "mesh.hpp"

#include "shardlab/check.hpp"

namespace ch08 {

// TODO(ch08): coords_of
// Which stage, replica, expert rank, chunk of the sequence and shard is `rank`?
Coords coords_of(const MeshShape& shape, int rank) {
  (void)shape, (void)rank;
  SHARDLAB_TODO("ch08: coords_of");
}

// TODO(ch08): rank_of
int rank_of(const MeshShape& shape, const Coords& coords) {
  (void)shape, (void)coords;
  SHARDLAB_TODO("ch08: rank_of");
}

// TODO(ch08): groups
// Every group along `axis`, each in the order of its coordinate along it, the groups in
// the order of their first rank.
std::vector<std::vector<int>> groups(const MeshShape& shape, Axis axis) {
  (void)shape, (void)axis;
  SHARDLAB_TODO("ch08: groups");
}

}  // namespace ch08
